"""Engine-like client processes for integration tests (run under spawn).

As in vLLM, an engine's scheduler side and each of its worker ranks live in
separate processes. The test plays vLLM's part between them: it carries the
scheduler's step metadata (`LoadSpec`s and the regions they name) to the
ranks, and the ranks' `done`/`failed` reports back to the scheduler's
`apply_worker_output`. Each `*_main` serves commands from its pipe, uses
only the public client delegates, and ends by itself (or is killed by the
test, by pid: see `Proc`).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from typing import Any

import numpy as np

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout, pb
from tests import staged

LAYOUT = Layout("test-model", "mixed", {"image": 2048})
ATTACH_TIMEOUT = 20.0
RECV_TIMEOUT = 60.0

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


def describe(array: Any) -> tuple[bytes, str, tuple[int, ...]]:
    """What a test compares of a loaded array: bytes, dtype name, shape."""
    return raw(array), str(array.dtype).removeprefix("torch."), tuple(array.shape)


class Proc:
    """A spawned process with a pipe; killed by pid if it outlives the test."""

    def __init__(self, target: Any, *args: Any) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(*args, child), daemon=True)
        self.process.start()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def recv(self, timeout: float = RECV_TIMEOUT) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.process.name} sent nothing in {timeout}s "
                                 f"(alive: {self.process.is_alive()})")
        return self.conn.recv()

    def send(self, command: str, payload: Any = None) -> None:
        self.conn.send((command, payload))

    def call(self, command: str, payload: Any = None, timeout: float = RECV_TIMEOUT) -> Any:
        self.send(command, payload)
        return self.recv(timeout)

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def join(self) -> int:
        self.process.join(RECV_TIMEOUT)
        assert self.process.exitcode is not None, "process did not end"
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)


def _attached(*delegates: Any) -> None:
    for d in delegates:
        if d.link.wait_attached(ATTACH_TIMEOUT) is None:
            raise RuntimeError(f"not attached: {d.link.last_error}")


def _wait_synced(scheduler: SchedulerDelegate) -> None:
    deadline = time.monotonic() + ATTACH_TIMEOUT
    while not (scheduler.view.synced and scheduler.link.fresh()):
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


# ------------------------------------------------------------- scheduler side


def _step(scheduler: SchedulerDelegate, hashes: list[str], plan: bool) -> tuple[list[bool], Any]:
    """One scheduler step: requests need `hashes`, and the loads of those the
    cache holds are sent when `plan` (`tests.staged.plan`); without `plan`,
    whether each would be (nothing is staged). Returns the answers and the
    step's metadata."""
    if plan:
        return staged.plan(scheduler, hashes)
    return [staged.servable(scheduler, h) for h in hashes], scheduler.build_step_metadata()


def _state(scheduler: SchedulerDelegate) -> dict[str, Any]:
    attachment = scheduler.link.attachment
    return {"index": attachment.index if attachment else None,
            "generation": attachment.region.generation if attachment else None,
            "fresh": scheduler.link.fresh(), "synced": scheduler.view.synced,
            "entries": len(scheduler.view), "inflight": scheduler.view.inflight(),
            "rpcs_on_scheduler_thread": scheduler.transport.calls_from_this_thread()}


def scheduler_main(socket: str, engine_id: str, ranks: int, conn: Any) -> None:
    """An engine's scheduler side. Commands: step (hashes, plan) -> (hits,
    StepMetadata); report (done, failed) -> loads in flight; wait_hit hash ->
    True once its load would be staged (nothing staged);
    wait_ranks -> True once hits are answered (every rank mapped the region);
    wait_serving -> True once hits are answered and wants sent;
    ensure (hashes, seconds) -> `ensure_within`;
    watch (hashes, seconds) -> see `_watch`; state -> dict; close."""
    scheduler = SchedulerDelegate(socket, engine_id=engine_id, layout=LAYOUT, ranks=ranks)
    _attached(scheduler)
    _wait_synced(scheduler)
    conn.send("ready")
    while True:
        command, payload = conn.recv()
        if command == "step":
            conn.send(_step(scheduler, *payload))
        elif command == "stage":  # hashes -> as "step", the requests going on
            conn.send(staged.plan(scheduler, payload, finish=False))
        elif command == "use":  # hashes -> (hits, StepMetadata): the step that uses them
            conn.send(staged.use(scheduler, payload))
        elif command == "report":  # (done, failed: [(transfer id, what failed)])
            scheduler.apply_worker_output(*payload)
            conn.send(scheduler.view.inflight())
        elif command == "wait_ranks":  # hits answered (every rank mapped the region)
            wait_until(scheduler.serving, "the scheduler never served hits")
            conn.send(True)
        elif command == "wait_serving":  # hits answered, wants sent
            wait_until(lambda: scheduler.serving() and scheduler.wanting,
                       "the scheduler never served with wants")
            conn.send(True)
        elif command == "wait_hit":
            deadline = time.monotonic() + ATTACH_TIMEOUT
            while not _step(scheduler, [payload], False)[0][0] and time.monotonic() < deadline:
                time.sleep(0.01)
            conn.send(_step(scheduler, [payload], False)[0][0])
        elif command == "watch":
            conn.send(_watch(scheduler, conn, *payload))
        elif command == "state":
            conn.send(_state(scheduler))
        elif command == "ensure":
            conn.send(ensure_within(scheduler, *payload))
        elif command == "close":
            scheduler.close()
            conn.send("closed")
            return


