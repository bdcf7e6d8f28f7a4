"""Two hosts sharing a Redis Cluster as the second tier: an engine on host 1
encodes images; a fresh engine on host 2 (another daemon, socket and region)
runs the encoder 0 times for them (each miss is deferred while host 2's
daemon promotes the image from the store), and its outputs equal those of an
engine without the connector."""

from __future__ import annotations

import pytest

from tests import redis_servers
from tests.integration.daemon import Daemon
from tests.vllm.engine_proc import A, B, run_engine, same_output

pytestmark = [pytest.mark.timeout(1200),
              pytest.mark.skipif(not redis_servers.available(),
                                 reason="redis-server is not installed")]


def test_a_fresh_engine_on_another_host_runs_the_encoder_zero_times(tiny_model, reference):
    with redis_servers.cluster(3) as store, \
            Daemon(cpu_bytes="64MiB", extra=("--remote", store.url)) as host1, \
            Daemon(cpu_bytes="64MiB", extra=("--remote", store.url)) as host2:
        first = run_engine(tiny_model, [A, B], socket=host1.socket)
        assert first["encoder_images"] == 2
        host1.wait_for(lambda: host1.stats()["remote_tier"]["publishes"] == 2, timeout=30,
                       what="host 1 to publish A and B")

        second = run_engine(tiny_model, [A, B], socket=host2.socket)
        assert second["encoder_images"] == 0, second["output"][-3000:]
        for image in (A, B):
            assert same_output(second["results"][image], reference[image])
        stats = host2.stats()
        assert stats["convergence"]["promotions"] == 2
        assert stats["remote_tier"]["remote_hits"] == 2
        assert stats["loads"] == 2
