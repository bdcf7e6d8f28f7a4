"""The request streams of `make bench-serve` (benchmarks/serve.py) and their
sending.

A stream is a list of requests, each showing one image: which engine it goes
to, in which phase (0 before a workload's event, a restart or a move; 1
after it), when it is sent (seconds after its phase starts; Poisson arrivals
at the stream's rate, seeded), and its kind, read from the stream itself:

- "cold": the first request for its image on the host (any engine of it);
- "moved": the first on its host, but another host showed the image before
  (workload (d) only: what a second tier can serve);
- "repeat": its host showed the image before.

Requests are sent by vLLM's own benchmark client: the custom_image dataset
turns the stream into requests (the image sent by the client, as
`vllm bench serve --dataset-name custom_image --custom-ensure-client-side-data`
does) and the openai-chat request function sends each one and times it.
They are scheduled here rather than by `vllm bench serve` because one stream
spans both engines, a restart and a move, and each `vllm bench serve` start
costs some 20 s of imports on a small machine.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROUND_ROBIN = "round-robin"  # request i goes to engine i % 2
MOVE = "move"  # the first half to engine 0, the second half to engine 1
ONE = "one"  # every request to engine 0 (workload (e): one URL, a proxy's or an engine's)
OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class Request:
    index: int
    image: Path
    engine: int
    phase: int
    send_s: float  # after its phase starts
    kind: str  # "cold", "moved" or "repeat"


@dataclass(frozen=True)
class Outcome:
    """What happened to one request; `sent` is time.monotonic() just before
    vLLM's client sent it."""

    request: Request
    ok: bool
    ttft_ms: float
    latency_ms: float
    sent: float
    text: str
    error: str

    def row(self, zero: float | None) -> dict[str, Any]:
        """As JSON; `t_s` is the send time after `zero` (None: no `t_s`)."""
        r = self.request
        row: dict[str, Any] = {"index": r.index, "image": r.image.name, "engine": r.engine,
                               "phase": r.phase, "kind": r.kind, "ok": self.ok,
                               "ttft_ms": self.ttft_ms, "latency_ms": self.latency_ms,
                               "text": self.text}
        if zero is not None:
            row["t_s"] = self.sent - zero
        if self.error:
            row["error"] = self.error[-500:]
        return row


def make_images(folder: Path, count: int, size: int, seed: int, prefix: str) -> list[Path]:
    """`count` random images of `size` x `size` pixels, none like another."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = folder / f"{prefix}-{i}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def make_stream(images: list[Path], count: int, rate: float, reuse: float, seed: int,
                route: str = ROUND_ROBIN, phases: int = 1) -> list[Request]:
    """`count` requests at `rate` requests/s: each shows an image seen before
    with probability `reuse` (a new one otherwise, while there are new
    ones). With `phases` 2, the second half is phase 1 and its times count
    from the phase's start. Under MOVE, each engine is a host of its own."""
    rng = random.Random(seed)
    seen: list[Path] = []
    fresh = list(images)
    shown: dict[Path, set[int]] = {}
    half = count // 2
    clock = 0.0
    requests = []
    for i in range(count):
        if seen and (not fresh or rng.random() < reuse):
            image = rng.choice(seen)
        else:
            image = fresh.pop(0)
            seen.append(image)
        engine = (i % 2) if route == ROUND_ROBIN else 0 if route == ONE else int(i >= half)
        host = engine if route == MOVE else 0
        phase = int(phases == 2 and i >= half)
        if i == half and phase:
            clock = 0.0
        elif i:
            clock += rng.expovariate(rate)
        hosts = shown.setdefault(image, set())
        kind = "repeat" if host in hosts else "moved" if hosts else "cold"
        hosts.add(host)
        requests.append(Request(i, image, engine, phase, clock, kind))
    return requests


class Client:
    """vLLM's benchmark client for one model: builds each request with the
    custom_image dataset and sends it with the openai-chat request function
    (greedy, `OUTPUT_TOKENS` tokens, EOS ignored)."""

    def __init__(self, model: str, prompt: str, folder: Path) -> None:
        # Imported here: vLLM's benchmark modules take some 15 s to import.
        from vllm.benchmarks.datasets import CustomImageDataset
        from vllm.benchmarks.lib.endpoint_request_func import (
            ASYNC_REQUEST_FUNCS,
            RequestFuncInput,
        )

        self._dataset_class = CustomImageDataset
        self._input_class = RequestFuncInput
        self._send = ASYNC_REQUEST_FUNCS["openai-chat"]
        self.model = model
        self.prompt = prompt
        self.folder = folder

    def _samples(self, requests: list[Request]) -> list[Any]:
        path = self.folder / f"stream-{time.monotonic_ns()}.jsonl"
        path.write_text("".join(json.dumps({"prompt": self.prompt, "image_files": [str(r.image)]})
                                + "\n" for r in requests))
        dataset = self._dataset_class(dataset_path=str(path), disable_shuffle=True)
        return list(dataset.sample(tokenizer=None, num_requests=len(requests),
                                   output_len=OUTPUT_TOKENS, ensure_client_side_data=True))

    def send(self, requests: list[Request], urls: list[str]) -> list[Outcome]:
        """Send `requests` at their times (engine i at urls[i]); returns
        when every one has its answer or its error."""
        return asyncio.run(self._send_all(requests, self._samples(requests), urls))

    async def _send_all(self, requests: list[Request], samples: list[Any],
                        urls: list[str]) -> list[Outcome]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         trust_env=False) as session:
            start = time.monotonic()
            tasks = []
            for request, sample in zip(requests, samples, strict=True):
                delay = start + request.send_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(
                    self._one(request, sample, urls[request.engine], session)))
            return list(await asyncio.gather(*tasks))

    async def _one(self, request: Request, sample: Any, url: str, session: Any) -> Outcome:
        func_input = self._input_class(
            model=self.model, prompt=sample.prompt, api_url=f"{url}/v1/chat/completions",
            prompt_len=sample.prompt_len, output_len=OUTPUT_TOKENS,
            multi_modal_content=sample.multi_modal_data, ignore_eos=True,
            extra_body={"temperature": 0.0}, request_id=f"r{request.index}-{time.time_ns()}")
        sent = time.monotonic()
        out = await self._send(request_func_input=func_input, session=session)
        return Outcome(request=request, ok=bool(out.success), ttft_ms=out.ttft * 1000,
                       latency_ms=out.latency * 1000, sent=sent,
                       text=out.generated_text, error=out.error or "")
