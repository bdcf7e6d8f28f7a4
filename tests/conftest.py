"""Suite-wide guard: whatever the tests start, they stop, and /dev/shm is
left as found (no region file of ours survives the suite). The run ends with
one line naming each test group that did not run here (tests/groups.py)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import psutil
import pytest

from ec_daemon.durable.region import PREFIX, SUFFIX
from tests import groups

SHM = Path("/dev/shm")


def _regions() -> set[Path]:
    return set(SHM.glob(f"{PREFIX}*{SUFFIX}")) if SHM.is_dir() else set()


def _orphaned(path: Path) -> bool:
    """No live daemon holds this region's lock: it was left behind.
    (Regions of daemons outside this run, alive, are not ours to judge.)"""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _daemons() -> set[int]:
    me = psutil.Process()
    found = set()
    for child in me.children(recursive=True):
        try:
            if "ec_daemon" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    before = _regions()
    yield
    leaked = {path for path in _regions() - before if _orphaned(path)}
    running = _daemons()
    assert not leaked, f"region files left in /dev/shm: {sorted(map(str, leaked))}"
    assert not running, f"daemon processes still running: {sorted(running)}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """List how many cases each budgeted property test ran, and why it
    stopped (tests/property_budget.py), so a time-capped run is visible."""
    lines = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            spent = dict(report.user_properties)
            if "hypothesis_cases" in spent:
                lines.append(f"{report.nodeid}: {spent['hypothesis_cases']} cases in "
                             f"{spent['hypothesis_seconds']}s, stopped by "
                             f"{spent['hypothesis_stopped_by']}")
    if lines:
        terminalreporter.write_sep("-", "property test budgets")
        for line in sorted(lines):
            terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The last line of the run: the groups that did not run here, why, and
    the command that runs each (after pytest's own totals, so it is seen)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    skips = []
    for report in reporter.stats.get("skipped", []):
        if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
            skips.append((report.nodeid, reason, isinstance(report, pytest.CollectReport)))
    line = groups.not_run(skips)
    if line:
        reporter.write_line(line, yellow=True, bold=True)
