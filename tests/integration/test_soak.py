"""A short soak in CI (`make soak` runs the long one): 8 engine processes,
random saves, loads and evictions under memory pressure, every loaded byte
checked."""

from __future__ import annotations

import os

import pytest

from tests.integration import soak

pytestmark = pytest.mark.integration


def test_soak_has_no_corruption_and_no_leaks():
    seconds = float(os.environ.get("SOAK_SECONDS", "20"))
    summary = soak.run(processes=8, seconds=seconds)
    print("\n" + soak.format_summary(summary))
    # Every load returned the saved bytes, and none had to be refused by the
    # stamp check: the views kept evicted pages from reuse under every load.
    assert summary["corrupt"] == 0 and summary["loads_failed"] == 0
    assert summary["loads_verified"] > 100 and summary["evictions"] > 0
    # Every lookup reached the daemon's counters (on heartbeats, the last
    # ones flushed at close).
    assert summary["daemon_hits"] == summary["hits"]
    # Every hit adopted what its workers staged, and those were the saved bytes.
    assert summary["loads_verified"] == summary["hits"]
    # Once every engine detached nothing is held: no pending saves, no hidden
    # pages awaiting an acknowledgement, nothing quarantined, no ghost.
    assert all(summary[name] == 0 for name in soak.LEFT), summary
    assert summary["pages_accounted"]
    # The daemon's memory does not grow with the traffic (the region is shm, not RSS).
    assert summary["daemon_rss_peak_mib"] < summary["daemon_rss_start_mib"] + 64
