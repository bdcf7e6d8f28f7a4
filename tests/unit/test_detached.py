"""A client that cannot reach its daemon says so: at once with a diagnosis
(the socket it tried, why, the daemon's default socket in its environment),
then once a minute while detached, and when it attaches."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from ec_client.common.detached import DETACHED_WARNING_SECONDS, DetachedNotice
from ec_client.common.session import LinkListener, SessionLink
from ec_protocol.protocol import SOCKET_ENV, Layout
from ec_protocol.transport import Transport

LOGGER = "ec_client.common.session"


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """This process's environment: XDG_RUNTIME_DIR set, EC_DAEMON_SOCKET not."""
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_a_link_that_never_attached_names_the_socket_why_and_the_default(runtime, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    tried = runtime / "elsewhere.sock"
    notice = DetachedNotice(f"unix://{tried}", clock=Clock())
    notice.failed("attach failed: UNAVAILABLE: connect failed", retryable=True)
    ((level, line),) = lines(caplog)
    assert level == logging.WARNING
    assert f"unix://{tried}" in line and f"no socket at {tried}" in line
    assert f"unix://{runtime}/ec-daemon/ec.sock ($XDG_RUNTIME_DIR={runtime})" in line
    assert "--ec-transfer-config" in line


def test_the_default_socket_is_said_to_be_the_default(runtime, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    default = f"unix://{runtime}/ec-daemon/ec.sock"
    DetachedNotice(default, clock=Clock()).failed("attach failed: UNAVAILABLE", retryable=True)
    ((_, line),) = lines(caplog)
    assert "This is the daemon's default socket in this process's environment" in line
    assert f"$XDG_RUNTIME_DIR={runtime}" in line and "another $XDG_RUNTIME_DIR" in line


def test_a_socket_file_nobody_answers_on_is_not_called_missing(runtime, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    path = runtime / "stale.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))  # a socket file, and no daemon listening on it
    DetachedNotice(f"unix://{path}", clock=Clock()).failed("attach failed: UNAVAILABLE",
                                                           retryable=True)
    ((_, line),) = lines(caplog)
    assert "no socket at" not in line and f"unix://{path}" in line


def test_while_detached_the_warning_comes_back_once_a_minute(runtime, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    notice = DetachedNotice("unix:///nowhere/ec.sock", clock=clock)
    for _ in range(240):  # a retry every 0.25 s for a minute
        notice.failed("attach failed: UNAVAILABLE", retryable=True)
        clock.now += 0.25
    assert len(lines(caplog)) == 1
    clock.now += 0.1
    notice.failed("attach failed: UNAVAILABLE", retryable=True)
    assert len(lines(caplog)) == 2
    level, line = lines(caplog)[-1]
    assert level == logging.WARNING
    assert f"still not attached to unix:///nowhere/ec.sock after {DETACHED_WARNING_SECONDS:.0f}" \
        in line


def test_a_refusal_retrying_cannot_cure_is_an_error_whenever_it_changes(runtime, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    notice = DetachedNotice("unix:///nowhere/ec.sock", clock=clock)
    notice.failed("attach failed: UNAVAILABLE", retryable=True)
    clock.now += 1
    notice.failed("attach failed: FAILED_PRECONDITION: protocol 2, daemon speaks 3",
                  retryable=False)
    notice.failed("attach failed: FAILED_PRECONDITION: protocol 2, daemon speaks 3",
                  retryable=False)
    assert [level for level, _ in lines(caplog)] == [logging.WARNING, logging.ERROR]
    assert "protocol 2" in lines(caplog)[-1][1]


def test_attaching_after_a_warning_says_so_and_a_later_loss_is_one_short_line(runtime,
                                                                               caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    notice = DetachedNotice("unix:///nowhere/ec.sock", clock=clock)
    notice.failed("attach failed: UNAVAILABLE", retryable=True)
    clock.now += 3
    notice.now_attached()
    assert lines(caplog)[-1] == (logging.INFO, "ec-daemon: attached to unix:///nowhere/ec.sock "
                                               "after 3.0 s without it")
    caplog.clear()
    notice.failed("session stream lost: UNAVAILABLE", retryable=True)  # a daemon restart
    ((level, line),) = lines(caplog)
    assert level == logging.WARNING and "attaching again" in line
    assert "Start the daemon" not in line  # it was reachable: no set-up advice


def test_a_real_link_to_a_socket_nobody_serves_warns_within_a_second(runtime, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    uri = f"unix://{runtime}/ec-daemon/ec.sock"
    link = SessionLink(Transport(uri, deadline_seconds=1.0), engine_id="E", role="both",
                       layout=Layout("m", "float32", {"embeds": 4096}), listener=LinkListener())
    link.start()
    try:
        deadline = time.monotonic() + 10
        while not lines(caplog) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        link.stop()
    ((level, line), *_) = lines(caplog)
    assert level == logging.WARNING and uri in line and "no socket at" in line
    assert link.attachment is None
