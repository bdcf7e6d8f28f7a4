"""Who may talk to the daemon: file modes, groups, and tokens.

A Unix socket and the region are owner-only by default; `--socket-mode` and
`--group` open both to a group (a vLLM container's user). TCP is refused
unless a token file is given: every call must then carry
`authorization: Bearer <token>` or gets UNAUTHENTICATED. TLS (cert and key
flags) is optional on top, for TCP.
"""

from __future__ import annotations

import grp
import hmac
import os
import shutil
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

METADATA_KEY = "authorization"


class AuthError(Exception):
    """A permission setting cannot be applied; the message is for the operator."""


def parse_mode(text: str) -> int:
    """'0660' -> 0o660; only permission bits, read and write (no execute)."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise ValueError(f"invalid mode {text!r}: use octal like 0600 or 0660") from None
    if mode & ~0o666:
        raise ValueError(f"invalid mode {text!r}: only read/write bits (e.g. 0600, 0660)")
    if not mode & 0o600 == 0o600:
        raise ValueError(f"invalid mode {text!r}: the owner needs read and write")
    return mode


def resolve_group(name: str) -> int | None:
    """A group name or number -> gid; None for ''. Raises AuthError."""
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise AuthError(f"unknown group {name!r}") from None


def apply_access(path: str | Path, mode: int, gid: int | None) -> None:
    """Give `path` (socket or region) `mode` and, if set, the group `gid`."""
    try:
        if gid is not None:
            shutil.chown(path, group=gid)
        os.chmod(path, mode)
    except OSError as exc:
        raise AuthError(f"cannot set access on {path}: {exc.strerror}") from None


def open_folder_to_group(folder: Path, gid: int | None) -> None:
    """A socket folder we created: let the group traverse it (0710)."""
    if gid is None:
        return
    info = folder.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700:
        apply_access(folder, 0o710, gid)


def read_token(path: str) -> str:
    """The token in `path` (surrounding whitespace ignored). Raises AuthError."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise AuthError(f"cannot read token file {path}: {exc.strerror}") from None
    if len(token) < 16:
        raise AuthError(f"token in {path} is shorter than 16 characters")
    return token


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token`."""
    return ((METADATA_KEY, f"Bearer {token}"),)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the right bearer token (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

    async def intercept_service(
            self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == METADATA_KEY and hmac.compare_digest(str(value), self._expected):
                return handler
        if handler is None:
            return None
        return _denying(handler)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong token (authorization: Bearer <token>)")


def _denying(handler: Any) -> Any:
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(_deny, **kwargs)