def unmappable_scheduler_main(socket: str, engine_id: str, conn: Any) -> None:
    """A scheduler side that cannot map the daemon's region (an engine left
    with a restarted container's old /dev/shm): its attach check fails every
    time, and its link tries again every couple of seconds. Runs until told
    to stop (or killed); then sends its link's last error."""
    import ec_client.scheduler_side.attachment as attachment_module

    def missing(path: str, owner: Any) -> int:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    # (where the attach check opens the region: the scheduler's attachment)
    attachment_module.open_region = missing  # type: ignore[assignment]
    scheduler = SchedulerDelegate(socket, engine_id=engine_id, layout=LAYOUT)
    conn.send("ready")
    conn.recv()
    conn.send(scheduler.link.last_error)
    scheduler.close()


def wait_until(predicate: Any, what: str, seconds: float = ATTACH_TIMEOUT) -> None:
    """Poll `predicate` until it holds; fail with `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def ensure_within(scheduler: SchedulerDelegate, hashes: list[str],
                  seconds: float) -> tuple[bool, float]:
    """Ask `ensure` as vLLM does every step, until it says yes, or until
    every item it does not say yes to is in the cache (`ensure` stages its
    load then: a hit once staged), or `seconds` pass: (whether either
    happened, seconds it took)."""
    started = time.monotonic()
    while True:
        if scheduler.ensure(hashes) or all(staged.servable(scheduler, h) or scheduler.ensure([h])
                                           for h in hashes):
            return True, time.monotonic() - started
        if time.monotonic() - started > seconds:
            return False, time.monotonic() - started
        time.sleep(0.002)


def _watch(scheduler: SchedulerDelegate, conn: Any, hashes: list[str],
           seconds: float) -> dict[str, Any]:
    """Step in a loop, as an engine does, looking `hashes` up (planning a
    load of every hit) while the test freezes the process (SIGSTOP). The
    test sends a "thawed" message before it lets the process go on, so the
    first step after the freeze sees it. Ends once the last hash hit after
    the freeze, or after `seconds`. Counts, before and after the freeze:
    steps, hits and loads per hash; after it, also the steps whose view
    still held the first hash's pre-freeze entry (a stale view)."""
    first, last_hash = hashes[0], hashes[-1]
    before = scheduler.view.get(first)
    out: dict[str, Any] = {"index_before": _state(scheduler)["index"], "frozen": False,
                           "stale_steps": 0, "stale_hits": 0}
    counts = {phase: {"steps": 0, "hits": dict.fromkeys(hashes, 0), "loads": []}
              for phase in ("before", "after")}
    woke = time.monotonic()
    deadline = woke + seconds
    while time.monotonic() < deadline and not counts["after"]["hits"][last_hash]:
        now = time.monotonic()
        if not out["frozen"] and conn.poll():
            assert conn.recv() == "thawed"
            out["frozen"], woke = True, now
        phase = counts["after" if out["frozen"] else "before"]
        stale = out["frozen"] and before is not None and scheduler.view.get(first) is before
        hits, metadata = _step(scheduler, hashes, True)
        phase["steps"] += 1
        for h, hit in zip(hashes, hits, strict=True):
            phase["hits"][h] += hit
        phase["loads"] += metadata.loads
        out["stale_steps"] += stale
        out["stale_hits"] += stale and hits[0]
        if metadata.loads:  # nobody loads here: finish them as if every rank reported
            scheduler.apply_worker_output([s.transfer_id for s in metadata.loads] * scheduler.ranks)
        if not out["frozen"] or now - woke > 0.2:
            time.sleep(0.001)  # just woken up: step flat out, as a busy engine would
    out.update(counts, state_after=_state(scheduler))
    return out


# -------------------------------------------------------------- worker ranks


