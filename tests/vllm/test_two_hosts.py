"""Two hosts sharing a Redis Cluster, or a Mooncake Store, as the second tier:
an engine on host 1 encodes images; a fresh engine on host 2 (another daemon,
socket and region) runs the encoder 0 times for them (each miss is deferred
while host 2's daemon promotes the image from the store), and its outputs
equal those of an engine without the connector. On Mooncake, the master
killed mid-run: engines keep serving (and encode); back, promotions resume."""

from __future__ import annotations

import pytest

from tests import groups, mooncake_servers, redis_servers
from tests.integration.daemon import Daemon
from tests.vllm.engine_proc import A, B, C, D, run_engine, same_output

pytestmark = [pytest.mark.timeout(1200)]
needs_redis = groups.needs_redis
check_mooncake = groups.check_mooncake


@needs_redis
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


def test_on_mooncake_a_fresh_engine_on_another_host_runs_the_encoder_zero_times(
        tiny_model, reference):
    check_mooncake()
    with mooncake_servers.master() as master:
        url = master.url_with(segment="256MiB", buffer="32MiB")
        with Daemon(cpu_bytes="64MiB", extra=("--remote", url)) as host1, \
                Daemon(cpu_bytes="64MiB", extra=("--remote", url)) as host2:
            for host in (host1, host2):
                host.wait_for(lambda h=host: h.stats()["remote_tier"]["reachable"] == 1,
                              timeout=30, what="the daemon to reach the master")
            first = run_engine(tiny_model, [A, B], socket=host1.socket)
            assert first["encoder_images"] == 2
            host1.wait_for(lambda: host1.stats()["remote_tier"]["publishes"] == 2, timeout=30,
                           what="host 1 to publish A and B")

            second = run_engine(tiny_model, [A, B], socket=host2.socket)
            assert second["encoder_images"] == 0, (host2.stats()["remote_tier"],
                                                   second["output"][-3000:])
            for image in (A, B):
                assert same_output(second["results"][image], reference[image])
            tier = host2.stats()["remote_tier"]
            assert tier["remote_hits"] == 2 and tier["bad_values"] == 0

            # The master dies: a new image on host 2 is encoded, served right.
            master.kill()
            third = run_engine(tiny_model, [C], socket=host2.socket)
            assert third["encoder_images"] == 1
            assert same_output(third["results"][C], reference[C])
            # It comes back (empty): what host 1 encodes now, host 2 promotes.
            master.restart()
            published = host1.stats()["remote_tier"]["publishes"]
            fourth = run_engine(tiny_model, [D], socket=host1.socket)
            assert fourth["encoder_images"] == 1
            host1.wait_for(
                lambda: host1.stats()["remote_tier"]["publishes"] == published + 1,
                timeout=60, what="host 1 to publish D once the master is back")
            fifth = run_engine(tiny_model, [D], socket=host2.socket)
            assert fifth["encoder_images"] == 0, fifth["output"][-3000:]
            assert same_output(fifth["results"][D], reference[D])
