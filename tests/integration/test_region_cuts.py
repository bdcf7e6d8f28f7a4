"""Engines whose region another process keeps cutting, against the real
daemon (issue 40, finding 4, the engines' side): a process loops `ftruncate`
of the region file (to 0, to mid-region, and cut-then-regrown faster than
the daemon looks) while engine processes (a scheduler and a worker each: one
copying with the cpu backend, one with the CUDA copy path under the model of
CUDA's rules, tests/cuda_model.py, whose registrations keep their old pages
when a cut takes them out of the file) save and load in a loop. No engine
process dies, no load returns other bytes than the ones saved, no entry's
recorded checksum is another than its bytes', and once the cuts stop, saves
and loads work again without restarting anything."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ec_client.scheduler_side.scheduler import SchedulerDelegate
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.checksums import checksum
from ec_protocol.protocol import MAX_BATCH, Layout, pb
from ec_protocol.stamps import file_bytes, read_canary, whole
from tests import staged
from tests.integration.daemon import Daemon, short_tmpdir
from tests.integration.engines import Proc
from tests.integration.raw import UNCAPPED, attach, save

pytestmark = pytest.mark.integration
LAYOUT = Layout("cuts-model", "uint8", {"image": 1024})
WAIT = 30.0
ATTACK_SECONDS = 6.0
KEYS_PER_ROUND = 3
BACKENDS = {"cpu": "cpu", "cuda-model": "tests.cuda_model:EngineBackend"}


def expected(key: str) -> np.ndarray:
    """The bytes saved under `key` (any process can tell them): 64-191 KiB."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, (64 + seed % 128, 1024),
                                                dtype=np.uint8)


def _bytes(array: Any) -> bytes:
    return bytes(np.asarray(array).reshape(-1).view(np.uint8))


def _round(scheduler: SchedulerDelegate, worker: WorkerDelegate, name: str, number: int,
           seen: list[str], model: bool, settle: bool = False) -> Counter[str]:
    """Save this round's keys, then load them and some saved before (any
    engine's): each load is exactly the key's bytes, or failed. `settle`:
    wait until the view has this round's saved keys (their ready events)."""
    counts: Counter[str] = Counter()
    keys = [f"{name}-{number}-{i}" for i in range(KEYS_PER_ROUND)]
    before = Counter(worker.stats)
    for key in keys:
        data = expected(key)
        if model:  # (the model's device arrays are torch tensors)
            import torch

            data = torch.from_numpy(data)
        counts["saves_queued"] += worker.save(key, data)
    worker.flush(WAIT)
    counts.update({stat: n for stat, n in (Counter(worker.stats) - before).items()
                   if stat.startswith("save")})
    seen.extend(keys)
    deadline = time.monotonic() + WAIT
    while settle and not all(scheduler.view.get(k) for k in keys) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    wanted = keys + seen[-12:-KEYS_PER_ROUND]
    # The step that asks about them sends the loads of those the cache holds
    # (staged: tests/staged.py); the worker copies and checks them.
    _, metadata = staged.plan(scheduler, wanted, f"r{number}")
    result = worker.load(metadata.loads, metadata.regions)
    for spec in metadata.loads:
        out = result.loaded.get(spec.mm_hash)
        if out is None:
            counts["loads_failed"] += 1
        elif _bytes(out) == expected(spec.mm_hash).tobytes():
            counts["loads_exact"] += 1
            counts["loads_exact_this_round"] += spec.mm_hash in keys
        else:
            counts["loads_wrong"] += 1
    staged.report(scheduler, result)
    return counts


