import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.daemon import Daemon
from tests.integration.engines import Proc


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts, killed at its end if still running."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


@pytest.fixture
def daemon():
    with Daemon(cpu_bytes="64MiB") as d:
        yield d


@pytest.fixture
def shm_folder():
    """A private folder in /dev/shm, so counting region files sees only ours."""
    folder = Path(tempfile.mkdtemp(prefix="ecd-test-", dir="/dev/shm"))
    yield folder
    leftovers = list(folder.iterdir())
    for path in leftovers:
        path.unlink()
    folder.rmdir()
    assert not leftovers, f"left in {folder}: {leftovers}"
