"""auth: setting access on the socket and its folder never follows a symlink;
which token may call which method."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ec_daemon.serving.auth import (
    READ_ONLY_METHODS,
    AuthError,
    TokenInterceptor,
    apply_access,
    bearer,
    open_folder_to_group,
    token_interceptor,
)
from ec_protocol.protocol import pb

FULL = "full-token-0123456789abcdef"
READ = "read-token-0123456789abcdef"
DAEMON = pb.DESCRIPTOR.services_by_name["ECDaemon"]


@pytest.fixture
def base() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="ecd-"))
    yield folder
    shutil.rmtree(folder)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_apply_access_sets_group_and_mode_on_the_socket(base: Path) -> None:
    path = base / "ec.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        apply_access(path, 0o660, os.getegid())
    assert mode_of(path) == 0o660 and path.lstat().st_gid == os.getegid()


def test_apply_access_refuses_a_symlink_and_leaves_its_target_alone(base: Path) -> None:
    target = base / "secret"
    target.write_text("x")
    os.chmod(target, 0o600)
    link = base / "ec.sock"
    link.symlink_to(target)
    with pytest.raises(AuthError, match="symlink"):
        apply_access(link, 0o666, os.getegid())
    assert mode_of(target) == 0o600


def test_open_folder_to_group_lets_the_group_traverse_our_folder(base: Path) -> None:
    folder = base / "sock"
    folder.mkdir(mode=0o700)
    open_folder_to_group(folder, os.getegid())
    assert mode_of(folder) == 0o710 and folder.lstat().st_gid == os.getegid()


def test_open_folder_to_group_does_not_follow_a_symlink(base: Path) -> None:
    real = base / "real"
    real.mkdir(mode=0o700)
    link = base / "sock"
    link.symlink_to(real)
    with pytest.raises(AuthError, match=f"{link}: it is a symlink or not a folder"):
        open_folder_to_group(link, os.getegid())
    assert mode_of(real) == 0o700


def test_a_daemon_outside_its_group_is_told_so(base: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """A non-root daemon asked for --group it is not in cannot chown the
    socket: the error names the cause and the fix, not just EPERM."""
    path = base / "ec.sock"
    path.write_text("")

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chown", refuse)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setattr(os, "getgid", lambda: 1000)
    monkeypatch.setattr(os, "getgroups", lambda: [1000])
    with pytest.raises(AuthError, match=r"not in group 3000.*--group-add 3000"):
        apply_access(path, 0o660, 3000)


def method(name: str) -> str:
    return f"/{DAEMON.full_name}/{name}"


def write_token(folder: Path, name: str, token: str) -> str:
    path = folder / name
    path.write_text(token + "\n")
    return str(path)


@pytest.fixture
def tokens(base: Path) -> TokenInterceptor:
    interceptor = token_interceptor(write_token(base, "token", FULL),
                                    write_token(base, "read-token", READ))
    assert interceptor is not None
    return interceptor


@pytest.mark.parametrize("path", sorted(READ_ONLY_METHODS))
def test_the_read_only_token_may_watch_stats_lookup_and_check_health(tokens, path):
    assert tokens.refusal(path, bearer(READ)) is None


def test_the_read_only_methods_are_exactly_these() -> None:
    assert {
        method("Watch"), method("Stats"), method("Lookup"), "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List"} == READ_ONLY_METHODS


@pytest.mark.parametrize("name", sorted(
    m.name for m in DAEMON.methods if method(m.name) not in READ_ONLY_METHODS))
def test_the_read_only_token_may_not_attach_allocate_report_or_anything_else(tokens, name):
    code, details = tokens.refusal(method(name), bearer(READ))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == (f"{DAEMON.full_name}/{name} needs the full token: the read-only token "
                       "only reads (Watch, Stats, Lookup, health)")


def test_the_read_only_token_may_not_call_a_service_added_later(tokens):
    code, _ = tokens.refusal("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                             bearer(READ))
    assert code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("name", [m.name for m in DAEMON.methods])
def test_the_full_token_may_call_everything(tokens, name):
    assert tokens.refusal(method(name), bearer(FULL)) is None


@pytest.mark.parametrize("metadata", [
    (), bearer("wrong-token-0123456789abcdef"), bearer(READ + "x"), bearer(READ[:-1]),
    (("authorization", READ),), (("x-token", f"Bearer {FULL}"),)])
@pytest.mark.parametrize("name", ["Stats", "Attach"])
def test_no_token_or_another_is_unauthenticated(tokens, metadata, name):
    code, _ = tokens.refusal(method(name), metadata)
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_without_a_read_only_token_the_full_token_alone_counts(base: Path) -> None:
    interceptor = token_interceptor(write_token(base, "token", FULL), "")
    assert interceptor is not None
    assert interceptor.refusal(method("Stats"), bearer(FULL)) is None
    code, _ = interceptor.refusal(method("Stats"), bearer(READ))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_no_token_file_means_no_interceptor() -> None:
    assert token_interceptor("", "") is None


def test_a_read_only_token_needs_the_full_one(base: Path) -> None:
    with pytest.raises(AuthError, match="--read-token-file needs --token-file"):
        token_interceptor("", write_token(base, "read-token", READ))


def test_the_read_only_token_must_differ_from_the_full_one(base: Path) -> None:
    full = write_token(base, "token", FULL)
    same = write_token(base, "read-token", f"  {FULL}  ")
    with pytest.raises(AuthError, match=f"the read-only token in {same} is the full token of "
                                        f"{full}: give routers a different token"):
        token_interceptor(full, same)


def test_a_short_read_only_token_is_refused(base: Path) -> None:
    short = write_token(base, "read-token", "short")
    with pytest.raises(AuthError, match=f"token in {short} is shorter than 16 characters"):
        token_interceptor(write_token(base, "token", FULL), short)
