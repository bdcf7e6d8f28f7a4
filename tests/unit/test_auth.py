"""auth: setting access on the socket and its folder never follows a symlink."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ec_daemon.auth import AuthError, apply_access, open_folder_to_group


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