def engine_main(socket: str, name: str, backend: str, conn: Any) -> None:
    """An engine (scheduler and worker in one process: the test plays vLLM).
    Commands: run (rounds until the next command) -> totals; round -> one
    round's counts, its saves in the view before it loads; keys -> every key
    it saved; close."""
    scheduler = SchedulerDelegate(socket, engine_id=name, layout=LAYOUT)
    worker = WorkerDelegate(socket, engine_id=name, layout=LAYOUT, backend=backend)
    for delegate in (scheduler, worker):
        if delegate.link.wait_attached(WAIT) is None:
            raise RuntimeError(f"not attached: {delegate.link.last_error}")
    deadline = time.monotonic() + WAIT
    while not scheduler.serving():
        assert time.monotonic() < deadline, "the scheduler never served hits"
        time.sleep(0.01)
    conn.send("ready")
    model = backend != "cpu"
    seen: list[str] = []
    number = 0
    while True:
        command, _ = conn.recv()
        if command == "run":
            totals: Counter[str] = Counter()
            while not conn.poll():
                totals += _round(scheduler, worker, name, number, seen, model)
                number += 1
            conn.recv()  # the stop
            totals["rounds"] = number
            conn.send(dict(totals))
        elif command == "round":
            conn.send(dict(_round(scheduler, worker, name, number, seen, model, settle=True)))
            number += 1
        elif command == "keys":
            conn.send(list(seen))
        elif command == "close":
            worker.close()
            scheduler.close()
            conn.send("closed")
            return


ATTACKER = textwrap.dedent("""
    import os, random, sys, time
    path, size, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    whole = size + 4096
    rng = random.Random(7)
    fd = os.open(path, os.O_RDWR)  # as every engine worker may
    cuts = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        mode = cuts % 3
        if mode == 0:
            os.ftruncate(fd, 0)  # left cut: the daemon gives the size back
        elif mode == 1:
            os.ftruncate(fd, rng.randrange(size // 4, size))  # mid-region
        else:
            os.ftruncate(fd, rng.randrange(0, whole))  # cut and regrown at once
            os.ftruncate(fd, whole)
        cuts += 1
        time.sleep(rng.uniform(0.05, 0.4))
    print(cuts)
""")


def test_engines_survive_a_process_that_keeps_truncating_the_region_and_recover():
    """Finding 4 with real engines: every cut used to end the engine worker
    that touched a page past the file's end (SIGBUS); a cut regrown at once
    made a CUDA save land in pages the file no longer had, its read-back
    checksum vouching for the zeros the file held."""
    # (Without invariant checks after every call: between a cut and the
    # daemon's repair the stamps are not what the bookkeeping says. The saves
    # a cut reached wait in quarantine, which counts against the engines'
    # pending bytes: lifted, so that a test-sized cache saves on after it.)
    with Daemon(cpu_bytes="16MiB", check_invariants=False, extra=UNCAPPED) as daemon:
        engines = {name: Proc(engine_main, daemon.socket, name, backend)
                   for name, backend in BACKENDS.items()}
        try:
            for engine in engines.values():
                assert engine.recv(120) == "ready"
            for engine in engines.values():  # it works before the attack
                counts = Counter(engine.call("round", timeout=120))
                assert counts["saves_done"] == counts["loads_exact"] == KEYS_PER_ROUND
            reply = attach(daemon.stub, LAYOUT, engine="looker")
            region, size = Path(reply.region.path), reply.region.size_bytes
            for engine in engines.values():
                engine.send("run")
            attacker = subprocess.run(
                [sys.executable, "-c", ATTACKER, str(region), str(size), str(ATTACK_SECONDS)],
                capture_output=True, text=True, timeout=120)
            assert attacker.returncode == 0, attacker.stderr
            totals = {}
            for name, engine in engines.items():
                engine.send("stop")
                totals[name] = Counter(engine.recv(120))
            for name, counts in totals.items():
                assert engine_alive(engines[name]), name
                assert counts["loads_wrong"] == 0, (name, counts)
                assert counts["rounds"] > 1, (name, counts)
            assert int(attacker.stdout) >= 10
            assert sum(c["loads_failed"] + c["saves_region_cut"]
                       for c in totals.values()) > 0, totals  # the cuts reached them

            # The attacker stopped: the daemon repairs the file (its size, a
            # new canary, the cut entries dropped), and nothing restarts.
            def repaired() -> int:
                fd = os.open(region, os.O_RDONLY)
                try:
                    canary = read_canary(fd, size)
                    return canary if os.fstat(fd).st_size == file_bytes(size) and whole(
                        canary) else 0
                finally:
                    os.close(fd)

            canary = daemon.wait_for(repaired, timeout=WAIT, what="the daemon's repair")
            assert attach(daemon.stub, LAYOUT, engine="looker").region.canary == canary
            stats = daemon.stats()
            assert stats["region_truncations"] >= 2 and daemon.proc.poll() is None
            for name, engine in engines.items():
                counts = Counter(engine.call("round", timeout=120))
                assert counts["saves_done"] == KEYS_PER_ROUND, (name, counts)
                assert counts["loads_exact_this_round"] == KEYS_PER_ROUND, (name, counts)
                assert counts["loads_wrong"] == 0, (name, counts)
            # Every entry the daemon serves holds its key's bytes: no save
            # was committed with what a cut left (its checksum would say).
            keys = [k for engine in engines.values() for k in engine.call("keys")]
            results = {k: r for i in range(0, len(keys), MAX_BATCH) for k, r in zip(
                keys[i:i + MAX_BATCH], daemon.lookup(LAYOUT, *keys[i:i + MAX_BATCH]),
                strict=True)}
            ready = {k: r for k, r in results.items() if r.state == pb.READY}
            assert ready
            for key, result in ready.items():
                assert result.entry.checksum == checksum([expected(key).tobytes()]), key
        finally:
            for name, engine in engines.items():
                if engine.process.is_alive():
                    engine.send("close")
                    assert engine.recv(60) == "closed", name
                assert engine.join() == 0, f"{name} exited {engine.process.exitcode}"
                engine.kill()


