"""ec-daemon and vLLM's own Mooncake EC connector (`cross_encoder_cache`) share
one Mooncake store: the same keys (vLLM's `build_embedding_namespace` and
`make_embedding_key`) and the same values (its 24-byte header, then the
payload). Checked against vLLM's code itself (the namespace on every tested
release: tests/vllm/test_store_namespace.py): its store client
`MooncakeEmbeddingStoreClient` on a real mooncake_master, in both directions:
what a daemon publishes, vLLM's reader loads bit-exact; what vLLM's writer
puts, a daemon promotes and its engine loads bit-exact without encoding; the
backend vLLM's worker runs with cross_encoder_cache resolves what a daemon
published, and a daemon promotes what it published; a value vLLM's reader
refuses, the daemon refuses too.

No vLLM engine runs vLLM's connector here: cross_encoder_cache requires
Model Runner V2, which on CPU requires Triton's CPU backend (triton-cpu, not
on PyPI; vLLM falls back to the V1 runner and the connector refuses to start:
"cross_encoder_cache requires Model Runner V2")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding",
                    reason="this vLLM has no Mooncake embedding store (cross_encoder_cache)")

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    TensorSpec,
    build_embedding_namespace,
    make_embedding_key,
)

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout
from tests import groups, mooncake_servers, staged
from tests.integration.daemon import Daemon
from tests.integration.engines import ensure_within, wait_until
from tests.vllm import vllm_harness as h

pytestmark = pytest.mark.timeout(600)

WAIT = 30.0
NOWHERE = h.NOWHERE
IDENTITY = h.STORE_IDENTITY


# ---------------------------------------------------------------- values


@pytest.fixture(scope="module")
def master() -> Iterator[mooncake_servers.MooncakeMaster]:
    groups.check_mooncake()
    with mooncake_servers.master() as server:
        yield server


@pytest.fixture(scope="module")
def vllm_client(master: mooncake_servers.MooncakeMaster) -> Iterator[Any]:
    """vLLM's own store client, around a store set up here (as
    create_mooncake_embedding_store_client does, without its config file);
    it mounts a segment of the store's memory too."""
    from mooncake.store import ReplicateConfig
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
        MooncakeEmbeddingStoreClient,
    )

    with mooncake_servers.raw_client(master) as raw:
        client = MooncakeEmbeddingStoreClient(raw, ReplicateConfig(),
                                              read_buffer_bytes=16 << 20)
        yield client
        if client._read_buffer is not None:  # (close() would close `raw` too)
            raw.unregister_buffer(client._read_buffer.data_ptr())
        if client._put_header is not None:
            import ctypes

            raw.unregister_buffer(ctypes.addressof(client._put_header))


class Host:
    """A daemon with the Mooncake tier, and one engine's scheduler side and
    worker rank in this process, attached with `namespace` as their store
    namespace."""

    def __init__(self, master: mooncake_servers.MooncakeMaster, name: str, namespace: str,
                 dtype: str) -> None:
        self.name = name
        url = master.url_with(segment="64MiB", buffer="16MiB")
        self.daemon = Daemon(cpu_bytes="32MiB", extra=("--remote", url)).start()
        layout = Layout("tiny-paligemma", dtype, {"embeds": h.HIDDEN * 2},
                        variant=f"host={name}", store_namespace=namespace)
        self.scheduler = SchedulerDelegate(self.daemon.socket, engine_id=name, layout=layout,
                                           max_defer_seconds=WAIT)
        self.worker = WorkerDelegate(self.daemon.socket, engine_id=name, layout=layout)
        for d in (self.scheduler, self.worker):
            assert d.link.wait_attached(WAIT), d.link.last_error
        wait_until(lambda: self.scheduler.wanting and self.scheduler.link.fresh(),
                   "the view never learnt that a second tier is on", WAIT)
        # its worker rank mapped the region (until then every lookup misses
        # and no want is sent: a busy machine delays the rank count)
        wait_until(self.scheduler.serving, "the view never served", WAIT)
        self.tier_connected()

    def tier(self) -> dict[str, float]:
        return self.daemon.stats()["remote_tier"]

    def tier_connected(self) -> None:
        wait_until(lambda: self.tier().get("reachable") == 1,
                   f"{self.name}'s daemon never connected to the master", WAIT)

    def save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        assert self.worker.save(mm_hash, tensor) and self.worker.flush(WAIT)
        assert self.worker.stats["saves_done"] >= 1, dict(self.worker.stats)

    def load(self, mm_hash: str) -> torch.Tensor:
        assert staged.servable(self.scheduler, mm_hash)
        result = staged.load(self.scheduler, self.worker, [mm_hash])
        assert not result.failed, result.failed
        loaded = result.loaded[mm_hash]  # (numpy where numpy has the dtype)
        return loaded if isinstance(loaded, torch.Tensor) else torch.from_numpy(loaded)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
        self.daemon.stop()
        self.daemon.cleanup()


