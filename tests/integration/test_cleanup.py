"""The tests remove only what they made: a region that a daemon they did not
start kept for its next start (what `make run` leaves, or a host's daemon
stopped for an upgrade: a warm cache) survives every way a test's daemon is
cleaned up, while what the test's daemon left is removed.

In a private folder in /dev/shm, as the test daemons' shm_dir: other test
runs on the host (older checkouts) must not decide the outcome. .ci/run
checks the same on the real /dev/shm across the whole of `make test`."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.daemon import Daemon, kept_region, regions_of, remove_regions_of

pytestmark = pytest.mark.integration


def test_cleaning_up_a_tests_daemons_leaves_another_daemons_kept_region(shm_folder: Path) -> None:
    shm = str(shm_folder)
    with kept_region(shm) as theirs:
        # Stopped cleanly: the test's daemon keeps its region too, then the
        # test removes it.
        stopped = Daemon(cpu_bytes="4MiB", shm_dir=shm).start()
        assert stopped.stop() == 0
        (kept,) = stopped.own_regions()
        stopped.cleanup()
        assert not kept.exists() and not kept.with_suffix(".index").exists()
        # Killed: what SIGKILL leaves (region, index, socket) goes too.
        killed = Daemon(cpu_bytes="4MiB", shm_dir=shm).start()
        killed.stop(signal.SIGKILL)
        (left,) = killed.own_regions()
        killed.cleanup()
        assert not left.exists() and not killed.socket_path.exists()
        # Running when the test ends, and never started.
        with Daemon(cpu_bytes="4MiB", shm_dir=shm) as running:
            assert running.serving()
        Daemon(shm_dir=shm).cleanup()
        assert theirs.intact(), theirs


def test_a_running_daemons_region_is_never_removed_by_its_socket(shm_folder: Path) -> None:
    """Cleaning up by socket takes only regions no live daemon holds."""
    d = Daemon(cpu_bytes="4MiB", shm_dir=str(shm_folder)).start()
    try:
        (region,) = d.own_regions()
        assert remove_regions_of(d.shm_dir, d.socket) == []
        assert region.exists() and d.serving()
    finally:
        d.cleanup()
    assert regions_of(d.shm_dir, d.socket) == []
