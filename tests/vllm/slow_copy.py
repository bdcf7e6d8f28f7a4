"""A copy backend whose first load is slow, to hold a load in flight.

Selected by name through the connector's extra config, as a deployment
would select its own backend:
`"ec_daemon_copy_backend": "tests.vllm.slow_copy:SlowLoadBackend"`.

It is the `cpu` backend, except that the first load in a process, before
copying anything, creates the file named by $EC_TEST_SLOW_LOAD_MARKER
(writing `start`), sleeps $EC_TEST_SLOW_LOAD_SECONDS, copies, then appends
`done`. A test watches the file to act while the load is in flight and to
check afterwards that it did. Later loads are plain copies.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ec_client.copy import Extents
from ec_client.copy.cpu_backend import Backend
from ec_client.copy.mapping import RegionMapping

MARKER_ENV = "EC_TEST_SLOW_LOAD_MARKER"
SECONDS_ENV = "EC_TEST_SLOW_LOAD_SECONDS"


class SlowLoadBackend(Backend):
    name = "slow-cpu"

    def __init__(self) -> None:
        super().__init__()
        self.marker = os.environ.get(MARKER_ENV, "")
        self.seconds = float(os.environ.get(SECONDS_ENV, "0"))
        self.slowed = False

    def load(self, mapping: RegionMapping, extents: Extents, out: Any) -> Any:
        if self.slowed or not self.marker:
            return super().load(mapping, extents, out)
        self.slowed = True
        with open(self.marker, "x") as marker:  # "x": only one load per test is slow
            marker.write("start\n")
        time.sleep(self.seconds)
        result = super().load(mapping, extents, out)
        with open(self.marker, "a") as marker:
            marker.write("done\n")
        return result


class SlowSaveBackend(Backend):
    """The `cpu` backend whose first save in a process writes `start` to
    $EC_TEST_SLOW_LOAD_MARKER, then sleeps $EC_TEST_SLOW_LOAD_SECONDS before
    copying (an engine that encoded an item and is still saving it)."""

    name = "slow-save-cpu"

    def __init__(self) -> None:
        super().__init__()
        self.marker = os.environ.get(MARKER_ENV, "")
        self.seconds = float(os.environ.get(SECONDS_ENV, "0"))
        self.slowed = False

    def save(self, source: Any, mapping: RegionMapping, extents: Extents,
             ready: Any = None) -> None:
        if not self.slowed and self.marker:
            self.slowed = True
            with open(self.marker, "x") as marker:
                marker.write("start\n")
            time.sleep(self.seconds)
        super().save(source, mapping, extents, ready)


def marker_state(path: str) -> list[str]:
    """The lines the backend wrote so far ([] before the slow load began)."""
    try:
        with open(path) as marker:
            return marker.read().split()
    except FileNotFoundError:
        return []
