"""What a staged load costs a hit on a real engine (docs/performance.md, 1c).

    PYTHONPATH=$PWD:<torchvision> python -m benchmarks.staged_hit \
        --before /path/to/a/worktree/of/the/old/code [--hits 10] [--quick]

One daemon (this tree's), the tiny PaliGemma of the vLLM tests, and three
real vLLM engines on CPU, started at once and kept running: "before", whose
connector is imported from `--before` (a checkout where a hit is loaded in
the step that uses it), "after", whose connector is this tree's (a hit is
staged a step ahead: its request is deferred one step, and on vLLM's V1
model runner an idle engine's scheduler stages it and the next step carries
the bytes), and "none", without a connector. Each connector engine first
serves its own set of images cold (misses: encoded and saved); then each
asks for the images the other one saved, one request at a time,
`max_tokens=1`, the engines taking turns: every one of those is a hit that
only the daemon can serve (the engine never saw the image, so vLLM's own
encoder cache cannot). "none" encodes the same images. Per request the
child reports its latency (`LLM.generate` with one output token: the time to
its first token), the images its vision tower ran on and the engine steps
its worker ran (all, and those that scheduled tokens).

Why one process tree and engines taking turns: the machine is shared and
noisy; alternating the three engines request by request gives each the same
load, which separate runs would not. The two trees share the daemon: the
wire change between them is additive (a field the old client never sends),
and a hit asks the daemon nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
ENGINE_TIMEOUT = 600.0  # three engines starting at once on two busy cores
REQUEST_TIMEOUT = 120.0
SAVE_TIMEOUT = 60.0
# What an engine's scheduler logs once it answers hits (tests/vllm/engine_proc.py).
SERVING_LINE = "worker ranks mapped the region; hits are answered"
# Image seeds: each engine's cold set, and "none"'s warm-up image.
COLD_SEEDS = {"before": 1000, "after": 2000}
WARMUP_SEED = 3000


# --- the engine process (its own tree's ec_client on its PYTHONPATH) ----------

def _install_step_counter(worker: Any) -> str:
    """Count the steps this worker runs (all, and those with tokens)."""
    counter = {"steps": 0, "token_steps": 0}
    execute = worker.execute_model

    def counting(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        counter["steps"] += 1
        if getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            counter["token_steps"] += 1
        return execute(scheduler_output, *args, **kwargs)

    worker.execute_model = counting
    worker._step_counter = counter
    return "installed"


def _read_step_counter(worker: Any) -> dict[str, int]:
    return dict(worker._step_counter)


def engine_main(model: str, socket: str) -> int:
    """Serve `REQ <seed>` lines from stdin, one `DONE {json}` line each."""
    if sys.path and Path(sys.path[0]).resolve() == HERE.parent:
        sys.path.pop(0)  # run as a script: this folder's modules are not top-level ones
    # Before vLLM: importing it sets vLLM's CPU environment defaults.
    from tests.vllm.run_tiny_engine import (  # noqa: I001
        PROMPT,
        _install_encoder_counter,
        _read_encoder_counter,
        make_image,
    )
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if socket:
        extra["ec_transfer_config"] = {
            "ec_connector": "ECDaemonConnector",
            "ec_connector_module_path": "ec_client.vllm_connector", "ec_role": "ec_both",
            "ec_connector_extra_config": {"ec_daemon_socket": socket,
                                          "ec_daemon_copy_backend": "cpu"}}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=128, max_num_seqs=4, limit_mm_per_prompt={"image": 1}, seed=0,
              **extra)
    llm.collective_rpc(_install_encoder_counter)
    llm.collective_rpc(_install_step_counter)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def counters() -> tuple[int, int, int]:
        enc = sum(c["images"] for c in llm.collective_rpc(_read_encoder_counter))
        (steps,) = llm.collective_rpc(_read_step_counter)
        return enc, steps["steps"], steps["token_steps"]

    import ec_client
    print("READY " + json.dumps({"ec_client": ec_client.__file__}), flush=True)
    for line in sys.stdin:
        if not line.startswith("REQ "):
            break
        seed = int(line.split()[1])
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(seed)}}
        enc0, steps0, token_steps0 = counters()
        started = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        enc, steps, token_steps = counters()
        print("DONE " + json.dumps({
            "seed": seed, "seconds": seconds, "encoded": enc - enc0, "steps": steps - steps0,
            "token_steps": token_steps - token_steps0,
            "tokens": len(out.outputs[0].token_ids)}), flush=True)
    return 0


# --- the benchmark (this tree) --------------------------------------------------

def _start(name: str, tree: Path, model: Path, socket: str, folder: Path) -> Any:
    from tests.vllm.engine_proc import Engine

    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    # Our tree's own entry is replaced by the engine's tree (the rest: torchvision etc.).
    path = os.pathsep.join(p for p in path.split(os.pathsep)
                           if p and (Path(p).resolve() != ROOT or tree.resolve() == ROOT))
    env = {**os.environ, "PYTHONPATH": path}
    args = [sys.executable, str(HERE), "--engine", str(model), "--socket", socket]
    proc = subprocess.Popen(args, cwd=folder, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    engine = Engine(proc)
    engine.name = name  # type: ignore[attr-defined]
    return engine


def _ask(engine: Any, seed: int) -> dict[str, Any]:
    """One request, its answer. Only the lines since the last answer are read,
    every millisecond: the engines' own logs are long, and this process shares
    the cores with them."""
    cursor = getattr(engine, "cursor", 0)
    engine.send(f"REQ {seed}\n")
    deadline = time.monotonic() + REQUEST_TIMEOUT
    while time.monotonic() < deadline:
        lines = engine.lines[cursor:]
        for offset, line in enumerate(lines):
            if line.startswith("DONE "):
                engine.cursor = cursor + offset + 1
                result: dict[str, Any] = json.loads(line[len("DONE "):])
                return result
        cursor += len(lines)
        if engine.proc.poll() is not None:
            break
        time.sleep(0.001)
    raise RuntimeError(f"engine {engine.name} gave no answer:\n{engine.output[-4000:]}")


def _summary(results: list[dict[str, Any]]) -> dict[str, float]:
    seconds = [r["seconds"] * 1000 for r in results]
    return {"median": statistics.median(seconds), "min": min(seconds),
            "p25": statistics.quantiles(seconds, n=4)[0] if len(seconds) > 1 else seconds[0],
            "steps": statistics.median(r["steps"] for r in results),
            "token_steps": statistics.median(r["token_steps"] for r in results),
            "encoded": sum(r["encoded"] for r in results)}


def run(before: Path, hits: int, samples: dict[str, Any] | None = None
        ) -> list[dict[str, Any]]:
    """The table's rows; `samples` gets every request's result. The model
    and the engines' working folder are removed after."""
    with tempfile.TemporaryDirectory(prefix="staged-hit-") as name:
        return _run(Path(name), before, hits, samples)