@pytest.fixture
def hosts() -> Iterator[Any]:
    with ExitStack() as stack:
        def make(*args: Any) -> Host:
            host = Host(*args)
            stack.callback(host.close)
            return host
        yield make


@pytest.fixture(scope="module")
def namespace(tiny_model) -> str:
    """The store namespace vLLM's connector would use for the tiny model."""
    return build_embedding_namespace(h.make_config(tiny_model, NOWHERE, **IDENTITY))


def tensor(seed: int, dtype: torch.dtype, rows: int = h.IMAGE_TOKENS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, h.HIDDEN, generator=generator).to(dtype)


def spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(t.shape), str(t.dtype), t.numel() * t.element_size())


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bfloat16", "float16", "float32"])
def test_what_a_daemon_publishes_vllms_reader_loads(master, vllm_client, hosts, namespace,
                                                    dtype):
    name = str(dtype).removeprefix("torch.")
    host = hosts(master, f"pub-{name}", namespace, name)
    mm_hash = f"daemon-saved-{name}"
    saved = tensor(1, dtype)
    host.save(mm_hash, saved)
    wait_until(lambda: host.tier()["publishes"] >= 1, "the daemon never published", WAIT)

    key = make_embedding_key(namespace, mm_hash)
    assert vllm_client.batch_exists([key, make_embedding_key(namespace, "other")]) == \
        [True, False]
    loaded = vllm_client.load_tensors({key: spec(saved)}, "cpu")
    assert list(loaded) == [key]
    assert loaded[key].dtype == dtype and torch.equal(loaded[key], saved)
    assert bits(loaded[key]) == bits(saved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=["bfloat16", "float16"])
def test_what_vllms_writer_puts_a_daemon_promotes_and_its_engine_loads(master, vllm_client,
                                                                       hosts, namespace,
                                                                       dtype):
    name = str(dtype).removeprefix("torch.")
    mm_hash = f"vllm-saved-{name}"
    written = tensor(2, dtype)
    vllm_client.put_tensor(make_embedding_key(namespace, mm_hash), written)

    host = hosts(master, f"con-{name}", namespace, name)
    # Deferred while it is promoted; or promoted within the step's answer
    # wait already (a quick promotion, a slow scheduler thread): a hit. Never
    # "encode here".
    if host.scheduler.ensure([mm_hash]) or staged.servable(host.scheduler, mm_hash):
        assert staged.servable(host.scheduler, mm_hash)
    ok, _ = ensure_within(host.scheduler, [mm_hash], WAIT)
    assert ok and staged.servable(host.scheduler, mm_hash)
    loaded = host.load(mm_hash)
    assert loaded.dtype == dtype
    assert tuple(loaded.shape) == tuple(written.shape) and bits(loaded) == bits(written)

    stats = host.daemon.stats()
    assert stats["remote_tier"]["remote_hits"] == 1
    assert stats["remote_tier"]["bad_values"] == 0
    assert stats["convergence"]["promotions"] == 1
    assert host.worker.stats["saves_done"] == 0  # nothing encoded nor saved here
    assert host.tier()["publishes"] == 0  # a promoted value is not published back


