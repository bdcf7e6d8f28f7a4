"""Engine-like client processes for integration tests (run under spawn).

Each function is the main of a separate process: it uses only the public
client delegates, reports through a multiprocessing connection, and ends by
itself (or is killed by the test, by pid).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ec_client.scheduler import SchedulerDelegate
from ec_client.worker import WorkerDelegate
from ec_protocol.protocol import Layout, pb

LAYOUT = Layout("test-model", "mixed", {"image": 2048})
ATTACH_TIMEOUT = 20.0

# (dtype, rows, columns): from a few bytes to ~8 MiB, page multiples and not.
SHAPES = [
    ("float16", 1, 3), ("float32", 16, 1024), ("bfloat16", 257, 1152), ("int8", 1000, 77),
    ("uint8", 4099, 2048), ("float64", 3, 5), ("float16", 2048, 2048), ("float32", 1, 16384),
]


def key(seed: int, i: int) -> str:
    return f"mm-{seed}-{i}"


def make_array(seed: int, i: int) -> Any:
    dtype, rows, cols = SHAPES[i % len(SHAPES)]
    rng = np.random.default_rng(seed * 1000 + i)
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32)).to(
            torch.bfloat16)
    if dtype.startswith("float"):
        return rng.standard_normal((rows, cols)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, (rows, cols), dtype=dtype, endpoint=True)


def raw(array: Any) -> bytes:
    if hasattr(array, "untyped_storage"):
        import torch

        return bytes(array.contiguous().view(torch.uint8).numpy().tobytes())
    return bytes(np.ascontiguousarray(array).tobytes())


def _attached(*delegates: Any) -> None:
    for d in delegates:
        if d.link.wait_attached(ATTACH_TIMEOUT) is None:
            raise RuntimeError(f"not attached: {d.link.last_error}")


def _wait_synced(scheduler: SchedulerDelegate) -> None:
    deadline = time.monotonic() + ATTACH_TIMEOUT
    while not scheduler.view.synced:
        if time.monotonic() > deadline:
            raise RuntimeError("view never synced")
        time.sleep(0.01)


def producer_main(socket: str, engine_id: str, seed: int, count: int, conn: Any) -> None:
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, role="producer")
    _attached(worker)
    for i in range(count):
        assert worker.save(key(seed, i), make_array(seed, i))
    worker.flush(60)
    conn.send(dict(worker.stats))
    worker.close()


def consumer_main(socket: str, engine_id: str, seed: int, count: int, conn: Any) -> None:
    scheduler = SchedulerDelegate(socket, engine_id=engine_id, layout=LAYOUT, role="consumer")
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, role="consumer")
    _attached(scheduler, worker)
    _wait_synced(scheduler)
    out: dict[str, Any] = {"hits": 0, "exact": 0, "failed": 0, "dtypes": [], "shapes": []}
    for i in range(count):
        h = key(seed, i)
        out["hits"] += scheduler.has_item(h)
        scheduler.after_alloc(f"req-{i}", h)
        meta = scheduler.build_step_metadata()
        result = worker.load(meta.loads)
        scheduler.apply_worker_output(result.done, result.failed)
        out["failed"] += len(result.failed)
        if h in result.loaded:
            got, want = result.loaded[h], make_array(seed, i)
            out["dtypes"].append(str(got.dtype).removeprefix("torch."))
            out["shapes"].append(tuple(got.shape))
            out["exact"] += raw(got) == raw(want) and tuple(got.shape) == tuple(want.shape)
    out["rpcs_on_scheduler_thread"] = scheduler.transport.calls_from_this_thread()
    conn.send(out)
    scheduler.close()
    worker.close()


def worker_rank_main(socket: str, engine_id: str, rank: int, world: int, conn: Any) -> None:
    """A TP rank: loads what the test sends, answers with verdicts and bytes."""
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, rank=rank,
                            world_size=world, role="both")
    _attached(worker)
    conn.send("attached")
    while True:
        command, payload = conn.recv()
        if command == "exit":
            break
        if command == "save":
            seed, i = payload
            worker.save(key(seed, i), make_array(seed, i))
            worker.flush(30)
            conn.send(dict(worker.stats))
        elif command == "load":
            result = worker.load(payload)
            conn.send((result.done, result.failed,
                       {h: raw(a) for h, a in result.loaded.items()}))
    worker.close()


def _allocated(socket: str, engine_id: str, mm_hash: str,
               nbytes: int) -> tuple[WorkerDelegate, Any]:
    """A producer worker that has allocated a save of `nbytes` (not copied)."""
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, role="producer")
    _attached(worker)
    attachment = worker.link.attachment
    assert attachment is not None
    reply = worker.transport.call("Allocate", pb.AllocateRequest(
        session_id=attachment.session_id, mm_hash=mm_hash, nbytes=nbytes, shape=[nbytes],
        dtype="uint8"))
    return worker, reply


def stuck_saver_main(socket: str, engine_id: str, mm_hash: str, conn: Any) -> None:
    """Allocates a save, then hangs before copying (killed by the test)."""
    _, reply = _allocated(socket, engine_id, mm_hash, 1 << 20)
    conn.send(pb.AllocStatus.Name(reply.status))
    time.sleep(600)


def pinning_engine_main(socket: str, engine_id: str, mm_hash: str, conn: Any) -> None:
    """An engine (scheduler side and a worker) that dispatches a load, then hangs."""
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, role="consumer")
    _attached(worker)
    pinning_scheduler_main(socket, engine_id, mm_hash, conn)


def pinning_scheduler_main(socket: str, engine_id: str, mm_hash: str, conn: Any) -> None:
    """The scheduler side alone: dispatches a load, then hangs."""
    scheduler = SchedulerDelegate(socket, engine_id=engine_id, layout=LAYOUT, role="consumer")
    _attached(scheduler)
    _wait_synced(scheduler)
    hit = scheduler.has_item(mm_hash)
    scheduler.after_alloc("req", mm_hash)
    conn.send((hit, scheduler.build_step_metadata().loads))
    time.sleep(600)


def copying_saver_main(socket: str, engine_id: str, mm_hash: str, conn: Any) -> None:
    """Allocates a save and keeps copying into its extents until killed."""
    worker, reply = _allocated(socket, engine_id, mm_hash, 4 << 20)
    extents = [(e.offset, e.length) for e in reply.extents]
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    mapping = worker._mapping
    assert mapping is not None
    conn.send(pb.AllocStatus.Name(reply.status))
    while True:  # mid-save forever
        worker.backend.save(data, mapping, extents)


def copying_loader_main(socket: str, engine_id: str, conn: Any) -> None:
    """A worker rank that copies a dispatched load over and over until killed."""
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, role="consumer")
    _attached(worker)
    conn.send("attached")
    (spec,) = conn.recv()
    mapping = worker._mapping
    assert mapping is not None
    out = np.empty(spec.nbytes, np.uint8)
    conn.send("copying")
    while True:  # mid-load forever
        worker.backend.load(mapping, spec.extents, out)
