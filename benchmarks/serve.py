"""`make bench-serve`: what ec-daemon buys engines serving images, measured
with vLLM's own client against real `vllm serve` engines.

Two engines on this host, each pinned to its own core, serve the tests' tiny
PaliGemma (built offline) with a SigLIP-base-sized vision tower, so an
encode costs what it costs beside a small LM; prefix caching is on, as
deployed; eager (torch.compile's warm-up would cost minutes per engine
start here, and vLLM does not compile the vision encoder anyway). vLLM's own
benchmark client sends the requests (benchmarks/serve_stream.py), greedy,
8 tokens each. In every stream 80% of the requests show an image seen
before (Dynamo's setup, scaled down); each workload has images of its own
(the tier's run of (d) too: its engines hold the first run's). Modes,
in the same run and on the same requests: no EC connector ("none"), vLLM's
`ECExampleConnector` on one shared folder ("example", the only upstream
connector engines of a host can share), and ec-daemon. Each mode gets one
pair of engines that runs all its workloads, in this order:

(a) the stream split round-robin between the engines, at each rate of
    `--rates` (1 and 2 requests/s of the whole stream);
(c) the same with the daemon restarted at half time (SIGTERM, then a
    start on the same socket that adopts its region: a warm restart). Only
    ec-daemon restarts; for the other modes nothing does, they are the
    comparison;
(d) two "hosts": engine 0 behind one daemon, engine 1 behind another (two
    sockets and regions); the first half of the stream goes to engine 0 and
    the second half moves to engine 1. Modes: none, ec-daemon without a
    second tier, and "ec-daemon-tier": both daemons on one Redis
    (`--remote`, a redis-server started here). The example connector has no
    cross-host story and sits (d) out. The move waits until host 1 has
    published what it saved (write-behind, milliseconds);
(b) engine 0 stopped with SIGTERM after half of its requests and started
    again; then the second half runs. Last, as it leaves a fresh engine.
(f) the reuse sweep (20%, 50%, 80% reuse; then images that arrive at both
    engines at once), on the same pair of engines, after (b);
(e) E/PD: an encoder instance and a prefill/decode instance behind the E/PD
    proxy, through ec-daemon or ECExampleConnector, against one engine
    without a connector; engines of their own, after every mode's pair.
    Then metadata-only E/PD through vLLM's own proxy, rewrite mode against
    --no-rewrite and one engine, on a tiny Qwen2-VL ("e-meta"). (e) and (f)
    are described in benchmarks/serve_epd.py and serve_metadata.py.

(b), (c) and (d) run in two phases: the first half of the stream, the event
(restart, move), the second half. Each request's send time is reported
relative to the event (its downtime left out), and how many requests each
mode takes after it to return to its steady state (defined in
benchmarks/serve_report.py: a rolling mean of 3 non-cold TTFTs within 1.2x
of the mode's repeat-request mean in the second half before the event).

Per workload and mode: TTFT mean/p50/p90/p99, of cold requests (the first
for their image on the host, from the stream) and of repeat requests, with
ratios to "none" and to "example"; request throughput; encoder forwards per
request (vLLM's per-step log, `--enable-logging-iteration-details`; vLLM
exports no counter of them) and the share of encodes avoided; the daemons' hits,
misses, saves, loads and second-tier promotions; the connector's counters
from each engine's /metrics; whether each request generated what it did
with no connector (greedy). Before its first workload each engine serves
one warm-up request of its own image, outside every result.

Prints tables and writes results/serve-<time>/ (a JSON per workload,
summary.json, figures); a full run with every mode also writes the figures
to docs/ (serve-ttft-cdf.png, serve-ttft-over-time.png). `--quick` shrinks
every workload to check that it runs; its numbers are not results.

On a CUDA host (`make gpu-bench-serve`): `--device cuda --model NAME` runs
a real model, without taskset or float32, and adds mode "cpu": vLLM's
ECCPUConnector, one per engine, which needs VLLM_USE_V2_MODEL_RUNNER=1 and
with it Triton on a GPU (refused on a CPU host).

Run in the vLLM environment (`make bench-serve` does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import serve_metadata
from benchmarks.serve_epd import REUSE_LEVELS, EPDRun, e_stream, figure, sweep_row, sweep_streams
from benchmarks.serve_hosts import EngineSetup
from benchmarks.serve_modes import ModeRun, Workload
from benchmarks.serve_report import figures, print_table, recovery, summarise, with_ratios
from benchmarks.serve_stream import (
    MOVE,
    ROUND_ROBIN,
    Client,
    Request,
    make_images,
    make_stream,
)

ROOT = Path(__file__).resolve().parent.parent
# PaliGemma has no chat template; the image tokens come from its processor.
CHAT_TEMPLATE = ("{% for message in messages %}{% if message['content'] is string %}"
                 "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
                 "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
                 "{% endif %}{% endfor %}")
MODES = ("none", "example", "ec-daemon")
GPU_MODES = (*MODES, "cpu")
TIER = "ec-daemon-tier"  # ec-daemon with a second tier, workload (d) only
D_MODES = ("none", "ec-daemon")  # the modes of (d) besides TIER
WORKLOADS = "a,b,c,d,e,f"
RATES = "1,2"
GPU_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
CPU_ONLY_REFUSAL = (
    "mode cpu (vLLM's ECCPUConnector) needs VLLM_USE_V2_MODEL_RUNNER=1, and vLLM's V2 "
    "model runner needs Triton with a GPU backend, which a CPU host lacks: run it on a "
    "CUDA host (make gpu-bench-serve, --device cuda)")


@dataclass(frozen=True)
class Plan:
    """How much one run does (`--quick` shrinks it)."""

    quick: bool
    seed: int
    rates: tuple[float, ...]  # workload (a)'s, requests/s of the whole stream
    reuse: float = 0.8
    event_rate: float = 1.0  # (b), (c), (d)

    @property
    def a_requests(self) -> int:  # per rate, the whole stream
        return 6 if self.quick else 40

    @property
    def a_images(self) -> int:
        return 2 if self.quick else 8

    @property
    def event_requests(self) -> int:  # (b), (c), (d): half before the event
        return 6 if self.quick else 32

    @property
    def event_images(self) -> int:
        return 2 if self.quick else 6

    @property
    def sweep_requests(self) -> int:  # (f), phase 0 of each level
        return 6 if self.quick else 24

    @property
    def at_once_images(self) -> int:  # (f), phase 1 of each level
        return 1 if self.quick else 4

    @property
    def meta_requests(self) -> int:  # (e), metadata-only: each of its three modes
        return 4 if self.quick else 20

    @property
    def meta_images(self) -> int:
        return 2 if self.quick else 5


def workloads(plan: Plan, folder: Path, image_size: int, with_tier: bool) -> list[Workload]:
    """Every workload of the run, in the order each mode runs them. Each
    stream has a seed of its own and images of its own (no image of one
    workload is in another, so each starts cold)."""

    def stream(name: str, count: int, images: int, rate: float, seed: int, route: str,
               phases: int) -> list[Request]:
        paths = make_images(folder, images, image_size, plan.seed + zlib.crc32(name.encode()),
                            name)
        return make_stream(paths, count, rate, plan.reuse, seed, route, phases)

    out = []
    for i, rate in enumerate(plan.rates):
        seed = plan.seed + i
        out.append(Workload(
            f"a@{rate:g}", "a", f"(a) round-robin at {rate:g} req/s", "", seed, rate,
            stream(f"a{i}", plan.a_requests, plan.a_images, rate, seed, ROUND_ROBIN, 1),
            (0, 1)))
    for key, title, event, route, affected, offset in (
            ("c", "(c) daemon restarted mid-stream", "daemon restart", ROUND_ROBIN, (0, 1), 10),
            ("d", "(d) the stream moved to another host", "move", MOVE, (1,), 11),
            ("b", "(b) engine 0 restarted mid-stream", "engine restart", ROUND_ROBIN, (0,), 12)):
        seed = plan.seed + offset
        streams = [stream(name, plan.event_requests, plan.event_images, plan.event_rate, seed,
                          route, 2)
                   for name in ([key, "d-tier"] if key == "d" and with_tier else [key])]
        out.append(Workload(key, key, title, event, seed, plan.event_rate, streams[0], affected,
                            streams[1] if len(streams) > 1 else None))
    for level in REUSE_LEVELS:
        seed = plan.seed + 20 + round(level * 100)
        images = max(1, round(plan.sweep_requests * (1 - level)))
        out.append(Workload(
            f"f@{round(level * 100)}", "f", f"(f) {level:.0%} reuse, then images at both "
            "engines at once", "", seed, plan.event_rate,
            sweep_streams(folder, level, plan.sweep_requests, images, plan.at_once_images,
                          plan.event_rate, seed, image_size), (0, 1), reuse=level))
    seed = plan.seed + 30
    out.append(Workload("e", "e", "(e) E/PD through a proxy; none: one engine", "", seed,
                        plan.rates[0], e_stream(folder, plan.a_requests, plan.a_images,
                                                plan.rates[0], plan.reuse, seed, image_size),
                        (0,)))
    seed = plan.seed + 31
    out.append(Workload("e-meta", "e", "(e) metadata-only E/PD through vLLM's proxy (tiny "
                        "Qwen2-VL); none: one engine", "", seed, plan.rates[0],
                        e_stream(folder, plan.meta_requests, plan.meta_images, plan.rates[0],
                                 plan.reuse, seed, serve_metadata.IMAGE_SIZE), (0,)))
    return out


def run_mode(mode: str, run: ModeRun, todo: list[Workload]) -> dict[str, list[dict[str, Any]]]:
    """Every workload of `todo` this mode takes part in; rows by workload key
    (a mode of its own, TIER, for the second tier in (d))."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for workload in todo:
        if workload.workload == "e":  # engines of its own (run_epd)
            continue
        if workload.workload == "f":
            print(f">> {mode}: {workload.title}, {len(workload.stream)} requests", flush=True)
            rows.setdefault(workload.key, []).append(sweep_row(mode, run, workload.stream))
            continue
        if workload.key == "d" and mode not in D_MODES:
            print(f"   (d) skipped for {mode}: it has no cross-host story", flush=True)
            continue
        variants = [mode, TIER] if workload.tier_stream and mode == "ec-daemon" else [mode]
        for label in variants:
            print(f">> {label}: {workload.title}, {len(workload.stream)} requests", flush=True)
            began = time.monotonic()
            outcomes, counters, info = run.workload(workload, tier=label == TIER)
            print(f"   done in {time.monotonic() - began:.0f}s", flush=True)
            row = summarise(label, outcomes, counters, info.pop("zero", None))
            row.update(info)
            if workload.event:
                row.update(recovery(row["requests_detail"], set(workload.affected_engines)))
            rows.setdefault(workload.key, []).append(row)
    return rows


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))  # tests.vllm.tiny_model, tests.redis_servers
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("benchmarks.serve draws its figures with matplotlib: install it into this "
                 "environment (make install-vllm does, in a new .venv-vllm)")
    plan = Plan(args.quick, args.seed, tuple(float(r) for r in args.rates.split(",")))
    modes = args.modes.split(",")
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = ROOT / "results" / f"serve-{'quick-' if args.quick else ''}{stamp}"
    folder = Path(tempfile.mkdtemp(prefix="ecd-serve-"))
    done = False
    try:
        setup, prompt, image_size = engine_setup(args, folder)
        with_tier = shutil.which("redis-server") is not None
        if not with_tier:
            print("!! no redis-server (make redis): (d) runs without ec-daemon-tier", flush=True)
        todo = workloads(plan, folder, image_size, with_tier)
        wanted = args.workloads.split(",")
        todo = [w for w in todo if w.workload in wanted or w.key in wanted]
        print(">> loading vLLM's benchmark client", flush=True)
        client = Client(setup.model, prompt, folder)
        by_key: dict[str, list[dict[str, Any]]] = {}
        for mode in modes if any(w.workload != "e" for w in todo) else ():
            print(f">> mode {mode}: starting two engines", flush=True)
            mode_started = time.monotonic()
            with ModeRun(mode, setup, client, folder / mode, image_size) as run:
                print(f"   serving after {time.monotonic() - mode_started:.0f}s", flush=True)
                for key, rows in run_mode(mode, run, todo).items():
                    by_key.setdefault(key, []).extend(rows)
        for workload in (w for w in todo if w.key == "e"):
            for mode in (m for m in modes if m in MODES):
                print(f">> {mode}: {workload.title}, {len(workload.stream)} requests", flush=True)
                with EPDRun(mode, setup, client, folder / f"epd-{mode}", image_size) as epd:
                    by_key.setdefault("e", []).append(epd.run(workload.stream))
        for workload in (w for w in todo if w.key == "e-meta"):
            by_key["e-meta"] = metadata_only(workload, setup, folder)
        done = True
    finally:
        if done and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"!! logs kept in {folder}", flush=True)
    results = report(plan, todo, by_key, args, time.monotonic() - started)
    write(results, out_dir, args)


