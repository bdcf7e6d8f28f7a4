"""prepare_socket: the daemon serves only from a socket folder it can trust."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ec_daemon.serving.startup import StartupError, prepare_socket

STRANGER = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder away needs root")


@pytest.fixture
def base() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="ecd-"))
    yield folder
    shutil.rmtree(folder)


def folder_with_mode(base: Path, mode: int) -> Path:
    folder = base / "sock"
    folder.mkdir()
    os.chmod(folder, mode)
    return folder


def uri(folder: Path) -> str:
    return f"unix://{folder}/ec.sock"


def test_a_missing_folder_is_created_owner_only(base: Path) -> None:
    folder = base / "a" / "sock"
    target, lock = prepare_socket(uri(folder))
    assert target == f"unix://{folder}/ec.sock"
    lock.release()
    info = folder.lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.geteuid()


@as_root
def test_a_folder_of_another_user_is_refused(base: Path) -> None:
    folder = folder_with_mode(base, 0o700)
    os.chown(folder, STRANGER, STRANGER)
    with pytest.raises(StartupError, match=f"{folder}: it belongs to uid {STRANGER}"):
        prepare_socket(uri(folder))


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o703])
def test_a_folder_writable_by_every_user_is_refused(base: Path, mode: int) -> None:
    folder = folder_with_mode(base, mode)
    with pytest.raises(StartupError, match=f"{folder}: it is writable by every user"):
        prepare_socket(uri(folder))


def test_a_symlink_to_our_own_folder_is_refused(base: Path) -> None:
    real = folder_with_mode(base, 0o700)
    link = base / "link"
    link.symlink_to(real)
    with pytest.raises(StartupError, match=f"{link}: it is a symlink"):
        prepare_socket(uri(link))


def test_a_dangling_symlink_is_refused_and_not_followed(base: Path) -> None:
    link = base / "link"
    link.symlink_to(base / "elsewhere")
    with pytest.raises(StartupError, match=f"{link}: it is a symlink"):
        prepare_socket(uri(link))
    assert not (base / "elsewhere").exists()


def test_a_group_writable_folder_needs_that_group_given_as_group(base: Path) -> None:
    folder = folder_with_mode(base, 0o770)
    group = folder.lstat().st_gid
    with pytest.raises(StartupError, match=f"writable by group {group}"):
        prepare_socket(uri(folder))
    with pytest.raises(StartupError, match=f"writable by group {group}"):
        prepare_socket(uri(folder), group + 1)
    prepare_socket(uri(folder), group)[1].release()


def test_the_refusal_is_one_line_that_says_what_to_do(base: Path) -> None:
    folder = folder_with_mode(base, 0o777)
    with pytest.raises(StartupError) as info:
        prepare_socket(uri(folder))
    message = str(info.value)
    assert "\n" not in message and "choose --socket" in message and "remove it" in message


def test_a_stale_socket_in_a_trusted_folder_is_removed(base: Path) -> None:
    folder = folder_with_mode(base, 0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(folder / "ec.sock"))  # bound, never listening: refused
    prepare_socket(uri(folder))[1].release()
    assert not (folder / "ec.sock").exists()


def test_two_daemons_starting_at_once_on_one_socket_cannot_both_go_on(base: Path) -> None:
    """The socket answers only once a daemon serves (after adopting or
    pre-faulting its region), so a probe alone lets two starts race: the
    socket's lock decides. At exit the lock goes with the socket."""
    folder = folder_with_mode(base, 0o700)
    _, lock = prepare_socket(uri(folder))
    with pytest.raises(StartupError, match="another daemon is serving or starting"):
        prepare_socket(uri(folder))
    lock.release()
    assert list(folder.iterdir()) == []
    prepare_socket(uri(folder))[1].release()