def engine_alive(engine: Proc) -> bool:
    return engine.process.is_alive()


def test_a_region_of_an_older_daemon_is_adopted_with_a_canary_and_a_cut_one_is_not(
        shm_folder: Path):
    """The region format gained a trailer: a region an older daemon left (no
    trailer, no canary) is adopted by a restart with its entries, and given a
    canary its attach replies tell; a region cut (and regrown) while no daemon
    ran is not adopted (what the cut reached is unknown): a fresh one."""
    folder = short_tmpdir()
    daemons = [Daemon(folder=folder, shm_dir=str(shm_folder), cpu_bytes="4MiB")
               for _ in range(3)]
    try:
        first = daemons[0].start()
        writer = attach(first.stub, LAYOUT, engine="writer", token="5" * 32)
        save(first.stub, writer.session_id, "kept", 1 << 20)
        size = writer.region.size_bytes
        assert first.stop() == 0
        (region,) = first.own_regions()
        assert os.stat(region).st_size == file_bytes(size)
        os.truncate(region, size)  # as an older daemon left it: no trailer

        second = daemons[1].start()
        assert "adopted region" in second.log()
        assert [r.state for r in second.lookup(LAYOUT, "kept")] == [pb.READY]
        reply = attach(second.stub, LAYOUT, engine="reader")
        assert reply.region.path == str(region) and os.stat(region).st_size == file_bytes(size)
        fd = os.open(region, os.O_RDONLY)
        try:
            assert whole(reply.region.canary) and read_canary(fd, size) == reply.region.canary
        finally:
            os.close(fd)
        assert second.stop() == 0

        os.truncate(region, size // 2)  # a client cuts it while no daemon runs
        os.truncate(region, file_bytes(size))
        third = daemons[2].start()
        assert "its canary was cut" in third.log() and "starting with an empty cache" in \
            third.log()
        assert [r.state for r in third.lookup(LAYOUT, "kept")] == [pb.ABSENT]
        assert third.own_regions() != [region]
    finally:
        for daemon in reversed(daemons):
            daemon.cleanup()
