import pytest

from tests.integration.daemon import Daemon


@pytest.fixture
def daemon():
    with Daemon(cpu_bytes="64MiB") as d:
        yield d
