"""Scheduler-side step cost: ECDaemonConnector against vLLM's ECCPUScheduler.

Both run in this process, on real vLLM objects (a VllmConfig of a tiny
PaliGemma, `Request`s carrying `MultiModalFeatureSpec`s), driven through the
calls vLLM's scheduler makes per engine step, per request in order:
`ensure_cache_available` (a request it defers waits for the next step, as
vLLM keeps it waiting), `has_cache_item` for each of its items
(`_try_schedule_encoder_inputs`), `update_state_after_alloc` for each
(`_allocate_encoder_inputs`, hits and misses), then once
`build_connector_meta` (the step's scheduled tokens, a decode of an earlier
request among them, and the encoder outputs of the previous step's requests
freed, as vLLM frees them once they finish),
`update_connector_output` with what the workers returned
(`update_from_output`) and `take_unavailable_requests`. Ours stages each
hit's load in the step that first asks about it, deferring its request, and
the request hits once every rank reported it staged
(`ec_client.scheduler_side.staging`); upstream loads in the step that asks.
Saved ids are used round-robin from a pool of five per hit a step, so none is
in vLLM's encoder cache when it is asked about again.

- ours: `ECDaemonConnector` (SCHEDULER role, built by vLLM's factory)
  attached to a real daemon subprocess. Workers live in a forked process, as
  vLLM's do: another engine's `WorkerDelegate` saved the hits beforehand into
  the connector's namespace, and this engine's `WorkerDelegate` (one rank)
  stages each step's loads after the step, outside the timed region, copying
  and checking stamps as vLLM's worker does, adopts and drops what the step
  says. It reports `ECDaemonWorkerMetadata(done=<one entry per rank and
  transfer>, stats={})`; only then does the scheduler's view consider those
  loads finished, and their requests hit.
- upstream: `ECCPUScheduler` (ec_both, no NIXL), instantiated directly (so
  without the ECCPUConnector forwarding layer ours goes through). Hits were
  saved in a warm-up step and marked ready by a `completed_saves` report.
  Workers report `ECCPUWorkerMetadata` with the saves and loads of the step.

Worker reports arrive one step late (the copies of step k are reported in
step k+1, as with vLLM's async scheduling), for both: a hit of ours is
deferred two steps. Misses are fresh identifiers every step. Upstream
allocates blocks for every miss (it is its own producer), so its region is
sized to hold all of a case's misses without evicting, which caps the steps
of the large all-miss cases. Ours saves nothing for misses in those cases
(workers save, not the scheduler); the eviction case runs the full steady
state: the misses are saved (by the other process), the daemon evicts, and
ready and evicted events flow into the connector's view, with
acknowledgements. Upstream's cache there holds the hits plus 7 steps of
misses. Ours holds the hits plus 256 steps of misses, filled beforehand so
it evicts from the first step, under a 2 s lease: recency reaches the daemon
only as touches on heartbeats (every lease/10, here 0.2 s), so an entry hit
every step stays only in a cache that turns over more slowly than that (at
7 steps the hits were evicted before their first touch landed).

Measured per step on the calling thread, around the calls above only: wall
time (perf_counter), thread CPU time (thread_time), blocking RPCs made on the
thread (ours: the transport's per-thread count; upstream has no transport
without NIXL, so 0), messages queued on our session stream from the thread
(`SessionLink.send`, which `send_acks` uses: acknowledgements the step
released; touches ride on the heartbeats, which the link's own timer sends
whether or not anything was looked up, so none is the steps'), and the
pickled size of the step's connector metadata (what vLLM ships to workers).
Outside the timed region: blocking RPCs our worker makes on its thread during
`WorkerDelegate.load` (the load path makes none by design). The two
implementations run interleaved in blocks of steps; reported: median wall and
CPU time per step, p99 of wall time and median metadata size, over all steps
of a case. A case fails unless every lookup of a saved id hit (in both), no
request became unavailable and no load failed; steps in which our view was
not fresh (no heartbeat echoed within half the lease: its lookups miss by
design) are counted and allowed in up to 5% of a case's steps.

Rows are hidden x dtype bytes of the tiny model (128 x bfloat16 = 256 B);
upstream's block is one row, so its cost depends on the row count, not the
width; ours carries extents (64 KiB daemon pages).

    PYTHONPATH=.:.venv-vllm/torchvision .venv-vllm/bin/python \\
        -m benchmarks.scheduler_vs_upstream --json OUT.json [--scale 0.2] [--only 1x256]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import logging
import math
import multiprocessing
import os
import pickle
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.cpu.common import (
    ECCPUConnectorMetadata,
    ECCPUWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler import ECCPUScheduler
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

from benchmarks.scheduler_step import count_sends
from ec_client.common.contract import StepMetadata
from ec_client.engine_token import derived_engine_token
from ec_client.vllm_connector import ECDaemonWorkerMetadata
from ec_client.vllm_namespace import engine_identity, layout_of
from ec_client.worker_side.worker import WorkerDelegate
from ec_protocol.protocol import Layout
from tests.integration.daemon import Daemon
from tests.vllm.tiny_model import build_tiny_paligemma
from tests.vllm.vllm_harness import connector, empty_output, make_config, wait_until

# (items, rows, steps) per step; steps before --scale.
MATRIX = ((1, 256, 2000), (8, 256, 1000), (8, 1024, 600), (32, 1024, 300))
HIT_RATIOS = (0.0, 0.5, 1.0)
EVICTION_CASE = (8, 1024, 0.5, 600)
EVICTION_CACHE_STEPS = 7  # upstream's small cache: the hits plus this many steps of misses
HIT_POOL = 5  # saved ids per hit a step, used round-robin
# Ours: the hits plus this many steps of misses (filled before the run), and
# a lease whose heartbeats (lease/10) carry touches well within that turnover.
EVICTION_DAEMON_STEPS = 256
EVICTION_LEASE_SECONDS = 2.0
FILL_BATCH = 64  # saves queued at once (the worker's save queue is bounded)
WARMUP_STEPS = 20
BLOCK_STEPS = 25  # steps per interleaved block
UPSTREAM_REGION_CAP = 3 << 29  # 1.5 GiB of populated /dev/shm at most
MAIN_DAEMON_BYTES = "256MiB"


@dataclass(frozen=True)
class Case:
    items: int
    rows: int
    hit_ratio: float
    steps: int
    evictions: bool = False

    @property
    def name(self) -> str:
        return f"{self.items}x{self.rows}"

    @property
    def tag(self) -> str:
        return f"{self.name}-h{round(self.hit_ratio * 100)}{'-ev' if self.evictions else ''}"

    @property
    def max_hits(self) -> int:
        return math.ceil(self.items * self.hit_ratio)

    @property
    def hit_pool(self) -> int:
        """Saved ids: each is asked about again only once its previous
        request's encoder output was freed (4 steps later at most)."""
        return HIT_POOL * self.max_hits

    @property
    def max_misses(self) -> int:
        return self.items - math.floor(self.items * self.hit_ratio)

    def hits_at(self, step: int) -> int:
        """Hits in `step`, spread so the ratio holds over steps (1 item, 50%:
        every other step)."""
        share = self.items * self.hit_ratio
        return math.floor((step + 1) * share) - math.floor(step * share)


