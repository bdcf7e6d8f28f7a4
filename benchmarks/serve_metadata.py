"""Workload (e), metadata-only: E/PD through vLLM's own proxy, in its rewrite
mode against `--no-rewrite`, and one engine without a connector
(benchmarks/serve.py runs it with `--workloads e`).

The model is the tests' tiny Qwen2-VL (tests/vllm/tiny_qwen2vl.py): it
declares placeholder metadata, so vLLM's proxy (benchmarks.vllm_proxy, from
the installed vLLM's source release) can send the PD instance each image as
`image_embeds` carrying its grid and nothing else. The clients send images
of `IMAGE_SIZE` pixels, as photos come, which the model's processor shrinks
to 112 x 112: what PD no longer uploads, decodes and resizes is what rewrite
mode saves it. Modes, each with engines of its own:

- "none": one engine without a connector (core 0), the requests sent to it;
- "no-rewrite": an encoder instance (`ec_producer`, core 0, vLLM's encoder
  flags) and a PD instance (`ec_consumer`, core 1) on one ec-daemon, behind
  vLLM's proxy with `--no-rewrite`: PD gets every image with its media and
  loads its embedding from the cache;
- "rewrite": the same behind the proxy in rewrite mode: PD gets no media.

Per mode: the client's TTFT (through the proxy, the encoder instance's step
included); PD's time to its first byte per request as the proxy logged it
(`pd_ttfb_mean_ms`, `pd_ttfb_p50_ms`: PD's whole share of the TTFT: upload,
preprocessing, the load, prefill); the media bytes PD received; PD's encoder
forwards and the images it received without media (its `vllm:ec_daemon_
metadata_only_items_total`); and `pd_preprocess_ms_per_request`: what
decoding and preprocessing the request's image costs PD where it gets the
media (the base64 and PNG decoding and the model's own HF processor, timed
in this process on the stream's images, median of `PREPROCESS_REPEATS`:
vLLM exposes no such figure of a running server).
"""

from __future__ import annotations

import base64
import json
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.serve_hosts import Daemon, Engine, EngineSetup, start_engines
from benchmarks.serve_modes import totals
from benchmarks.serve_report import summarise
from benchmarks.serve_stream import Client, Request
from benchmarks.vllm_proxy import ENCODER_FLAGS, VLLMProxy, stage_means

MODES = ("none", "no-rewrite", "rewrite")
IMAGE_SIZE = 448
PROMPT = "caption en\n"
# vLLM hands a connector's stats to /metrics during its steps only (ours once
# a second): a text-only request this long after the last one flushes them.
SETTLE_S = 1.5
PREPROCESS_REPEATS = 5


