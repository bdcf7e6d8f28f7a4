"""Saying, plainly and at a low rate, that a client cannot reach its daemon.

An engine whose connector cannot attach keeps serving without the cache:
every lookup misses and saves are skipped. That is the right behaviour and
an invisible one, so the first failure is a WARNING that names the socket
tried, why it failed (no socket there, a socket nobody answers on, a
refusal), and the daemon's default socket in this process's environment
(the usual mistake: the engine and `make run` disagree on it). While the
link stays detached the warning is repeated every DETACHED_WARNING_SECONDS,
and attaching after a warning is logged too. `attached` is what vLLM's
`/metrics` shows (`vllm:ec_daemon_attached`).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable

from ec_client.common.limits import DETACHED_WARNING_SECONDS
from ec_protocol.protocol import SOCKET_ENV, default_socket_uri, unix_path

log = logging.getLogger("ec_client.common.session")



def socket_problem(uri: str) -> str:
    """What is at a unix socket's path, as an operator would want it said
    ("" for TCP, and for a socket file that is there)."""
    path = unix_path(uri)
    if path is None:
        return ""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"no socket at {path}: no daemon serves there"
    except OSError as exc:
        return f"cannot look at {path}: {exc.strerror}"
    if not stat.S_ISSOCK(info.st_mode):
        return f"{path} is not a socket"
    return ""


def where_the_default_is() -> str:
    """The daemon's default socket as this process's environment makes it,
    and what it depends on."""
    if os.environ.get(SOCKET_ENV):
        return f"${SOCKET_ENV} sets it to {os.environ[SOCKET_ENV]}"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    made_of = f"$XDG_RUNTIME_DIR={runtime}" if runtime else "no $XDG_RUNTIME_DIR, uid " + \
        str(os.getuid())
    return f"{default_socket_uri()} ({made_of})"


class DetachedNotice:
    """The log lines of one link about being detached. Not thread-safe: the
    link's thread alone calls `failed` and `now_attached`."""

    def __init__(self, uri: str, *, clock: Callable[[], float] = time.monotonic,
                 interval: float = DETACHED_WARNING_SECONDS) -> None:
        self.uri = uri
        self._clock = clock
        self._interval = interval
        self._since: float | None = None  # detached since (None: attached, or never tried)
        self._said_at = 0.0
        self._said = ""
        self._ever_attached = False

    def failed(self, error: str, *, retryable: bool) -> None:
        """An attach failed, or the session was lost, with `error`. The first
        failure is logged at once (with the whole diagnosis when this link
        never attached), a refusal that retrying cannot cure whenever it
        changes, and the rest once every `interval`."""
        now = self._clock()
        emit = log.warning if retryable else log.error
        if self._since is None:
            self._since = now
            self._say(now, error, self.first_warning(error) if not self._ever_attached
                      else f"ec-daemon: {error} ({self.uri}); attaching again", emit)
        elif (not retryable and error != self._said) or now >= self._said_at + self._interval:
            self._say(now, error, f"ec-daemon: still not attached to {self.uri} after "
                                  f"{now - self._since:.0f} s ({error}); lookups miss and "
                                  "saves are skipped until it answers", emit)

    def _say(self, now: float, error: str, line: str, emit: Callable[..., None]) -> None:
        self._said_at, self._said = now, error
        emit("%s", line)

    def first_warning(self, error: str) -> str:
        """The diagnosis of a link that never attached."""
        problem = socket_problem(self.uri)
        default = where_the_default_is()
        if default.startswith(f"{self.uri} "):
            hint = ("This is the daemon's default socket in this process's environment "
                    f"({default.removeprefix(self.uri).strip(' ()')}); a daemon run by another "
                    "user, or with another $XDG_RUNTIME_DIR, serves elsewhere")
        else:
            hint = f"The daemon's default socket in this process's environment is {default}"
        return (f"ec-daemon: not attached to the daemon at {self.uri} ({error}"
                f"{'; ' + problem if problem else ''}). This engine serves without the cache "
                f"(lookups miss, saves are skipped) until the daemon answers. {hint}. Start "
                "the daemon (`ec-daemon`, or `make run` in its checkout), or set "
                "ec_daemon_socket to the socket it serves: its start-up log prints the "
                "--ec-transfer-config to paste.")

    def now_attached(self) -> None:
        """An attachment was made."""
        if self._since is not None:
            log.info("ec-daemon: attached to %s after %.1f s without it", self.uri,
                     self._clock() - self._since)
        self._since = None
        self._ever_attached = True
