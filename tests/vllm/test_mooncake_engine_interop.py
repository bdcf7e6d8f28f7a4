"""Real engines behind ec-daemon and vLLM's own Mooncake connector code share
one Mooncake store, engine to engine: with `embedding_model_identity` the
engines' keys are vLLM's (`build_embedding_namespace`, `make_embedding_key`).

An engine behind host 1's daemon encodes images A and B; the daemon publishes
both. A's value is read with vLLM's reader (`MooncakeEmbeddingStoreClient`),
removed with ec-daemon's checksum beside it, and written back by the class
vLLM's worker publishes with (`MooncakeEmbeddingStoreBackend`), as its worker
does: so the store holds exactly what vLLM's connector writes, no checksum. A
fresh engine behind host 2's daemon then runs the encoder 0 times for A (the
daemon promotes vLLM's value) and answers as an engine without a connector.
The other way: vLLM's worker-side read path (`resolve_inputs`) loads B as
host 1's daemon published it.

No engine runs vLLM's connector itself: it needs Model Runner V2, which on
CPU needs Triton's CPU backend (see test_mooncake_interop.py); this test runs
vLLM's connector code (its store client and backend) beside real engines.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding",
                    reason="this vLLM has no Mooncake embedding store (cross_encoder_cache)")

from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    TensorSpec,
    build_embedding_namespace,
    make_embedding_key,
)
from vllm.engine.arg_utils import EngineArgs

from ec_protocol.protocol import pb
from tests import mooncake_servers
from tests.integration.daemon import Daemon
from tests.vllm.engine_proc import A, B, run_engine, same_output
from tests.vllm.test_two_hosts import check_mooncake

pytestmark = [pytest.mark.timeout(1200)]

IDENTITY = {"embedding_model_identity": "tiny-paligemma@release-1"}
SIDECAR = "@ecd1"  # ec-daemon's checksum beside a value it published
WAIT = 30.0


def engine_namespace(model: Path, socket: str) -> str:
    """vLLM's store namespace for the engines of engine_run (same arguments
    as its LLM: float32, one image per prompt) with IDENTITY."""
    args = EngineArgs(
        model=str(model), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
        max_model_len=128, max_num_seqs=4, limit_mm_per_prompt={"image": 1}, seed=0,
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECDaemonConnector", ec_connector_module_path="ec_client.vllm_connector",
            ec_role="ec_both", ec_connector_extra_config={"ec_daemon_socket": socket,
                                                          **IDENTITY}))
    return build_embedding_namespace(args.create_engine_config())


def ready_entries(daemon: Daemon) -> list[Any]:
    """The daemon's ready entries (its Watch snapshot), in the order they
    were allocated (entry ids grow)."""
    events: list[Any] = []
    stream = daemon.stub.Watch(pb.WatchRequest())
    timer = threading.Timer(WAIT, stream.cancel)
    timer.start()
    try:
        for message in stream:
            events.extend(message.events)
            if message.snapshot_done:
                break
    finally:
        timer.cancel()
        stream.cancel()
    assert all(e.kind == pb.WatchEvent.STORED for e in events), events
    return sorted(events, key=lambda e: e.entry_id)


def spec_of(entry: Any) -> TensorSpec:
    dtype = getattr(torch, entry.dtype)
    return TensorSpec(tuple(entry.shape), str(dtype), int(entry.nbytes))


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_engines_behind_daemons_and_vllms_mooncake_connector_code_share_outputs(
        tiny_model, reference):
    check_mooncake()
    from mooncake.store import ReplicateConfig
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.backend import (
        MooncakeEmbeddingStoreBackend,
    )
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
        MooncakeEmbeddingStoreClient,
    )

    with mooncake_servers.master() as master:
        url = master.url_with(segment="256MiB", buffer="32MiB")
        with Daemon(cpu_bytes="64MiB", extra=("--remote", url)) as host1, \
                Daemon(cpu_bytes="64MiB", extra=("--remote", url)) as host2, \
                mooncake_servers.raw_client(master) as raw:
            for host in (host1, host2):
                host.wait_for(lambda h=host: h.stats()["remote_tier"]["reachable"] == 1,
                              timeout=WAIT, what="the daemon to reach the master")
            namespace = engine_namespace(tiny_model, host1.socket)
            client = MooncakeEmbeddingStoreClient(raw, ReplicateConfig(),
                                                  read_buffer_bytes=16 << 20)
            backend = MooncakeEmbeddingStoreBackend(client, namespace, max_pending_items=4,
                                                    max_pending_bytes=16 << 20)
            try:
                first = run_engine(tiny_model, [A, B], socket=host1.socket,
                                   extra_config=IDENTITY)
                assert first["encoder_images"] == 2, first["output"][-3000:]
                host1.wait_for(lambda: host1.stats()["remote_tier"]["publishes"] == 2,
                               timeout=WAIT, what="host 1 to publish A and B")
                entry_a, entry_b = ready_entries(host1)
                key_a = make_embedding_key(namespace, entry_a.mm_hash)
                key_b = make_embedding_key(namespace, entry_b.mm_hash)
                # Under vLLM's keys exactly, each with ec-daemon's checksum beside it.
                assert client.batch_exists([key_a, key_b]) == [True, True]
                assert raw.is_exist(key_a + SIDECAR) == 1

                # A: what the daemon published, vLLM's reader loads; then it
                # is replaced by what vLLM's worker publishes for it.
                spec_a = spec_of(entry_a)
                value_a = client.load_tensors({key_a: spec_a}, "cpu")[key_a]
                assert tuple(value_a.shape) == spec_a.shape
                assert str(value_a.dtype) == spec_a.dtype
                assert raw.remove(key_a, True) == 0
                assert raw.remove(key_a + SIDECAR, True) == 0
                assert client.batch_exists([key_a, key_a + SIDECAR]) == [False, False]
                cache: dict[str, torch.Tensor] = {}
                # One step of vLLM's worker: A is not in the store, it is
                # encoded (here: the same output), then published.
                assert backend.resolve_inputs({entry_a.mm_hash: spec_a}, cache, "cpu") == set()
                backend.save_output(entry_a.mm_hash, value_a.clone())
                host1.wait_for(lambda: (backend.reap(), not backend._pending)[1],
                               timeout=WAIT, what="vLLM's backend to publish A")
                assert client.exists(key_a) and raw.is_exist(key_a + SIDECAR) == 0
                assert bits(client.load_tensors({key_a: spec_a}, "cpu")[key_a]) == \
                    bits(value_a)

                # A fresh engine behind host 2: A promoted from vLLM's value.
                second = run_engine(tiny_model, [A], socket=host2.socket,
                                    extra_config=IDENTITY)
                assert second["encoder_images"] == 0, second["output"][-3000:]
                assert same_output(second["results"][A], reference[A])
                tier = host2.stats()["remote_tier"]
                assert tier["remote_hits"] == 1 and tier["bad_values"] == 0, tier
                assert tier["publishes"] == 0, tier  # a promoted value is not published back
                assert raw.is_exist(key_a + SIDECAR) == 0  # still no checksum: vLLM's value

                # B: vLLM's worker read path resolves what host 1's daemon
                # published (the engine's own output), bit for bit as its reader.
                spec_b = spec_of(entry_b)
                cache = {}
                assert backend.resolve_inputs({entry_b.mm_hash: spec_b}, cache, "cpu") == \
                    {entry_b.mm_hash}
                value_b = cache[entry_b.mm_hash]
                assert tuple(value_b.shape) == spec_b.shape and str(value_b.dtype) == spec_b.dtype
                assert value_b.shape[0] > 0 and torch.isfinite(value_b).all()
                assert bits(value_b) == bits(client.load_tensors({key_b: spec_b}, "cpu")[key_b])
                assert not torch.equal(value_b, value_a)  # another image, another output
            finally:
                backend._executor.shutdown(wait=True)  # (shutdown() would close `raw` too)
                if client._read_buffer is not None:
                    raw.unregister_buffer(client._read_buffer.data_ptr())
                if client._put_header is not None:
                    import ctypes

                    raw.unregister_buffer(ctypes.addressof(client._put_header))
