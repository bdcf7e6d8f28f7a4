"""Clients refuse a socket or region file they should not trust."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ec_client.common.trust import UntrustedError, socket_owner
from ec_client.copy.mapping import RegionMapping

STRANGER = 65534  # nobody
SIZE = 1 << 16
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")


@pytest.fixture
def base() -> Iterator[Path]:
    """A fresh folder in /tmp, a folder every user can write to."""
    folder = Path(tempfile.mkdtemp(prefix="ecd-"))
    yield folder
    shutil.rmtree(folder)


@pytest.fixture
def private_base() -> Iterator[Path]:
    """A fresh folder with no folder above it that every user can write to."""
    home = Path.home()
    if any(os.stat(p).st_mode & stat.S_IWOTH for p in (home, *home.parents)):
        pytest.skip(f"{home} or a folder above it is writable by every user")
    folder = Path(tempfile.mkdtemp(prefix="ecd-", dir=home))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder)


def bound_socket(folder: Path) -> Path:
    path = folder / "ec.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
    return path


def stranger_socket(base: Path) -> Path:
    """A socket in a folder of its own, both owned by another user."""
    folder = base / "sock"
    folder.mkdir(mode=0o755)
    path = bound_socket(folder)
    os.chown(path, STRANGER, STRANGER)
    os.chown(folder, STRANGER, STRANGER)
    return path


def region_file(folder: Path) -> Path:
    path = folder / "ec-daemon-0000000000000001.region"
    path.write_bytes(bytes(SIZE))
    return path


def test_our_socket_names_us_and_tcp_names_nobody(base: Path) -> None:
    path = bound_socket(base)
    assert socket_owner(f"unix://{path}") == os.geteuid()
    assert socket_owner("127.0.0.1:50051") is None


def test_a_symlink_to_our_socket_is_refused(base: Path) -> None:
    link = base / "link.sock"
    link.symlink_to(bound_socket(base))
    with pytest.raises(UntrustedError, match="is a symlink"):
        socket_owner(f"unix://{link}")


def test_a_file_that_is_not_a_socket_is_refused(base: Path) -> None:
    path = base / "ec.sock"
    path.write_text("")
    with pytest.raises(UntrustedError, match="is not a socket"):
        socket_owner(f"unix://{path}")


@as_root
def test_a_strangers_socket_below_a_folder_anyone_can_write_is_refused(base: Path) -> None:
    path = stranger_socket(base)  # the squatter's /tmp/ec-daemon-$UID/ec.sock
    with pytest.raises(UntrustedError, match=f"belongs to uid {STRANGER}.*/tmp is writable"):
        socket_owner(f"unix://{path}")


@as_root
def test_another_users_socket_in_a_folder_set_up_for_it_is_trusted(private_base: Path) -> None:
    path = stranger_socket(private_base)  # like the daemon user's /run/ec-daemon
    assert socket_owner(f"unix://{path}") == STRANGER


@as_root
def test_a_path_through_a_symlink_in_a_folder_anyone_can_write_is_refused(
        base: Path, private_base: Path) -> None:
    path = stranger_socket(private_base)
    link = base / "link"
    link.symlink_to(path.parent)
    with pytest.raises(UntrustedError, match="writable by every user"):
        socket_owner(f"unix://{link}/ec.sock")


def test_a_region_reached_through_a_symlink_is_refused(base: Path) -> None:
    link = base / "link.region"
    link.symlink_to(region_file(base))
    with pytest.raises(UntrustedError, match="is a symlink"):
        RegionMapping(str(link), SIZE, generation=1)


def test_a_region_that_is_not_a_regular_file_is_refused(base: Path) -> None:
    fifo = base / "fifo.region"
    os.mkfifo(fifo)
    with pytest.raises(UntrustedError, match="not a regular file"):
        RegionMapping(str(fifo), SIZE, generation=1)


def test_a_region_of_another_owner_is_refused(base: Path) -> None:
    path = region_file(base)
    if os.geteuid() == 0:
        os.chown(path, STRANGER, STRANGER)
        expected = 0
    else:
        expected = os.geteuid() + 1  # the file is ours, the daemon someone else
    with pytest.raises(UntrustedError, match=f"belongs to uid {path.stat().st_uid}"):
        RegionMapping(str(path), SIZE, generation=1, expected_uid=expected)


def test_a_region_of_the_daemons_user_or_root_is_mapped(base: Path) -> None:
    path = region_file(base)
    RegionMapping(str(path), SIZE, generation=1, expected_uid=os.geteuid()).close()
    if os.geteuid() == 0:  # a root-owned region is trusted whoever the daemon is
        RegionMapping(str(path), SIZE, generation=1, expected_uid=STRANGER).close()
