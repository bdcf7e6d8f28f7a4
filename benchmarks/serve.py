"""`make bench-serve`: what ec-daemon buys engines serving images, measured
with vLLM's own client (`vllm bench serve`) against real `vllm serve` engines.

Workload (a): two engines on this host, each pinned to its own core, behind
a round-robin split of one request stream in which 80% of the requests show
an image seen before (Dynamo's setup, scaled down). The model is the tests'
tiny PaliGemma (built offline) with a SigLIP-base-sized vision tower, so an
encode costs what it costs beside a small LM; prefix caching is on, as
deployed. Modes, in the same run and on the same requests: no EC connector,
vLLM's `ECExampleConnector` on one shared folder (the only upstream
connector engines of a host can share), and ec-daemon.

Per mode: TTFT mean/p50/p90/p99 and request throughput from `vllm bench
serve`'s results, each as a ratio to "no connector" and to the example
connector. Prints a table and writes results/serve-<time>.json. `--quick`
shrinks the run to check that it works; its numbers are not results.

Run in the vLLM environment (`make bench-serve` does).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "benchmarks.vllm_cli"]
# PaliGemma has no chat template; the image tokens come from its processor.
CHAT_TEMPLATE = ("{% for message in messages %}{% if message['content'] is string %}"
                 "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
                 "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
                 "{% endif %}{% endfor %}")
PROMPT = "caption en\n"
OUTPUT_TOKENS = 8
ENGINE_START_S = 600.0
MODES = ("none", "example", "ec-daemon")


class Plan:
    """How much one run does (`--quick` shrinks it)."""

    def __init__(self, quick: bool, seed: int) -> None:
        self.seed = seed
        self.requests = 8 if quick else 40  # the whole stream, both engines
        self.images = 3 if quick else 8  # distinct images: 80% of requests repeat one
        self.rate = 1.0  # requests/s of the whole stream
        self.reuse = 0.8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_images(folder: Path, count: int, size: int, seed: int) -> list[Path]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = folder / f"image-{i}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def make_stream(plan: Plan, images: list[Path], folder: Path) -> list[Path]:
    """One stream of requests, 80% of them an image seen before, split
    round-robin into one JSONL per engine (vLLM's custom_image dataset)."""
    rng = random.Random(plan.seed)
    seen: list[Path] = []
    fresh = list(images)
    lines: list[list[str]] = [[], []]
    for i in range(plan.requests):
        if seen and (not fresh or rng.random() < plan.reuse):
            image = rng.choice(seen)
        else:
            image = fresh.pop(0)
            seen.append(image)
        lines[i % 2].append(json.dumps({"prompt": PROMPT, "image_files": [str(image)]}))
    paths = []
    for engine, engine_lines in enumerate(lines):
        path = folder / f"engine-{engine}.jsonl"
        path.write_text("\n".join(engine_lines) + "\n")
        paths.append(path)
    return paths


def ec_config(mode: str, socket_uri: str, shared: Path) -> list[str]:
    if mode == "none":
        return []
    if mode == "example":
        config = {"ec_connector": "ECExampleConnector", "ec_role": "ec_both",
                  "ec_connector_extra_config": {"shared_storage_path": str(shared)}}
    else:
        config = {"ec_connector": "ECDaemonConnector",
                  "ec_connector_module_path": "ec_client.vllm_connector", "ec_role": "ec_both",
                  "ec_connector_extra_config": {"ec_daemon_socket": socket_uri,
                                                "ec_daemon_copy_backend": "cpu"}}
    return ["--ec-transfer-config", json.dumps(config)]


def daemon_counters(uri: str) -> dict[str, int]:
    """The daemon's lookups, hits and saves (`ec-daemon stats --json`)."""
    out = subprocess.run([sys.executable, "-m", "ec_daemon", "stats", "--json", "--socket", uri],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    data = json.loads(out)
    return {"hits": int(data["hits"]), "misses": int(data["misses"]),
            "saves": int(data["saves"])}


@contextmanager
def daemon(folder: Path) -> Iterator[str]:
    """An ec-daemon on a socket in `folder`; yields its URI."""
    uri = f"unix://{folder / 'ec.sock'}"
    with open(folder / "daemon.log", "w") as log:  # (the child keeps its own descriptor)
        proc = subprocess.Popen([sys.executable, "-m", "ec_daemon", "--cpu-bytes", "1GiB",
                                 "--socket", uri, "--fresh-start", "--on-exit", "remove"],
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not (folder / "ec.sock").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ec-daemon did not start:\n"
                                   + (folder / "daemon.log").read_text())
            time.sleep(0.1)
        yield uri
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@contextmanager
def engines(model: Path, mode: str, socket_uri: str, folder: Path) -> Iterator[list[int]]:
    """Two `vllm serve` engines, engine i pinned to core i; yields their ports."""
    shared = folder / "ec-shared"
    shared.mkdir(exist_ok=True)
    cores = os.sched_getaffinity(0)
    procs, ports = [], []
    try:
        for i in range(2):
            port = free_port()
            core = sorted(cores)[i % len(cores)]
            env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=str(core),
                       VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
            with open(folder / f"{mode}-engine-{i}.log", "w") as log:
                procs.append(subprocess.Popen(
                    ["taskset", "-c", str(core), *CLI, "serve", str(model), "--port", str(port),
                     "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512",
                     "--max-num-seqs", "8", "--limit-mm-per-prompt", '{"image": 1}',
                     "--enable-prefix-caching", "--chat-template", CHAT_TEMPLATE, "--seed", "0",
                     "--disable-log-stats", *ec_config(mode, socket_uri, shared)],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
            ports.append(port)
        for i, (proc, port) in enumerate(zip(procs, ports, strict=True)):
            wait_healthy(proc, port, folder / f"{mode}-engine-{i}.log")
        yield ports
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def wait_healthy(proc: subprocess.Popen[Any], port: int, log: Path) -> None:
    print(f"   waiting for the engine on port {port} to serve (a minute or two)", flush=True)
    deadline = time.monotonic() + ENGINE_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n"
                               + log.read_text()[-4000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"vllm serve on port {port} not healthy after {ENGINE_START_S:.0f}s")


def bench(model: Path, ports: list[int], streams: list[Path], plan: Plan, folder: Path,
          mode: str) -> list[dict[str, Any]]:
    """`vllm bench serve` against each engine at once, half the rate each."""
    procs = []
    for i, (port, stream) in enumerate(zip(ports, streams, strict=True)):
        result = f"{mode}-engine-{i}.json"
        count = sum(1 for line in stream.read_text().splitlines() if line)
        with open(folder / f"{mode}-bench-{i}.log", "w") as log:
            procs.append(subprocess.Popen(
                [*CLI, "bench", "serve", "--backend", "openai-chat", "--endpoint",
                 "/v1/chat/completions", "--base-url", f"http://127.0.0.1:{port}", "--model",
                 str(model), "--dataset-name", "custom_image", "--dataset-path", str(stream),
                 "--disable-shuffle", "--custom-ensure-client-side-data", "--num-prompts",
                 str(count), "--custom-output-len", str(OUTPUT_TOKENS), "--request-rate",
                 str(plan.rate / 2), "--seed", str(plan.seed), "--save-result", "--save-detailed",
                 "--result-dir", str(folder), "--result-filename", result,
                 "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
                 "--ignore-eos"],
                cwd=ROOT, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"), stdout=log,
                stderr=subprocess.STDOUT))
    results = []
    for i, proc in enumerate(procs):
        if proc.wait(1800) != 0:
            raise RuntimeError("vllm bench serve failed:\n"
                               + (folder / f"{mode}-bench-{i}.log").read_text()[-4000:])
        results.append(json.loads((folder / f"{mode}-engine-{i}.json").read_text()))
    return results


def summarise(mode: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Both engines' requests as one stream: TTFT over all of them, and what
    each request generated (greedy: every mode must generate the same)."""
    ttfts = sorted(t * 1000 for r in results for t in r.get("ttfts", []) if t)
    if not ttfts:
        errors = [e for r in results for e in r.get("errors", []) if e]
        raise RuntimeError(f"{mode}: no request completed; first errors: {errors[:3]}")
    duration = max(r["duration"] for r in results)
    completed = sum(r["completed"] for r in results)

    def percentile(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, round(p / 100 * (len(ttfts) - 1)))]

    return {"mode": mode, "requests": completed,
            "failed": sum(r.get("failed", 0) for r in results),
            "outputs": [r.get("generated_texts", []) for r in results],
            "ttft_mean_ms": sum(ttfts) / len(ttfts), "ttft_p50_ms": percentile(50),
            "ttft_p90_ms": percentile(90), "ttft_p99_ms": percentile(99),
            "requests_per_s": completed / duration}


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = {r["mode"]: r for r in rows}
    for row in rows:
        if "none" in base:
            row["same_outputs_as_none"] = row["outputs"] == base["none"]["outputs"]
        for ref in ("none", "example"):
            if ref in base and ref != row["mode"]:
                for field in ("ttft_mean_ms", "ttft_p90_ms", "requests_per_s"):
                    row[f"{field}_vs_{ref}"] = row[field] / base[ref][field]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="check that it runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    plan = Plan(args.quick, args.seed)
    sys.path.insert(0, str(ROOT))
    from tests.vllm.tiny_model import SIGLIP_BASE, build_tiny_paligemma

    folder = Path(tempfile.mkdtemp(prefix="ecd-serve-"))
    started = time.monotonic()
    done = False
    try:
        print(">> building the tiny PaliGemma with a SigLIP-base-sized vision tower", flush=True)
        model = build_tiny_paligemma(folder / "model", shape=SIGLIP_BASE)
        images = make_images(folder, plan.images, SIGLIP_BASE.image_size, plan.seed)
        streams = make_stream(plan, images, folder)
        rows = []
        for mode in args.modes.split(","):
            print(f">> mode {mode}: two engines, {plan.requests} requests at {plan.rate} req/s",
                  flush=True)
            run = folder / mode
            run.mkdir()
            with daemon(run) as uri, engines(model, mode, uri, run) as ports:
                row = summarise(mode, bench(model, ports, streams, plan, run, mode))
                if mode == "ec-daemon":
                    row.update({f"daemon_{k}": v for k, v in daemon_counters(uri).items()})
                rows.append(row)
        rows = with_ratios(rows)
        done = True
    finally:
        if done:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"!! logs kept in {folder}", flush=True)
    columns = ["mode", "requests", "failed", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms",
               "ttft_p99_ms", "requests_per_s", "ttft_mean_ms_vs_none", "ttft_p90_ms_vs_none",
               "ttft_mean_ms_vs_example", "ttft_p90_ms_vs_example", "requests_per_s_vs_none",
               "same_outputs_as_none", "daemon_hits", "daemon_misses", "daemon_saves"]
    if args.quick:
        print("!! --quick: a run too small to measure anything; it checks the benchmark runs")
    print("(a) two engines, 80% image reuse (ms; ratios to the same run's other modes)")
    print("  ".join(columns))
    for row in rows:
        print("  ".join(f"{row.get(c, '-'):.3g}" if isinstance(row.get(c), float)
                        else str(row.get(c, "-")) for c in columns))
    out = {"quick": args.quick, "seed": plan.seed, "requests": plan.requests,
           "images": plan.images, "rate": plan.rate, "reuse": plan.reuse, "workload_a": rows,
           "seconds": time.monotonic() - started}
    path = ROOT / "results" / f"serve-{'quick-' if args.quick else ''}" \
        f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"written to {path} in {out['seconds']:.0f}s")


if __name__ == "__main__":
    main()