def test_a_value_vllms_reader_refuses_a_daemon_refuses_too(master, vllm_client, hosts,
                                                           namespace):
    """A value of another shape than its payload (header says 16 x 128, the
    payload is 8 x 128): vLLM's reader, asked for the header's shape, gets a
    short object and skips it; the daemon refuses it and the engine encodes."""
    mm_hash = "vllm-truncated"
    key = make_embedding_key(namespace, mm_hash)
    whole = tensor(3, torch.bfloat16)
    half = whole[: h.IMAGE_TOKENS // 2].contiguous()
    raw = vllm_client.store
    header = (0x4D4F4F4E).to_bytes(4, "little") + (12).to_bytes(4, "little") + \
        h.IMAGE_TOKENS.to_bytes(8, "little") + h.HIDDEN.to_bytes(8, "little")
    assert raw.put(key, header + bits(half)) == 0
    assert vllm_client.load_tensors({key: spec(whole)}, "cpu") == {}

    host = hosts(master, "refuse", namespace, "bfloat16")
    ok, _ = ensure_within(host.scheduler, [mm_hash], WAIT)
    assert ok and not staged.servable(host.scheduler, mm_hash)  # encoded here, not served
    tier = host.tier()
    assert tier["bad_values"] == 1 and tier["remote_hits"] == 0


def test_what_the_real_connector_saves_vllms_reader_loads(master, vllm_client, tiny_model):
    """ECDaemonConnector, built by vLLM's factory from a real VllmConfig with
    embedding_model_identity, saves an encoder output; it lands under the
    key vLLM's connector computes for the same config."""
    url = master.url_with(segment="64MiB", buffer="16MiB")
    with Daemon(cpu_bytes="32MiB", extra=("--remote", url)) as daemon:
        config = h.make_config(tiny_model, daemon.socket, instance_id="interop", **IDENTITY)
        scheduler = h.connector(config, ECConnectorRole.SCHEDULER)
        worker = h.connector(config, ECConnectorRole.WORKER)
        try:
            h.wait_attached(scheduler)
            h.wait_attached(worker)
            wait_until(lambda: scheduler.scheduler_delegate.serving(), "never served", WAIT)
            output = h.encoder_output(7)
            h.save_and_publish(scheduler, worker, "img-7", output)
            wait_until(lambda: daemon.stats()["remote_tier"]["publishes"] >= 1,
                       "the daemon never published", WAIT)
            # (read while the daemon runs: the value may sit in its segment)
            key = make_embedding_key(build_embedding_namespace(config), "img-7")
            loaded = vllm_client.load_tensors({key: spec(output)}, "cpu")
            assert list(loaded) == [key] and torch.equal(loaded[key], output)
        finally:
            scheduler.shutdown()
            worker.shutdown()


def test_vllms_worker_backend_and_a_daemon_share_outputs_both_ways(master, vllm_client, hosts,
                                                                   namespace):
    """The class vLLM's worker runs with cross_encoder_cache
    (MooncakeEmbeddingStoreBackend): before encoding it resolves the step's
    items from the store, and publishes the ones it encoded. It resolves what
    a daemon published; what it publishes, a daemon promotes."""
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.backend import (
        MooncakeEmbeddingStoreBackend,
    )

    backend = MooncakeEmbeddingStoreBackend(vllm_client, namespace, max_pending_items=4,
                                            max_pending_bytes=16 << 20)
    try:
        host = hosts(master, "backend", namespace, "bfloat16")
        from_daemon, from_vllm = tensor(4, torch.bfloat16), tensor(5, torch.bfloat16)
        host.save("from-daemon", from_daemon)
        wait_until(lambda: host.tier()["publishes"] >= 1, "the daemon never published", WAIT)

        # One step of vLLM's worker: one item in the store, one to encode.
        cache: dict[str, torch.Tensor] = {}
        loaded = backend.resolve_inputs({"from-daemon": spec(from_daemon),
                                         "from-vllm": spec(from_vllm)}, cache, "cpu")
        assert loaded == {"from-daemon"} and bits(cache["from-daemon"]) == bits(from_daemon)
        backend.save_output("from-vllm", from_vllm)  # encoded in this step
        wait_until(lambda: (backend.reap(), not backend._pending)[1],
                   "vLLM's backend never published", WAIT)

        ok, _ = ensure_within(host.scheduler, ["from-vllm"], WAIT)
        assert ok and staged.servable(host.scheduler, "from-vllm")
        assert bits(host.load("from-vllm")) == bits(from_vllm)
        assert host.tier()["remote_hits"] == 1
    finally:
        backend._executor.shutdown(wait=True)  # (shutdown() would close the shared client)