@dataclass(frozen=True, slots=True)
class Sample:
    wall: float
    cpu: float
    rpcs: int
    msgs: int  # queued on the session stream from the step's thread
    meta_bytes: int


# ------------------------------------------------------------ requests

def make_request(request_id: str, mm_hash: str, rows: int) -> Request:
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=mm_hash,
                                    mm_position=PlaceholderRange(offset=1, length=rows))
    return Request(request_id=request_id, prompt_token_ids=[2] + [5] * rows + [7],
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   mm_features=[feature])


def spread(hits: list[str], misses: list[str]) -> list[str]:
    """Hits and misses alternating, the rest at the end."""
    pairs = itertools.zip_longest(hits, misses)
    return [h for pair in pairs for h in pair if h is not None]


# ------------------------------------------------------ ec-daemon workers

OTHER_ENGINE = "bench-other-engine"


class Workers:
    """ec-daemon workers in a forked process, as vLLM's workers are not in
    the scheduler's process: another engine's (saves the hits, and the
    misses in the eviction case) and this engine's (it loads the dispatched
    transfers). Forked before this process opens any gRPC channel."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("fork")
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_workers_main, args=(child,), daemon=True)
        self._proc.start()
        child.close()

    def call(self, *command: Any) -> Any:
        self._conn.send(command)
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise RuntimeError(f"worker process: {command[0]} failed") from reply
        return reply

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(10)


def _workers_main(conn: Connection) -> None:
    workers: dict[tuple[str, str], WorkerDelegate] = {}
    while (command := conn.recv()) is not None:
        kind, *args = command
        try:
            conn.send(COMMANDS[kind](workers, *args))
        except Exception as exc:
            conn.send(exc)
    for worker in workers.values():
        worker.close()


def _attach(workers: dict[tuple[str, str], WorkerDelegate], socket: str, engine_id: str,
            layout: Layout, engine_token: str = "") -> bool:
    worker = WorkerDelegate(socket, engine_id=engine_id, layout=layout,
                            allocate_out=ReusedBuffers(), engine_token=engine_token)
    if worker.link.wait_attached(20) is None:
        raise RuntimeError(f"worker not attached: {worker.link.last_error}")
    workers[socket, engine_id] = worker
    return True


def _save(workers: dict[tuple[str, str], WorkerDelegate], socket: str, engine_id: str,
          ids: list[str], shape: tuple[int, int], dtype: str) -> bool:
    """Save zeros as `ids` and wait until they landed."""
    worker = workers[socket, engine_id]
    output = torch.zeros(shape, dtype=getattr(torch, dtype))
    for mm_hash in ids:
        worker.save(mm_hash, output)
    return worker.flush(60)


def _load(workers: dict[tuple[str, str], WorkerDelegate], socket: str, engine_id: str,
          step: dict[str, Any]) -> tuple[list[int], list[tuple[int, str]], int]:
    """A step's loads as vLLM's worker makes them: adopts and drops what it
    says, stages its loads; returns the transfers staged, those failed (with
    what failed), and the blocking RPCs the staging made on this thread.
    (A tree whose loads were not staged, the baseline of the staging's
    cost, loads them.)"""
    worker = workers[socket, engine_id]
    for adopt in step["adopt"]:
        if worker.adopt(adopt.transfer_id) is None:
            raise RuntimeError(f"adopt {adopt}: nothing staged")
    rpcs = worker.transport.calls_from_this_thread()
    if hasattr(worker, "stage"):
        worker.drop(step["drop"])
        result = worker.stage(step["loads"], step["regions"], step["step"])
        failed = [(t, result.kinds[t]) for t in result.failed]
    else:
        result = worker.load(step["loads"], step["regions"])
        failed = list(result.failed)
    return result.done, failed, worker.transport.calls_from_this_thread() - rpcs


def _detach(workers: dict[tuple[str, str], WorkerDelegate], socket: str) -> bool:
    for key in [key for key in workers if key[0] == socket]:
        workers.pop(key).close()
    return True


COMMANDS: dict[str, Callable[..., Any]] = {
    "attach": _attach, "save": _save, "load": _load, "detach": _detach}


class ReusedBuffers:
    """allocate_out for the loading worker: one buffer per shape, reused."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}

    def __call__(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        key = (shape, dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=getattr(torch, dtype))
        return self._buffers[key]


@dataclass
class DaemonEngine:
    """Our side of one engine on one daemon: the scheduler connector here,
    the workers (this engine's and another's) in the worker process."""

    daemon: Daemon
    connector: Any
    workers: Workers
    engine_id: str
    layout: Layout
    stream: StreamCount

    @classmethod
    def start(cls, daemon: Daemon, config: VllmConfig, workers: Workers) -> DaemonEngine:
        assert config.ec_transfer_config is not None
        config.ec_transfer_config.ec_connector_extra_config["ec_daemon_socket"] = daemon.socket
        engine_id, layout = engine_identity(config), layout_of(config)
        # This engine's worker presents the token its scheduler derives (as a
        # vLLM worker of the same instance does); the other engine has none.
        token = derived_engine_token(engine_id, config.instance_id)
        for worker_engine, engine_token in ((engine_id, token), (OTHER_ENGINE, "")):
            workers.call("attach", daemon.socket, worker_engine, layout, engine_token)
        scheduler = connector(config, ECConnectorRole.SCHEDULER)
        if scheduler.scheduler_delegate.link.wait_attached(20) is None:
            raise RuntimeError(f"not attached: {scheduler.scheduler_delegate.link.last_error}")
        wait_until(lambda: scheduler.scheduler_delegate.serving())  # the workers mapped the region
        return cls(daemon, scheduler, workers, engine_id, layout,
                   StreamCount(scheduler.scheduler_delegate.link))

    def save(self, ids: list[str], rows: int) -> None:
        """Another engine saves `ids` (rows x the layout's width) and waits."""
        dtype = self.layout.dtype
        width = self.layout.row_bytes["embeds"] // getattr(torch, dtype).itemsize
        if not self.workers.call("save", self.daemon.socket, OTHER_ENGINE, ids, (rows, width),
                                 dtype):
            raise RuntimeError("saves did not land")

    def load(self, metadata: StepMetadata) -> tuple[list[int], list[tuple[int, str]], int]:
        """This engine's worker (one rank) works through a step's loads:
        (staged, failed, blocking RPCs on the load path)."""
        step = {"loads": metadata.loads, "regions": dict(metadata.regions),
                **{name: getattr(metadata, name, default)
                   for name, default in (("adopt", []), ("drop", []), ("step", 0))}}
        done, failed, rpcs = self.workers.call("load", self.daemon.socket, self.engine_id, step)
        return done, failed, rpcs

    def close(self) -> None:
        self.connector.shutdown()
        self.workers.call("detach", self.daemon.socket)


class StreamCount:
    """Counts what a SessionLink queues on its session stream, per thread
    (`send_acks` goes through `send`), and the heartbeats its timer sends
    with the touches they carry."""

    def __init__(self, link: Any) -> None:
        self.sent = count_sends(link)  # thread ident -> messages
        self.heartbeats = self.touches = 0
        listener = link.listener  # builds each heartbeat (LinkListener)
        heartbeat = listener.heartbeat_message

        def counted_heartbeat() -> Any:
            message = heartbeat()
            self.heartbeats += 1
            self.touches += sum(max(1, t.loads) for t in message.touches)
            return message

        listener.heartbeat_message = counted_heartbeat

    def from_this_thread(self) -> int:
        return self.sent.get(threading.get_ident(), 0)


# -------------------------------------------------------------- drivers

class Driver:
    """Runs one implementation's scheduler side through the step sequence."""

    impl = ""

    def __init__(self, case: Case, scheduler: Any) -> None:
        self.case = case
        self.scheduler = scheduler
        self.tag = f"{case.tag}-{self.impl}"
        self.hit_ids = [f"{self.tag}-hit-{i}" for i in range(case.hit_pool)]
        self.saved = set(self.hit_ids)
        self.samples: list[Sample] = []
        self.hits = self.lookups = self.unavailable = self.deferrals = 0
        self.asked_hits = 0  # lookups of saved ids in the timed steps
        self.step_hits = self.step_saved = 0
        self.lost: list[str] = []  # timed steps where saved ids missed, and why
        self.stale_steps = self.stale_misses = 0  # of those, while the view was not fresh
        self._step = 0
        self._next_hit = 0
        self._waiting: list[Request] = []  # deferred by the previous step
        self._freed: list[str] = []  # the previous step's items: their requests finished
        self._reply = ECConnectorOutput()

    # hooks
    def rpcs(self) -> int:
        return 0

    def msgs(self) -> int:
        return 0

    def worker_meta(self, meta: Any) -> Any:
        raise NotImplementedError

    def after_step(self, meta: Any, misses: list[str]) -> None:
        """Outside the timed region, after the workers' part."""

    def why_missed(self) -> str:
        """What may explain saved ids that missed (right after the step)."""
        return ""

    def stale(self) -> bool:
        """Was the view not answering hits (its lease not known renewed)?"""
        return False

    def close(self) -> None:
        """Release what the driver holds."""

    # the steps
    def run(self, steps: int, timed: bool = True) -> None:
        for _ in range(steps):
            hits = self.case.hits_at(self._step)
            hit_ids = [self.hit_ids[(self._next_hit + i) % len(self.hit_ids)]
                       for i in range(hits)]
            self._next_hit += hits
            misses = [f"{self.tag}-{self._step}-miss-{i}" for i in range(self.case.items - hits)]
            ids = spread(hit_ids, misses)
            requests = [*self._waiting,
                        *(make_request(f"{self.tag}-{self._step}-{i}", mm_hash, self.case.rows)
                          for i, mm_hash in enumerate(ids))]
            meta = self.step(requests, timed)
            if timed:
                self.asked_hits += self.step_saved
                if self.step_hits != self.step_saved and self.stale():
                    self.stale_steps += 1
                    self.stale_misses += self.step_saved - self.step_hits
                elif self.step_hits != self.step_saved:
                    self.lost.append(f"step {self._step}: {self.step_hits} of "
                                     f"{self.step_saved} hits ({self.why_missed()})")
            self._reply = ECConnectorOutput(ec_connector_worker_meta=self.worker_meta(meta))
            self.after_step(meta, misses)
            self._step += 1

    def step(self, requests: list[Request], timed: bool = True) -> Any:
        scheduler, rpcs, msgs = self.scheduler, self.rpcs(), self.msgs()
        # Earlier requests decode in every step: its workers run it even where
        # every new request waits (vLLM's V1 runner skips steps without tokens).
        hits = saved = 0
        tokens = 1
        waiting: list[Request] = []
        cpu, wall = time.thread_time(), time.perf_counter()
        for request in requests:
            if not scheduler.ensure_cache_available(request, 0):
                waiting.append(request)
                continue
            tokens += request.num_prompt_tokens
            for feature in request.mm_features:
                hits += scheduler.has_cache_item(feature.identifier)
            for index in range(len(request.mm_features)):
                scheduler.update_state_after_alloc(request, index)
        meta = scheduler.build_connector_meta(empty_output(tokens, self._freed))
        scheduler.update_connector_output(self._reply)
        unavailable = scheduler.take_unavailable_requests()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        scheduled = [r for r in requests if r not in waiting]
        saved = sum(f.identifier in self.saved for r in scheduled for f in r.mm_features)
        self._freed = [f.identifier for r in scheduled for f in r.mm_features]
        self._waiting = waiting
        self.step_hits, self.step_saved = hits, saved
        if timed:
            self.samples.append(Sample(wall, cpu, self.rpcs() - rpcs, self.msgs() - msgs,
                                       len(pickle.dumps(meta))))
            self.hits += hits
            self.lookups += len(scheduled)
            self.deferrals += len(waiting)
            self.unavailable += len(unavailable)
        return meta


class UpstreamDriver(Driver):
    impl = "upstream"

    def __init__(self, case: Case, config: VllmConfig, capacity_rows: int) -> None:
        super().__init__(case, upstream_scheduler(config, capacity_rows))
        assert self.scheduler._transport is None and not self.scheduler._nixl_enabled
        self.capacity_rows = capacity_rows
        self.saved_rows = 0
        # Hits: saved in a step, then reported saved by the workers.
        meta = self.step([make_request(f"{self.tag}-seed-{i}", h, case.rows)
                          for i, h in enumerate(self.hit_ids)], timed=False)
        self.scheduler.update_connector_output(ECConnectorOutput(
            ec_connector_worker_meta=self.worker_meta(meta)))

    def worker_meta(self, meta: ECCPUConnectorMetadata) -> ECCPUWorkerMetadata | None:
        if not (meta.saves or meta.loads):
            return None
        self.saved_rows += sum(len(blocks) for blocks in meta.saves.values())
        return ECCPUWorkerMetadata(completed_saves=list(meta.saves),
                                   completed_loads=[tid for tid, _, _ in meta.loads.values()])

    def evicted(self) -> bool:
        return self.saved_rows > self.capacity_rows

    def close(self) -> None:
        self.scheduler.shutdown()  # unlinks its region


# vLLM's ECCPUScheduler keeps its region in /dev/shm/vllm_ec_<instance id>_dp0.mmap
# and unlinks it on shutdown; a run killed before that left it there.
UPSTREAM_REGIONS = Path("/dev/shm")
UPSTREAM_PREFIX = "vllm_ec_ecbench-"


def remove_dead_runs_regions() -> None:
    """The upstream regions of earlier runs of this benchmark whose process
    is gone (SIGKILL, or a crash), this user's only: their names carry the
    run's pid (`upstream_scheduler`)."""
    for path in UPSTREAM_REGIONS.glob(f"{UPSTREAM_PREFIX}*.mmap"):
        pid = path.name.removeprefix(UPSTREAM_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_uid == os.getuid():
                path.unlink()
                print(f"removed {path}: left by a run of this benchmark that was killed",
                      file=sys.stderr, flush=True)


def upstream_scheduler(config: VllmConfig, capacity_rows: int) -> ECCPUScheduler:
    ec = config.ec_transfer_config
    assert ec is not None
    row_bytes = config.model_config.get_inputs_embeds_size() * config.model_config.dtype.itemsize
    ec.ec_connector_extra_config["ec_cpu_bytes"] = capacity_rows * row_bytes
    ec.mm_encoder_output_widths = {"image": config.model_config.get_inputs_embeds_size()}
    # the region's name (remove_dead_runs_regions reads the pid from it)
    config.instance_id = f"ecbench-{os.getpid()}-{time.monotonic_ns()}"
    return ECCPUScheduler(config)


class DaemonDriver(Driver):
    impl = "ec-daemon"

    def __init__(self, case: Case, engine: DaemonEngine) -> None:
        super().__init__(case, engine.connector)
        self.engine = engine
        self._delegate = engine.connector.scheduler_delegate
        self.failed_loads = self.loads = self.load_rpcs = 0
        self.load_path_steps = 0
        self._stream = (engine.stream.heartbeats, engine.stream.touches, time.monotonic())
        if case.evictions:  # older than the hits: evicted first
            fill = [f"{self.tag}-fill-{i}" for i in range(EVICTION_DAEMON_STEPS * case.max_misses)]
            for start in range(0, len(fill), FILL_BATCH):
                engine.save(fill[start:start + FILL_BATCH], case.rows)
        engine.save(self.hit_ids, case.rows)
        wait_until(lambda: all(self._delegate.view.get(h) for h in self.hit_ids), 60)

    def rpcs(self) -> int:
        return int(self._delegate.transport.calls_from_this_thread())

    def msgs(self) -> int:
        return self.engine.stream.from_this_thread()

    def stale(self) -> bool:
        return not self._delegate.link.fresh()

    def fresh_for_a_while(self) -> bool:
        """Fresh, with a heartbeat interval to spare."""
        link = self._delegate.link
        attachment = link.attachment
        return attachment is not None and (
            link.fresh_until - time.monotonic() > attachment.heartbeat_ms / 1000)

    def why_missed(self) -> str:
        link, view = self._delegate.link, self._delegate.view
        return (f"attached {link.attachment is not None}, fresh {link.fresh()}, "
                f"{sum(view.get(h) is not None for h in self.hit_ids)} of "
                f"{len(self.hit_ids)} hit ids in the view, last error {link.last_error!r}")

    def worker_meta(self, meta: Any) -> ECDaemonWorkerMetadata | None:
        """The worker's part of the step: it stages what the step sent,
        adopts and drops what it says, and reports the staged loads (in the
        next step's `update_connector_output`)."""
        self.load_path_steps += 1
        if not (meta.loads or getattr(meta, "adopt", None) or getattr(meta, "drop", None)):
            return None
        done, failed, rpcs = self.engine.load(meta)
        self.loads += len(meta.loads)
        self.failed_loads += len(failed)
        self.load_rpcs += rpcs
        if "failed" not in ECDaemonWorkerMetadata.__dataclass_fields__:  # (the baseline)
            return ECDaemonWorkerMetadata(done=done, stats={})
        return ECDaemonWorkerMetadata(done=done, stats={}, failed=failed)

    def after_step(self, meta: Any, misses: list[str]) -> None:
        if self.case.evictions and misses:
            # Saved as they are computed (a backlog would push the hits out
            # of the daemon's LRU, which steady state does not).
            self.engine.save(misses, self.case.rows)

    def stream_figures(self) -> dict[str, float]:
        """Heartbeats the link sent and touches they carried since this
        driver started (its warm-up, blocks and the upstream blocks between)."""
        heartbeats, touches, started = self._stream
        stream = self.engine.stream
        return {"heartbeats_per_s": (stream.heartbeats - heartbeats)
                / (time.monotonic() - started),
                "touches_per_load": (stream.touches - touches) / max(1, self.loads)}


# ---------------------------------------------------------------- cases

def steps_for(case: Case, row_bytes: int) -> tuple[Case, int]:
    """The case with its steps capped so upstream's region holds every miss
    (or, for the eviction case, a few steps of them); and that capacity in rows."""
    hit_rows = case.hit_pool * case.rows
    miss_rows = case.max_misses * case.rows
    if case.evictions:
        return case, hit_rows + EVICTION_CACHE_STEPS * miss_rows
    cap_rows = UPSTREAM_REGION_CAP // row_bytes
    steps = case.steps
    if miss_rows:
        steps = max(BLOCK_STEPS, min(steps, (cap_rows - hit_rows) // miss_rows - WARMUP_STEPS - 1))
    capacity = hit_rows + (WARMUP_STEPS + steps + 1) * miss_rows
    return Case(case.items, case.rows, case.hit_ratio, steps, case.evictions), capacity


def run_case(case: Case, config: VllmConfig, engine: DaemonEngine) -> list[dict[str, Any]]:
    case, capacity = steps_for(case, layout_of(config).row_bytes["embeds"])
    ours = DaemonDriver(case, engine)
    upstream = UpstreamDriver(case, config, capacity)
    try:
        drivers: list[Driver] = [ours, upstream]
        with frozen_gc():
            for driver in drivers:
                driver.run(WARMUP_STEPS, timed=False)
            # The timed steps start with our view fresh for a while: the
            # collection above holds the GIL, and on a busy host the view
            # may then have missed a heartbeat's echo.
            wait_until(ours.fresh_for_a_while)
            for block, start in enumerate(range(0, case.steps, BLOCK_STEPS)):
                for driver in drivers if block % 2 == 0 else drivers[::-1]:
                    driver.run(min(BLOCK_STEPS, case.steps - start))
        check(case, ours, upstream)
        rows = [summarize(case, driver) for driver in drivers]
        rows[0].update(ours.stream_figures(), stale_steps=ours.stale_steps,
                       worker_rpcs_per_step=ours.load_rpcs / ours.load_path_steps)
        return rows
    finally:
        upstream.close()


# At most this share of a case's steps may miss for a view that was not
# fresh (a heartbeat's echo later than half the lease, on a busy host).
MAX_STALE_SHARE = 0.05


def check(case: Case, ours: DaemonDriver, upstream: UpstreamDriver) -> None:
    if ours.stale_steps:
        print(f"  {ours.tag}: {ours.stale_steps} steps ({ours.stale_misses} hits) missed "
              "while the view was not fresh", file=sys.stderr, flush=True)
    if ours.stale_steps > MAX_STALE_SHARE * case.steps:
        raise AssertionError(f"{ours.tag}: not fresh in {ours.stale_steps} of {case.steps} "
                             "steps")
    for driver in (ours, upstream):
        # Every lookup of a saved id hits (none was evicted), no miss does.
        if driver.hits + driver.stale_misses != driver.asked_hits or driver.unavailable:
            raise AssertionError(f"{driver.tag}: {driver.hits} hits of {driver.asked_hits} "
                                 f"saved ids looked up, {driver.unavailable} unavailable "
                                 f"requests; {'; '.join(driver.lost[:5])}")
    if ours.failed_loads:
        raise AssertionError(f"{ours.tag}: {ours.failed_loads} of {ours.loads} loads failed")
    if upstream.evicted() != case.evictions:
        raise AssertionError(f"{upstream.tag}: evictions {upstream.evicted()}")


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """As vLLM's engine core does after start-up: long-lived objects out of
    the collector's way."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(case: Case, driver: Driver) -> dict[str, Any]:
    samples = driver.samples
    walls = [s.wall * 1e6 for s in samples]
    msgs = sum(s.msgs for s in samples)
    return {"case": case.name, "items": case.items, "rows": case.rows,
            "hit_ratio": case.hit_ratio, "evictions": case.evictions, "impl": driver.impl,
            "steps": len(samples), "hits": driver.hits,
            "deferrals_per_step": driver.deferrals / len(samples),
            "blocking_rpcs_per_step": sum(s.rpcs for s in samples) / len(samples),
            "msgs_per_step": msgs / len(samples),
            "msgs_per_hit": msgs / driver.hits if driver.hits else None,
            "median_us": statistics.median(walls), "p99_us": quantile(walls, 0.99),
            "cpu_us_per_step": statistics.median(s.cpu * 1e6 for s in samples),
            "meta_bytes": statistics.median(s.meta_bytes for s in samples)}


# ---------------------------------------------------------------- output

COLUMNS = ("median_us", "p99_us", "cpu_us_per_step", "meta_bytes")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'case':<8}{'hit':>5}{'evict':>6}  {'impl':<10}{'steps':>6}{'rpc/step':>9}"
          f"{'median us':>11}{'p99 us':>10}{'cpu us':>10}{'meta B':>10}{'msgs/hit':>9}"
          f"{'wrk rpc':>8}")
    for ours, upstream in zip(rows[::2], rows[1::2], strict=True):
        for row in (ours, upstream):
            per_hit = row["msgs_per_hit"]
            worker = row.get("worker_rpcs_per_step")
            print(f"{row['case']:<8}{row['hit_ratio']:>5.1f}{'yes' if row['evictions'] else '':>6}"
                  f"  {row['impl']:<10}{row['steps']:>6}{row['blocking_rpcs_per_step']:>9.2f}"
                  f"{row['median_us']:>11.1f}{row['p99_us']:>10.1f}"
                  f"{row['cpu_us_per_step']:>10.1f}{row['meta_bytes']:>10.0f}"
                  f"{'-' if per_hit is None else f'{per_hit:.2f}':>9}"
                  f"{'-' if worker is None else f'{worker:.2f}':>8}")
        ratios = "".join(f"{ratio(ours[c], upstream[c]):>{w}}"
                         for c, w in zip(COLUMNS, (11, 10, 10, 10), strict=True))
        print(f"{'':<21}{'ours/up':<10}{'':>15}{ratios}")


def ratio(ours: float, upstream: float) -> str:
    return f"{ours / upstream:.2f}x" if upstream else "-"


# ------------------------------------------------------------------ main

def bench_config(folder: Path) -> VllmConfig:
    model = build_tiny_paligemma(folder / "model")
    return make_config(model, "unix:///nonexistent")  # the socket is set per daemon


def cases(scale: float) -> list[Case]:
    def scaled(steps: int) -> int:
        return max(BLOCK_STEPS, round(steps * scale))

    matrix = [Case(items, rows, hit, scaled(steps)) for items, rows, steps in MATRIX
              for hit in HIT_RATIOS]
    items, rows, hit, steps = EVICTION_CASE
    return [*matrix, Case(items, rows, hit, scaled(steps), evictions=True)]


def run_all(scale: float, workers: Workers, folder: Path, only: str = ""
            ) -> list[dict[str, Any]]:
    config = bench_config(folder)
    row_bytes = layout_of(config).row_bytes["embeds"]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        engines: dict[str, DaemonEngine] = {}
        for case in cases(scale):
            if only not in case.tag:
                continue
            extra: tuple[str, ...] = ()
            size = MAIN_DAEMON_BYTES
            if case.evictions:
                capacity = (case.hit_pool + EVICTION_DAEMON_STEPS * case.max_misses) * case.rows
                size = f"{-(-capacity * row_bytes >> 20)}MiB"
                extra = ("--lease-seconds", str(EVICTION_LEASE_SECONDS))
            if size not in engines:
                engines[size] = stack.enter_context(daemon_engine(size, config, workers, extra))
            rows += run_case(case, config, engines[size])
            report_daemon(case, engines[size].daemon)
    return rows


@contextlib.contextmanager
def daemon_engine(cpu_bytes: str, config: VllmConfig, workers: Workers,
                  extra: tuple[str, ...] = ()) -> Iterator[DaemonEngine]:
    with Daemon(cpu_bytes=cpu_bytes, check_invariants=False, extra=extra) as daemon:
        engine = DaemonEngine.start(daemon, config, workers)
        try:
            yield engine
        finally:
            engine.close()


def report_daemon(case: Case, daemon: Daemon) -> None:
    stats = daemon.stats()
    print(f"  {case.tag}: daemon {stats['evictions']} evictions, {stats['saves']} saves, "
          f"{stats['refused_saves']} refused saves, {stats['loads']} loads",
          file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply step counts")
    parser.add_argument("--only", default="", help="run the cases whose tag contains this "
                        "(tags: 8x1024-h50, 8x1024-h50-ev, ...)")
    args = parser.parse_args()
    logging.getLogger("vllm").setLevel(logging.WARNING)
    remove_dead_runs_regions()
    # SIGTERM (`timeout`, a CI job cancelled) unwinds like Ctrl-C: the
    # `finally` blocks unlink the upstream regions and stop the daemons.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    workers = Workers()  # forked first: no gRPC channel exists yet
    try:
        with tempfile.TemporaryDirectory(prefix="ecbench-") as folder:
            rows = run_all(args.scale, workers, Path(folder), args.only)
    finally:
        workers.close()
    print_table(rows)
    print(f"total {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