def metadata_only(workload: Workload, setup: EngineSetup, folder: Path) -> list[dict[str, Any]]:
    """(e), metadata-only: each mode of benchmarks/serve_metadata.py on the
    tiny Qwen2-VL, placed as `setup`'s engines are."""
    from benchmarks.serve_stream import make_images
    from tests.vllm.tiny_qwen2vl import build_tiny_qwen2vl

    print(">> building the tiny Qwen2-VL", flush=True)
    model = build_tiny_qwen2vl(folder / "qwen2vl")
    qwen = EngineSetup(setup.device, str(model), None, cores=setup.cores, gpus=setup.gpus)
    client = Client(str(model), serve_metadata.PROMPT, folder)
    warm = make_images(folder, 1, serve_metadata.IMAGE_SIZE, 20_001, "meta-warm-up")[0]
    rows = []
    for mode in serve_metadata.MODES:
        print(f">> {mode}: {workload.title}, {len(workload.stream)} requests", flush=True)
        with serve_metadata.MetadataRun(mode, qwen, client, folder / f"meta-{mode}",
                                        warm) as run:
            rows.append(run.run(workload.stream))
    return rows


def engine_setup(args: argparse.Namespace, folder: Path) -> tuple[EngineSetup, str, int]:
    """The engines' model and placement; the prompt; the image size."""
    if args.device == "cpu":
        from tests.vllm.tiny_model import SIGLIP_BASE, build_tiny_paligemma

        print(">> building the tiny PaliGemma with a SigLIP-base-sized vision tower", flush=True)
        model = build_tiny_paligemma(folder / "model", shape=SIGLIP_BASE)
        cores = tuple(sorted(os.sched_getaffinity(0)))
        return (EngineSetup("cpu", str(model), CHAT_TEMPLATE, cores=cores),
                "caption en\n", args.image_size or SIGLIP_BASE.image_size)
    import torch

    setup = EngineSetup("cuda", args.model or GPU_MODEL, None, gpus=torch.cuda.device_count(),
                        max_model_len=4096)
    return setup, "Describe this image in one sentence.", args.image_size or 448