def worker_main(socket: str, engine_id: str, rank: int, world: int, start: bool,
                conn: Any) -> None:
    """A worker rank (attached at once when `start`). Commands: attach ->
    session index; save (mm_hash, array) -> saves stats; load (loads,
    regions) -> (done, failed, {mm_hash: describe(array)}); copy_forever
    (spec, regions): sends "copying", then copies until killed; generations
    -> region generations mapped; exit."""
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, rank=rank,
                            world_size=world, start=start)
    if start:
        _attached(worker)
    conn.send("ready")
    while True:
        command, payload = conn.recv()
        if command == "attach":
            worker.link.start()
            _attached(worker)
            attachment = worker.link.attachment
            conn.send(attachment.index if attachment else None)
        elif command == "save":
            mm_hash, array = payload
            worker.save(mm_hash, array)
            worker.flush(30)
            conn.send(dict(worker.stats))
        elif command == "load":  # -> (done, [(transfer id, what failed)], loaded)
            result = worker.load(*payload)
            conn.send((result.done, [(t, result.kinds[t]) for t in result.failed],
                       {h: describe(a) for h, a in result.loaded.items()}))
        elif command == "copy_forever":
            spec, regions = payload
            out = np.empty(spec.nbytes, np.uint8)
            with worker.regions.use(regions[spec.generation]) as (mapping, _):
                conn.send("copying")
                while True:  # mid-load forever
                    worker.backend.load(mapping, spec.extents, out)
        elif command == "generations":
            conn.send(worker.regions.generations())
        elif command == "exit":
            worker.close()
            conn.send("closed")
            return


# --------------------------------------------------------- dying savers


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


def copying_saver_main(socket: str, engine_id: str, mm_hash: str, conn: Any) -> None:
    """Allocates a save and keeps copying into its extents until killed."""
    worker, reply = _allocated(socket, engine_id, mm_hash, 4 << 20)
    extents = [(e.offset, e.length) for e in reply.extents]
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    attachment = worker.link.attachment
    assert attachment is not None
    with worker.regions.use(attachment.region) as (mapping, _):
        conn.send(pb.AllocStatus.Name(reply.status))
        while True:  # mid-save forever
            worker.backend.save(data, mapping, extents, None)


# ---------------------------------------------------- a churning engine


def churn_main(socket: str, engine_id: str, seed: int, keys: int, seconds: float,
               conn: Any) -> None:
    """An engine in one process that saves and loads `keys` keys shared with
    other churners (each key's bytes are fixed: `make_array(0, i)`) for
    `seconds`, whatever happens to the daemon meanwhile: a hit is loaded and
    compared with the key's bytes; a miss is saved. Sends {loads, wrong,
    failed, saves, hits, steps} at the end."""
    rng = np.random.default_rng(seed)
    scheduler = SchedulerDelegate(socket, engine_id=engine_id, layout=LAYOUT)
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, save_queue_bytes=64 << 20)
    _attached(scheduler, worker)
    expected = {key(0, i): raw(make_array(0, i)) for i in range(keys)}
    counts = dict.fromkeys(("steps", "hits", "loads", "wrong", "failed", "saves"), 0)
    conn.send("ready")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        i = int(rng.integers(keys))
        mm_hash = key(0, i)
        counts["steps"] += 1
        if staged.servable(scheduler, mm_hash):
            counts["hits"] += 1
            result = staged.load(scheduler, worker, [mm_hash])
            counts["failed"] += len(result.failed)
            for loaded in result.loaded.values():
                counts["loads"] += 1
                counts["wrong"] += raw(loaded) != expected[mm_hash]
        else:
            scheduler.build_step_metadata()
            counts["saves"] += worker.save(mm_hash, make_array(0, i))
            time.sleep(0.002)
    worker.flush(10)
    conn.send(counts)
    scheduler.close()
    worker.close()


# ------------------------------------------------ savers on the stream


def stream_saver_main(socket: str, engine_id: str, mm_hash: str, nbytes: int, pause: str,
                      conn: Any) -> None:
    """A producer worker saving `mm_hash` (`nbytes` of 0xAB) on its session
    stream, held up where `pause` says: "copy" (sends "copying" from inside
    the copy, then hangs there until killed), or "check" (sends the region
    path and the extents the daemon answered, just before the saver checks
    its session and stamps, then waits for a "go" and sends its stats once
    the save is done)."""
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=LAYOUT, role="producer")
    _attached(worker)
    attachment = worker.link.attachment
    assert attachment is not None and attachment.stream_saves
    if pause == "copy":
        def hang(*args: Any) -> None:
            conn.send("copying")
            time.sleep(600)

        worker.backend.save = hang  # type: ignore[method-assign]
    else:
        use = worker.regions.use
        first = threading.Event()

        def held(info: Any) -> Any:  # the saver maps the region, then checks and copies
            # Only the first use: a link that re-attaches after the test froze
            # this process maps the new attachment's region from its own
            # thread, which must neither announce itself nor take the "go".
            if not first.is_set():
                first.set()
                conn.send(("answered", info.path))
                assert conn.recv()[0] == "go"
            return use(info)

        worker.regions.use = held  # type: ignore[method-assign]
    assert worker.save(mm_hash, np.full(nbytes, 0xAB, np.uint8))
    worker.flush(60)
    conn.send(dict(worker.stats))
    worker.close()
