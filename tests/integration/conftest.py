import pytest

from tests.integration.daemon import Daemon


@pytest.fixture
def daemon():
    d = Daemon(cpu_bytes="64MiB")
    d.start()
    yield d
    d.cleanup()
