"""vLLM's own E/PD proxy (`disagg_epd_proxy.py` of the engines' vLLM
release, benchmarks.vllm_source) run as a subprocess on loopback, in front
of one encoder instance and one prefill/decode instance: what the tests and
`make bench-serve` (workload (e), metadata-only) put in front of E/PD.

The proxy needs fastapi, uvicorn (with uvloop), aiohttp, msgspec and
pydantic, all of which vLLM itself depends on: it runs with the engines'
Python. It sends each media item to the encoder instance, then PD the
request, either with each item rewritten to metadata (`image_embeds`
carrying what the encoder instance reported in `ec_transfer_params`, and
the proxy's `uuid`: its default, rewrite mode) or unchanged (`no_rewrite`).
A 500 from PD is retried `decode_retries` times, the encode included.

Its log says per request what each stage took ("STAGE rewrite encode=12.3
rewrite=0.1 decode_ttfb=45.6 decode_total=78.9 attempt=0" when the client
streams; `decode=` and `total=` when not): `stages()` reads them.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.serve_hosts import _stop_group, free_port
from benchmarks.vllm_source import epd_proxy

START_S = 120.0
# What vLLM's example gives encoder instances (besides --enforce-eager, which
# every CPU engine here has): no prefix caching, a token budget that never
# limits it (its encoder cache manager sets the real one).
ENCODER_FLAGS = ["--no-enable-prefix-caching", "--max-num-batched-tokens", "16384"]
STAGE = re.compile(r"STAGE (rewrite|no-rewrite) (.*) attempt=(\d+)")
FIELD = re.compile(r"(\w+)=([0-9.]+)")


@dataclass(frozen=True)
class Stage:
    """One request's stage times (ms) as the proxy logged them."""

    mode: str  # "rewrite" or "no-rewrite"
    times: dict[str, float]  # encode, rewrite, decode / decode_ttfb, decode_total, total
    attempt: int  # 0: PD answered the first time; n: after n retries


class VLLMProxy:
    """Context manager: the proxy started and answering, stopped by pid."""

    def __init__(self, encoder_url: str, pd_url: str, log_path: Path, *,
                 no_rewrite: bool = False, decode_retries: int = 1,
                 proxy: Path | None = None) -> None:
        self.script = proxy or epd_proxy()
        self.encoder_url, self.pd_url = encoder_url, pd_url
        self.no_rewrite = no_rewrite
        self.decode_retries = decode_retries
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        argv = [sys.executable, str(self.script), "--host", "127.0.0.1", "--port",
                str(self.port), "--encode-servers-urls", self.encoder_url,
                "--prefill-servers-urls", "disable", "--decode-servers-urls", self.pd_url,
                "--decode-retries", str(self.decode_retries)]
        return [*argv, "--no-rewrite"] if self.no_rewrite else argv

    def start(self) -> VLLMProxy:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's proxy exited ({self.proc.returncode}):\n"
                                   + self.log_tail())
            try:  # (its /health asks both instances: they serve already)
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"vLLM's proxy did not answer in {START_S:.0f}s:\n" + self.log_tail())

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc, 10)
            self.proc = None

    def __enter__(self) -> VLLMProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        return self._log()[-chars:]

    def _log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stages(self) -> list[Stage]:
        """Every request's stage times so far, in the order answered."""
        out = []
        for mode, fields, attempt in STAGE.findall(self._log()):
            out.append(Stage(mode, {k: float(v) for k, v in FIELD.findall(fields)},
                             int(attempt)))
        return out

    def count(self, text: str) -> int:
        """Lines of its log that contain `text` (e.g. "re-encoding and retrying")."""
        return sum(text in line for line in self._log().splitlines())


def stage_means(stages: list[Stage]) -> dict[str, Any]:
    """Mean (`key`) and median (`key_p50`) of each stage time over `stages`
    (ms), and how many requests were retried."""
    out: dict[str, Any] = {}
    for key in sorted({k for s in stages for k in s.times}):
        values = [s.times[key] for s in stages if key in s.times]
        out[key] = statistics.fmean(values)
        out[f"{key}_p50"] = statistics.median(values)
    out["retried"] = sum(1 for s in stages if s.attempt)
    return out