class MetadataRun:
    """Context manager: a mode's engines (and daemon and proxy), each warmed
    up with a request of its own image; all stopped by pid on exit, the
    daemon's region freed."""

    def __init__(self, mode: str, setup: EngineSetup, client: Client, folder: Path,
                 warm_image: Path) -> None:
        folder.mkdir(parents=True)
        self.mode = mode
        self.setup = setup
        self.client = client
        self.folder = folder
        self.warm_image = warm_image
        self.daemon = Daemon(folder / "host", cpu_bytes="256MiB") if mode != "none" else None
        self.proxy: VLLMProxy | None = None
        if self.daemon is None:
            self.engines = [Engine(0, setup, [], {}, folder / "engine.log")]
        else:
            self.engines = [
                Engine(0, setup, ec_args("ec_producer", self.daemon.uri) + ENCODER_FLAGS, {},
                       folder / "encoder.log"),
                Engine(1, setup, ec_args("ec_consumer", self.daemon.uri), {},
                       folder / "pd.log")]

    @property
    def pd(self) -> Engine:
        return self.engines[-1]

    @property
    def url(self) -> str:
        return self.proxy.url if self.proxy else self.pd.url

    def __enter__(self) -> MetadataRun:
        try:
            if self.daemon:
                self.daemon.start(fresh=True)
            start_engines(self.engines, self.setup)
            if self.daemon:
                self.proxy = VLLMProxy(self.engines[0].url, self.pd.url,
                                       self.folder / "proxy.log",
                                       no_rewrite=self.mode == "no-rewrite").start()
            warm = self.client.send([Request(0, self.warm_image, 0, 0, 0.0, "cold")], [self.url])
            if not warm[0].ok:
                raise RuntimeError(f"{self.mode}: the warm-up failed: {warm[0].error[-2000:]}")
            self._settle()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proxy:
            self.proxy.stop()
        for engine in self.engines:
            engine.stop()
        if self.daemon:
            self.daemon.stop()
            self.daemon.clean()

    def _settle(self) -> None:
        """PD's counters all on its /metrics (see SETTLE_S)."""
        time.sleep(SETTLE_S)
        body = {"model": self.setup.model, "max_tokens": 1,
                "messages": [{"role": "user", "content": PROMPT}]}
        request = urllib.request.Request(f"{self.pd.url}/v1/chat/completions",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300):
            pass

    def snapshot(self) -> dict[tuple[str, str], float]:
        out = {("pd", "pd_encoder_forwards"): float(self.pd.encoder_forwards()),
               ("pd", "pd_metadata_only_items"): self.pd.connector_counters().get(
                   "metadata_only_items", 0.0)}
        if self.daemon:
            out[("e", "encoder_instance_forwards")] = float(self.engines[0].encoder_forwards())
            stats = self.daemon.stats()
            for name in ("hits", "misses", "saves", "loads"):
                out[("daemon", f"daemon_{name}")] = float(stats[name])
        return out

    def run(self, stream: list[Request]) -> dict[str, Any]:
        """Send `stream`; the mode's row."""
        stages_before = len(self.proxy.stages()) if self.proxy else 0
        rewritten_before = self._rewritten()
        before = self.snapshot()
        outcomes = self.client.send(stream, [self.url])
        self._settle()
        counters = totals(before, self.snapshot())
        forwards = counters["pd_encoder_forwards"] + counters.get("encoder_instance_forwards", 0)
        row = summarise(self.mode, outcomes, {**counters, "encoder_forwards": forwards})
        row["topology"] = "one engine" if self.daemon is None else "E/PD, vLLM's proxy"
        rewritten = self._rewritten() - rewritten_before
        media = statistics.fmean(len(base64.b64encode(r.image.read_bytes())) for r in stream)
        row["pd_media_kib_per_request"] = media * (len(stream) - rewritten) / len(stream) / 1024
        row["pd_preprocess_ms_per_request"] = preprocess_ms(
            self.setup.model, [r.image for r in stream]) * (len(stream) - rewritten) / len(stream)
        if self.proxy:
            means = stage_means(self.proxy.stages()[stages_before:])
            row["pd_ttfb_mean_ms"] = means.get("decode_ttfb")
            row["pd_ttfb_p50_ms"] = means.get("decode_ttfb_p50")
            row["encode_stage_mean_ms"] = means.get("encode")
            row["encode_stage_p50_ms"] = means.get("encode_p50")
            row["retried"] = means["retried"]
        return row

    def _rewritten(self) -> int:
        return self.proxy.count("as metadata references") if self.proxy else 0


def preprocess_ms(model: str, images: list[Path]) -> float:
    """What turning one of `images`, as a client sends it (a base64 PNG in a
    data URL), into the model's inputs costs: the decoding and the model's
    HF processor, as a server does (ms, median over the images' repeats)."""
    import io

    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    text = ["<|vision_start|><|image_pad|><|vision_end|>" + PROMPT]
    times = []
    for path in sorted(set(images)) * PREPROCESS_REPEATS:
        encoded = base64.b64encode(path.read_bytes())
        started = time.perf_counter()
        image = Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB")
        processor(images=[image], text=text, return_tensors="pt")
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def ec_args(role: str, socket: str) -> list[str]:
    """ec-daemon's connector on an engine of workload (e), metadata-only."""
    config = {"ec_connector": "ECDaemonConnector",
              "ec_connector_module_path": "ec_client.vllm_connector", "ec_role": role,
              "ec_connector_extra_config": {"ec_daemon_socket": socket,
                                            "ec_daemon_copy_backend": "cpu"}}
    return ["--ec-transfer-config", json.dumps(config)]
