"""CUDA copy backends against regions as production has them: larger than
2 GiB (registered in 1 GiB chunks, with entries whose extents cross chunk
boundaries), shared by two worker processes on one GPU, and a registration
the driver refuses (the backend falls back to unpinned copies). Skipped
without CUDA (`make gpu-test` fails instead)."""

from __future__ import annotations

import hashlib
import multiprocessing
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from benchmarks.gpu_device import TEST_REGION_BYTES  # noqa: E402
from ec_client.copy.mapping import RegionMapping  # noqa: E402
from ec_client.copy.pinning import REGISTER_CHUNK_BYTES as CHUNK  # noqa: E402
from ec_client.copy.pinning import PinRefused  # noqa: E402
from tests.gpu.support import (  # noqa: E402
    get_backend_or_skip,
    host_pointer,
    needs_cuda,
    pattern,
    pending_cuda_errors,
    row_major_bytes,
    shm_region,
    stored_bytes,
    wait_pinned,
)

pytestmark = [pytest.mark.gpu, needs_cuda]
BACKENDS = ["torch", "cupy"]
MiB = 1 << 20
PEER_WAIT_S = 180.0  # a spawned process imports torch and creates its context


def _entries() -> list[tuple[str, tuple[int, ...], list[tuple[int, int]]]]:
    """(name, shape of a bfloat16 tensor, extents) in a region of 2.25 GiB."""
    rows = 4096  # 4096 x 1152 bfloat16: 9 MiB
    nbytes = rows * 1152 * 2
    half = nbytes // 2
    return [
        ("across 1 GiB", (rows, 1152), [(CHUNK - half, nbytes)]),
        ("across 2 GiB, odd offset", (rows, 1152), [(2 * CHUNK - half + 2, nbytes)]),
        # scattered pages: one extent in each chunk, the last straddling 2 GiB
        ("one extent per chunk", (rows, 1152),
         [(12 * MiB, half // 2), (CHUNK + 40 * MiB, half // 2),
          (2 * CHUNK - 3 * MiB, nbytes - 2 * (half // 2))]),
        ("ends at the region's end", (rows, 1152),
         [(2 * CHUNK + CHUNK // 4 - nbytes, nbytes)]),
    ]


@pytest.mark.parametrize("name", BACKENDS)
def test_entries_across_registration_chunks_of_a_region_over_2_gib(name):
    """Every extent that crosses a 1 GiB registration chunk is copied whole
    and bit-exact, both ways; a save right after attach (while the
    background registration may still run: unpinned) is as exact."""
    backend = get_backend_or_skip(name)
    entries = _entries()
    sources = [pattern(i, shape, torch.bfloat16, backend.device)
               for i, (_, shape, _) in enumerate(entries)]
    with shm_region(TEST_REGION_BYTES) as mapping:  # 2.25 GiB: gpu-check checks /dev/shm for it
        backend.attach(mapping)
        try:
            first, *rest = zip(entries, sources, strict=True)
            (_, _, extents), source = first
            backend.save(source, mapping, extents, backend.prepare_save(source))
            assert wait_pinned(backend, mapping), f"{name}: a 2.25 GiB region was never pinned"
            for (_, _, extents), source in rest:
                backend.save(source, mapping, extents, backend.prepare_save(source))
            for (label, shape, extents), source in zip(entries, sources, strict=True):
                assert stored_bytes(mapping, extents) == row_major_bytes(source), label
                out = backend.empty(shape, "bfloat16")
                backend.load(mapping, extents, out)
                assert torch.equal(out, source), label
        finally:
            backend.detach(mapping)


def _digest(tensor: Any) -> str:
    return hashlib.sha256(row_major_bytes(tensor)).hexdigest()


def _peer(name: str, path: str, size: int, conn: Any) -> None:
    """The second worker process: maps and attaches the region itself, then
    saves or loads on request."""
    from ec_client.copy import get_backend

    mapping = RegionMapping(path, size, generation=1)
    backend = get_backend(name)
    backend.attach(mapping)
    conn.send(("attached", wait_pinned(backend, mapping)))
    while True:
        request, *args = conn.recv()
        if request == "save":
            seed, shape, extents = args
            source = pattern(seed, shape, torch.bfloat16, backend.device)
            backend.save(source, mapping, extents, backend.prepare_save(source))
            conn.send(("saved", _digest(source)))
        elif request == "load":
            shape, extents = args
            out = backend.empty(shape, "bfloat16")
            backend.load(mapping, extents, out)
            conn.send(("loaded", _digest(out)))
        else:
            backend.detach(mapping)
            mapping.close()
            conn.send(("closed",))
            return


def _ask(conn: Any, *request: Any) -> Any:
    conn.send(request)
    assert conn.poll(PEER_WAIT_S), f"the peer process did not answer {request[0]!r}"
    return conn.recv()


@pytest.mark.parametrize("name", BACKENDS)
def test_two_worker_processes_on_one_gpu_share_the_region(name):
    """One process saves, the other loads, both ways, both registered at
    once (each process pins the same pages for itself)."""
    backend = get_backend_or_skip(name)
    size = CHUNK + CHUNK // 4
    shape = (2048, 1152)
    nbytes = 2048 * 1152 * 2
    peer_extents = [(CHUNK - nbytes // 3, nbytes)]  # across the chunk boundary
    own_extents = [(64 * MiB, nbytes // 2), (CHUNK + 8 * MiB, nbytes - nbytes // 2)]
    context = multiprocessing.get_context("spawn")
    with shm_region(size) as mapping:
        parent, child = context.Pipe()
        peer = context.Process(target=_peer, args=(name, mapping.path, size, child))
        peer.start()
        backend.attach(mapping)
        try:
            assert parent.poll(PEER_WAIT_S), "the peer process did not start"
            assert parent.recv() == ("attached", True)
            assert wait_pinned(backend, mapping)
            # The peer saves, this process loads.
            _, saved = _ask(parent, "save", 11, shape, peer_extents)
            out = backend.empty(shape, "bfloat16")
            backend.load(mapping, peer_extents, out)
            expected = pattern(11, shape, torch.bfloat16, backend.device)
            assert torch.equal(out, expected) and _digest(out) == saved
            # This process saves, the peer loads.
            source = pattern(12, shape, torch.bfloat16, backend.device)
            backend.save(source, mapping, own_extents, backend.prepare_save(source))
            assert _ask(parent, "load", shape, own_extents) == ("loaded", _digest(source))
            assert _ask(parent, "close") == ("closed",)
            peer.join(60)
            assert peer.exitcode == 0
        finally:
            backend.detach(mapping)
            if peer.is_alive():
                peer.kill()
                peer.join(30)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_refused_registration_falls_back_to_unpinned_copies(name):
    """The driver refuses the backend's cudaHostRegister (here: this test
    registered the pages first, cudaErrorHostMemoryAlreadyRegistered): the
    backend counts it, copies unpinned and bit-exact, and leaves no CUDA
    error pending for an unrelated torch call to trip over. CUDA's last
    error is kept per host thread, so the refusal is also made on this
    thread (the runtime's own register) before it is looked for; and the
    test's registration is then dropped, so the copies run on pageable
    memory, as they would where the driver refused the first time."""
    backend = get_backend_or_skip(name)
    cudart = torch.cuda.cudart()
    with shm_region(64 * MiB) as mapping:
        base = host_pointer(mapping)
        assert int(cudart.cudaHostRegister(base, mapping.size, 0)) == 0
        registered = True
        try:
            backend.attach(mapping)
            try:
                deadline = time.monotonic() + 60
                while backend.stats["pin_refused"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert backend.stats["pin_refused"] >= 1
                assert not backend.pinned(mapping)
                host = backend.runtime.host_bytes(mapping)
                with pytest.raises(PinRefused):
                    backend.runtime.register(host, 0, 2 * MiB)
                del host
                assert pending_cuda_errors() == []
                assert int(cudart.cudaHostUnregister(base)) == 0
                registered = False
                source = pattern(5, (1024, 1152), torch.bfloat16, backend.device).T
                expected = source.contiguous()
                extents = [(4096, expected.numel() * 2)]
                backend.save(source, mapping, extents, backend.prepare_save(source))
                assert stored_bytes(mapping, extents) == row_major_bytes(expected)
                out = backend.empty(tuple(expected.shape), "bfloat16")
                backend.load(mapping, extents, out)
                assert torch.equal(out, expected)
                # torch still works on this thread and reports nothing stale.
                assert float((torch.ones(1000, device=backend.device) * 2).sum()) == 2000.0
                torch.cuda.synchronize()
                assert pending_cuda_errors() == []
            finally:
                backend.detach(mapping)
        finally:
            if registered:
                assert int(cudart.cudaHostUnregister(base)) == 0
