"""What the E/PD tests do to real `vllm serve` engines from outside: chat
requests, encoder forwards read from an engine's log, a SIGKILL."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.serve_hosts import Engine
from tests.vllm.engine_proc import _remove_unmapped, _shm_mapped_by_group

COUNT_WAIT_S = 30.0  # vLLM logs a step's encoder inputs after it answers


def chat(url: str, model: str, image: Path | None, timeout: float = 600) -> tuple[int, str]:
    """One greedy chat request of 8 tokens showing `image` (none: text
    only): (status, text, or the error body)."""
    content: list[dict[str, object]] = [{"type": "text", "text": "caption en\n"}]
    if image is not None:
        data = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": data}})
    body = {"model": model, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def wait_forwards(engine: Engine, at_least: int) -> int:
    """The engine's encoder forwards, once at least `at_least` (bounded)."""
    deadline = time.monotonic() + COUNT_WAIT_S
    while engine.encoder_forwards() < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return engine.encoder_forwards()


def sigkill_engine(engine: Engine) -> None:
    """SIGKILL the engine's process group (by its pid) and remove the shared
    memory vLLM's processes mapped (their resource tracker died with them)."""
    assert engine.proc is not None
    theirs = _shm_mapped_by_group(engine.proc.pid)
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait(60)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(engine.proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    _remove_unmapped(theirs)
    engine.proc = None
