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
    assert summary["corrupt"] == 0
    assert summary["loads_verified"] > 100 and summary["evictions"] > 0
    assert summary["leaked_pinned_bytes"] == 0 and summary["leaked_pending_bytes"] == 0
    assert summary["leaked_evicting_bytes"] == 0 and summary["pages_accounted"]
    # The daemon's memory does not grow with the traffic (the region is shm, not RSS).
    assert summary["daemon_rss_peak_mib"] < summary["daemon_rss_start_mib"] + 64