def _run(folder: Path, before: Path, hits: int, samples: dict[str, Any] | None
         ) -> list[dict[str, Any]]:
    from tests.integration.daemon import Daemon
    from tests.vllm.tiny_model import build_tiny_paligemma

    model = build_tiny_paligemma(folder / "model")
    trees = {"before": before, "after": ROOT, "none": ROOT}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {"miss": [], "hit": []} for name in trees}
    with Daemon(cpu_bytes="128MiB") as daemon:
        engines = {name: _start(name, tree, model, daemon.socket if name != "none" else "",
                                folder) for name, tree in trees.items()}
        try:
            for name, engine in engines.items():
                engine.wait_for_line("READY", ENGINE_TIMEOUT)
                if name != "none":
                    engine.wait_for_line(SERVING_LINE, ENGINE_TIMEOUT, anywhere=True)
                ready = next(line for line in engine.lines if line.startswith("READY "))
                print(f"{name}: {ready.strip()}", flush=True)
            _ask(engines["none"], WARMUP_SEED)
            # Cold: each connector engine encodes and saves its own set (one more
            # than is timed: the first request of an engine pays for warming it up).
            for i in range(hits + 1):
                for name in ("before", "after"):
                    result = _ask(engines[name], COLD_SEEDS[name] + i)
                    if i:
                        results[name]["miss"].append(result)
            daemon.wait_for(lambda: daemon.stats()["saves"] >= 2 * (hits + 1),
                            timeout=SAVE_TIMEOUT, what="the cold requests' saves")
            time.sleep(1.0)  # the ready events reach both engines' views
            # Hits: each asks for the images the other one saved; "none" encodes them.
            for i in range(1, hits + 1):
                for name, seed in (("before", COLD_SEEDS["after"] + i),
                                   ("after", COLD_SEEDS["before"] + i),
                                   ("none", COLD_SEEDS["before"] + i)):
                    results[name]["hit"].append(_ask(engines[name], seed))
            print(f"daemon: {json.dumps(daemon.stats())}", flush=True)
        finally:
            for engine in engines.values():
                if engine.proc.poll() is None:
                    engine.send("QUIT\n")
            for engine in engines.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    engine.proc.wait(timeout=30)
                engine.stop()
    if samples is not None:
        samples.update(results)
    rows = []
    for kind, label in (("miss", "miss (encoded, saved)"), ("hit", "hit (saved by the other)")):
        b, a = _summary(results["before"][kind]), _summary(results["after"][kind])
        n = _summary(results["none"][kind]) if results["none"][kind] else None
        rows.append({
            "request": label, "n": len(results["after"][kind]),
            "before ms": b["median"], "after ms": a["median"],
            "after/before": a["median"] / b["median"],
            "before p25": b["p25"], "after p25": a["p25"],
            "before min": b["min"], "after min": a["min"],
            "no connector ms": n["median"] if n else None,
            "steps b/a": f"{b['steps']:g}/{a['steps']:g}",
            "token steps b/a": f"{b['token_steps']:g}/{a['token_steps']:g}",
            "encoded b/a/none": f"{b['encoded']:g}/{a['encoded']:g}/"
                                + (f"{n['encoded']:g}" if n else "-")})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="the old code's checkout (its ec_client)")
    parser.add_argument("--hits", type=int, default=10, help="timed hits per engine")
    parser.add_argument("--quick", action="store_true", help="3 hits: check that it runs")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # the engine process: its model
    parser.add_argument("--socket", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return engine_main(args.engine, args.socket)
    if args.before is None:
        parser.error("--before is required")
    from benchmarks.tables import table

    samples: dict[str, Any] = {}
    rows = run(args.before, 3 if args.quick else args.hits, samples)
    print(table("staged loads: a request's latency with max_tokens=1 (its first token), "
                "before and after", rows, list(rows[0])))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "requests": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
