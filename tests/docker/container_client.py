"""An engine-like client of ec-daemon, run inside the client image
(deploy/Dockerfile.client, as /opt/ec-test/client.py) by tests/docker.

It plays one vLLM engine with the public delegates and the cpu backend: a
`WorkerDelegate` that saves numpy arrays, and a `SchedulerDelegate` plus a
worker that look entries up, plan their loads and copy them out (the test
process plays vLLM's part between the two, as tests/integration/engines.py
does). Every answer is one line `RESULT {json}` on stdout; logs go to stderr.

    client.py produce PREFIX SEED COUNT   save COUNT arrays; their digests
    client.py consume PREFIX COUNT        load PREFIX's entries; their digests
    client.py attach                      try to attach once; the outcome
    client.py serve                       a long-running engine: one JSON
                                          command per stdin line (see `serve`)

A digest is [sha256 of the bytes, dtype, shape]: what "bit-exact" compares.
Every wait is bounded (`timeout`, seconds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout, Role, default_socket_uri

LAYOUT = Layout("docker-test-model", "mixed", {"image": 2048})
SOCKET = os.environ.get("EC_DAEMON_SOCKET") or default_socket_uri()
ATTACH_TIMEOUT = 30.0
# (dtype, rows, columns): a few bytes to ~1 MiB, page multiples and not.
SHAPES = [("float16", 1, 3), ("float32", 16, 1024), ("int8", 1000, 77), ("uint8", 300, 2048),
          ("float64", 3, 5), ("float32", 1, 16384), ("int32", 257, 129), ("int64", 64, 2048)]

Digest = list[Any]  # [sha256 hex, dtype, shape]


def key(prefix: str, i: int) -> str:
    return f"{prefix}-{i}"


def make_array(seed: int, i: int) -> Any:
    dtype, rows, cols = SHAPES[i % len(SHAPES)]
    rng = np.random.default_rng(seed * 1000 + i)
    if dtype.startswith("float"):
        return rng.standard_normal((rows, cols)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, (rows, cols), dtype=dtype, endpoint=True)


def digest(array: Any) -> Digest:
    data = np.ascontiguousarray(array).tobytes()
    return [hashlib.sha256(data).hexdigest(), str(array.dtype), list(array.shape)]


def answer(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)


def attached(*delegates: Any, timeout: float = ATTACH_TIMEOUT) -> None:
    for d in delegates:
        if d.link.wait_attached(timeout) is None:
            raise RuntimeError(f"not attached in {timeout}s: {d.link.last_error}")


def wait_synced(scheduler: SchedulerDelegate, timeout: float = ATTACH_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not scheduler.serving():  # synced, fresh, and its worker rank mapped the region
        if time.monotonic() > deadline:
            raise RuntimeError(f"the view never synced: {scheduler.link.last_error}")
        time.sleep(0.01)


def generation(delegate: Any) -> int | None:
    attachment = delegate.link.attachment
    return attachment.region.generation if attachment else None


def session(delegate: Any) -> str | None:
    """The current attachment's session id: a new one after every re-attach,
    also to the same region (a daemon that adopted it keeps its generation)."""
    attachment = delegate.link.attachment
    return attachment.session_id if attachment else None


# ------------------------------------------------------------------ saves


def save(worker: WorkerDelegate, prefix: str, seed: int, count: int,
         timeout: float = 60) -> dict[str, Any]:
    before = dict(worker.stats)
    digests: dict[str, Digest] = {}
    queued = 0
    for i in range(count):
        array = make_array(seed, i)
        digests[key(prefix, i)] = digest(array)
        queued += worker.save(key(prefix, i), array)
    flushed = worker.flush(timeout)
    stats = {k: v - before.get(k, 0) for k, v in worker.stats.items() if v != before.get(k, 0)}
    return {"digests": digests, "queued": queued, "flushed": flushed, "stats": stats}


def produce(prefix: str, seed: int, count: int) -> dict[str, Any]:
    worker = WorkerDelegate(SOCKET, engine_id=f"producer-{prefix}", layout=LAYOUT,
                            role="producer")
    try:
        attached(worker)
        out = save(worker, prefix, seed, count)
        out["generation"] = generation(worker)
        return out
    finally:
        worker.close()


# ------------------------------------------------------------------ loads


def lookup(scheduler: SchedulerDelegate, keys: list[str]) -> dict[str, Any]:
    """Which `keys` would be loaded (the view holds them, and serves), and
    the entry id the view holds for each key (None when it holds none)."""
    entries = [scheduler.view.get(k) for k in keys]
    hits = [e is not None and scheduler.serving() for e in entries]
    return {"hits": hits, "entry_ids": [e.entry_id if e is not None else None for e in entries]}


def load(scheduler: SchedulerDelegate, worker: WorkerDelegate, keys: list[str],
         timeout: float) -> dict[str, Any]:
    """Step as an engine does until every key was loaded (or `timeout`):
    stage the loads of the missing ones the cache holds (copied out and
    verified on the worker, reported back), then look them up and adopt
    them. Returns the loaded digests and the failures."""
    loaded: dict[str, Digest] = {}
    failed: list[str] = []
    steps = 0
    deadline = time.monotonic() + timeout
    while len(loaded) < len(keys) and time.monotonic() < deadline:
        steps += 1
        missing = [k for k in keys if k not in loaded]
        requests = {k: f"req-{k}-{steps}" for k in missing}
        # Two steps, as vLLM's: the first stages the loads of the keys the
        # cache holds (the worker copies and verifies them, and reports)...
        for k in missing:
            scheduler.stage(k, requests[k])
        metadata = scheduler.build_step_metadata()
        if not metadata.loads:
            for k in missing:
                scheduler.request_finished(requests[k], [k])
            time.sleep(0.02)
            continue
        worker.regions.step(metadata.keep)
        try:
            result = worker.stage(metadata.loads, metadata.regions, metadata.step)
        finally:
            worker.regions.step_done()
        scheduler.apply_worker_output(result.done, [(t, result.kinds[t]) for t in result.failed])
        failed += [f"{spec.mm_hash}: {result.failed[spec.transfer_id]}"
                   for spec in metadata.loads if spec.transfer_id in result.failed]
        # ... and the next looks them up (hits, counted by the daemon) and
        # adopts what was staged.
        for k in missing:
            if scheduler.has_item(k):
                scheduler.after_alloc(requests[k], k)
        used = scheduler.build_step_metadata()
        for k in missing:
            scheduler.request_finished(requests[k], [k])
        worker.drop(used.drop)
        for adopt in used.adopt:
            array = worker.adopt(adopt.transfer_id)
            if array is not None:
                loaded[adopt.mm_hash] = digest(array)
    return {"loaded": loaded, "failed": failed, "missing": [k for k in keys if k not in loaded],
            "steps": steps, "generation": generation(scheduler)}


class Engine:
    """A scheduler side and one worker rank of one engine."""

    def __init__(self, engine_id: str, role: Role) -> None:
        self.scheduler = SchedulerDelegate(SOCKET, engine_id=engine_id, layout=LAYOUT,
                                           role=role)
        self.worker = WorkerDelegate(SOCKET, engine_id=engine_id, layout=LAYOUT, role=role)

    def ready(self, timeout: float = ATTACH_TIMEOUT) -> None:
        attached(self.scheduler, self.worker, timeout=timeout)
        wait_synced(self.scheduler, timeout)

    def state(self) -> dict[str, Any]:
        return {"scheduler_generation": generation(self.scheduler),
                "worker_generation": generation(self.worker),
                "scheduler_session": session(self.scheduler),
                "worker_session": session(self.worker),
                "fresh": self.scheduler.link.fresh(), "synced": self.scheduler.view.synced,
                "entries": len(self.scheduler.view),
                "scheduler_error": self.scheduler.link.last_error,
                "worker_error": self.worker.link.last_error,
                "worker_stats": dict(self.worker.stats)}

    def wait_reattached(self, old: int | None, timeout: float,
                        sessions: list[str] | None = None) -> dict[str, Any]:
        """Until both sides are attached to one generation, other than `old`
        when given, in sessions other than `sessions` (the ones to leave:
        a daemon that adopted the region keeps its generation), and the
        view is synced (or `timeout`)."""
        left = set(sessions or ())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            gens = {generation(self.scheduler), generation(self.worker)}
            ids = {session(self.scheduler), session(self.worker)}
            if len(gens) == 1 and None not in gens and old not in gens \
                    and None not in ids and not ids & left \
                    and self.scheduler.serving():
                break
            time.sleep(0.05)
        return self.state()

    def close(self) -> None:
        self.worker.close()
        self.scheduler.close()


def consume(prefix: str, count: int, timeout: float = 60) -> dict[str, Any]:
    engine = Engine(f"consumer-{prefix}", "consumer")
    try:
        engine.ready()
        return load(engine.scheduler, engine.worker, [key(prefix, i) for i in range(count)],
                    timeout)
    finally:
        engine.close()


def attach_once(timeout: float = 10) -> dict[str, Any]:
    """Whether a worker attaches and maps the region; the error if not."""
    worker = WorkerDelegate(SOCKET, engine_id="attach-probe", layout=LAYOUT, role="producer")
    try:
        ok = worker.link.wait_attached(timeout) is not None
        return {"attached": ok, "error": worker.link.last_error, "uid": os.getuid(),
                "groups": sorted(os.getgroups())}
    finally:
        worker.close()


def serve(engine_id: str) -> None:
    """A long-running engine (role both), one JSON command per stdin line,
    one RESULT line per command:
      {"op": "save", "prefix", "seed", "count"}   -> like `produce`
      {"op": "load", "prefix", "count", "timeout"} -> like `consume`
      {"op": "lookup", "prefix", "count"}          -> {"hits", "entry_ids"} (one step)
      {"op": "reattached", "old", "sessions", "timeout"}
          -> state once re-attached: to a generation other than `old` (when
             not null), in sessions other than `sessions` (when given)
      {"op": "state"} / {"op": "close"}
    """
    engine = Engine(engine_id, "both")
    engine.ready()
    answer({"ready": True, **engine.state()})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        keys = [key(command.get("prefix", ""), i) for i in range(command.get("count", 0))]
        if op == "save":
            answer(save(engine.worker, command["prefix"], command["seed"], command["count"]))
        elif op == "load":
            answer(load(engine.scheduler, engine.worker, keys, command.get("timeout", 30)))
        elif op == "lookup":
            answer({**lookup(engine.scheduler, keys), **engine.state()})
        elif op == "reattached":
            answer(engine.wait_reattached(command.get("old"), command.get("timeout", 30),
                                          command.get("sessions")))
        elif op == "state":
            answer(engine.state())
        elif op == "close":
            engine.close()
            answer({"closed": True})
            return
        else:
            answer({"error": f"unknown op {op!r}"})


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s client %(levelname)s %(name)s: %(message)s")
    command, args = argv[0], argv[1:]
    if command == "produce":
        answer(produce(args[0], int(args[1]), int(args[2])))
    elif command == "consume":
        answer(consume(args[0], int(args[1])))
    elif command == "attach":
        answer(attach_once())
    elif command == "serve":
        serve(args[0] if args else "long-running")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