def report(plan: Plan, todo: list[Workload], by_key: dict[str, list[dict[str, Any]]],
           args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    if args.quick:
        print("!! --quick: a run too small to measure anything; it checks the benchmark runs")
    workloads_out = []
    for workload in todo:
        rows = with_ratios(by_key.get(workload.key, []))
        print_table(f"{workload.title} (ms; ratios to the same run's other modes)", rows)
        workloads_out.append({**workload.describe(), "modes": rows})
    return {"command": " ".join(sys.argv[1:]) or "(every workload and mode)",
            "quick": args.quick, "seed": plan.seed, "device": args.device,
            "reuse": plan.reuse, "workloads": workloads_out, "seconds": seconds}


def reference_run(args: argparse.Namespace) -> bool:
    """A full run of every mode and workload on the CPU as `make bench-serve`
    runs it: the one whose figures docs/performance.md shows."""
    return (not args.quick and args.device == "cpu" and args.modes == ",".join(MODES)
            and args.workloads == WORKLOADS and args.rates == RATES)


def write(results: dict[str, Any], out_dir: Path, args: argparse.Namespace) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results["folder"] = str(out_dir)
    for workload in results["workloads"]:
        name = workload["key"].replace("@", "-")
        (out_dir / f"{name}.json").write_text(json.dumps(workload, indent=2))
    (out_dir / "summary.json").write_text(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    paths = figures(results, out_dir)
    epd = figure(results, out_dir)
    paths += [epd] if epd else []
    if reference_run(args):
        for path in paths:
            shutil.copy(path, ROOT / "docs" / path.name)
        print(f"figures copied to docs/: {', '.join(p.name for p in paths)}")
    print(f"written to {out_dir} in {results['seconds']:.0f}s")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="check that it runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default="", help=f"cuda only (default {GPU_MODEL})")
    parser.add_argument("--modes", default="", help="comma-separated (default: "
                        f"{','.join(MODES)} on cpu, {','.join(GPU_MODES)} on cuda)")
    parser.add_argument("--workloads", default=WORKLOADS,
                        help=f"a subset of {WORKLOADS}, or e-meta: (e)'s metadata-only part alone")
    parser.add_argument("--rates", default=RATES, help="workload (a)'s rates, req/s")
    parser.add_argument("--image-size", type=int, default=0, help="pixels (default: the "
                        "model's: 224 for the tiny PaliGemma, 448 on cuda)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--keep", action="store_true",
                        help="keep the engines' and daemons' logs (a temporary folder)")
    args = parser.parse_args()
    args.modes = args.modes or ",".join(GPU_MODES if args.device == "cuda" else MODES)
    unknown = set(args.modes.split(",")) - set(GPU_MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(GPU_MODES)}")
    if "cpu" in args.modes.split(",") and args.device != "cuda":
        parser.error(CPU_ONLY_REFUSAL)
    if args.model and args.device != "cuda":
        parser.error("--model is for --device cuda; on cpu the tiny PaliGemma is built here")
    return args


if __name__ == "__main__":
    main()
