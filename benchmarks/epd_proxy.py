"""A small E/PD proxy for the tests and `make bench-serve`, in the manner of
vLLM's own (examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py
in vLLM's source release, which benchmarks.vllm_proxy runs; operators use
that one or their own router): each OpenAI request goes first to the
encoder instance (an `ec_producer`, which vLLM 0.32 runs encoder-only) with
one output token, then the full request goes to the prefill/decode instance
(an `ec_consumer`), whose answer (streamed or not) is the client's: what
vLLM's proxy does with `--no-rewrite`.

The encoder step is an optimisation, never a dependency: when the encoder
instance is down, slow past `ENCODER_TIMEOUT_S` or answers an error, the
request still goes to PD with its media, which encodes it itself (a frozen
encoder instance costs each request the timeout: set it to what an encode
may take); vLLM's proxy answers 502 then. That is why this proxy resends
the full request rather than metadata-only items (vLLM's proxy's rewrite
mode): a PD given metadata only cannot encode, so a lost encoder instance
fails requests there (and this repository's test model, PaliGemma, declares
no placeholder metadata; see docs/epd.md).

Loopback only: it binds 127.0.0.1. Run alone with
`python -m benchmarks.epd_proxy --encoder URL --pd URL --port N`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import threading
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("epd_proxy")
ENCODER_TIMEOUT_S = 120.0  # an encode on a busy CPU host; then PD encodes itself
PD_TIMEOUT_S = 1800.0
ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass
class ProxyStats:
    requests: int = 0
    encoder_ok: int = 0  # the encoder instance answered 200
    encoder_failed: int = 0  # down, timed out or an error: PD encoded


def encoder_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request the encoder instance gets: the same media and prompt, one
    output token, not streamed (it only has to encode and save)."""
    out = copy.deepcopy(body)
    out.pop("max_completion_tokens", None)
    out.pop("stream_options", None)
    out.update(max_tokens=1, stream=False)
    return out


class EPDProxy:
    """The proxy's HTTP server on 127.0.0.1:`port` (0: a free one), on an
    event loop of its own in a background thread (`start`, `stop`)."""

    def __init__(self, encoder_url: str, pd_url: str, port: int = 0,
                 encoder_timeout_s: float = ENCODER_TIMEOUT_S) -> None:
        self.encoder_url = encoder_url.rstrip("/")
        self.encoder_timeout_s = encoder_timeout_s
        self.pd_url = pd_url.rstrip("/")
        self.port = port
        self.stats = ProxyStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)  # images inline, base64
        for route in ROUTES:
            app.router.add_post(route, self._handle)
        app.router.add_get("/health", self._health)
        return app

    async def serve(self) -> None:
        """Bind and serve (on the running loop) until `close`."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), trust_env=False)
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = int(self._runner.addresses[0][1])  # the one bound, when 0 was asked

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def start(self) -> EPDProxy:
        """Serve in a background thread; returns once it listens."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.serve())
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self.close())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="epd-proxy", daemon=True)
        self._thread.start()
        ready.wait(60)
        if failure:
            raise RuntimeError(f"the E/PD proxy did not start: {failure[0]!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(60)
            self._loop = self._thread = None

    def __enter__(self) -> EPDProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return web.json_response({"error": f"the body is not JSON: {exc}"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        self.stats.requests += 1
        await self._encode(request.path, body)
        return await self._forward(request, body)

    async def _encode(self, path: str, body: dict[str, Any]) -> None:
        """The encoder instance's step; any failure only costs PD an encode."""
        assert self._session is not None
        try:
            async with self._session.post(
                    self.encoder_url + path, json=encoder_request(body),
                    timeout=aiohttp.ClientTimeout(total=self.encoder_timeout_s)) as reply:
                text = await reply.text()
                if reply.status != 200:
                    raise RuntimeError(f"HTTP {reply.status}: {text[:300]}")
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
            self.stats.encoder_failed += 1
            log.warning("encoder instance %s failed (%r): PD encodes", self.encoder_url, exc)
            return
        self.stats.encoder_ok += 1

    async def _forward(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """The full request to PD; its answer, streamed as it comes."""
        assert self._session is not None
        response: web.StreamResponse | None = None
        try:
            async with self._session.post(
                    self.pd_url + request.path, json=body,
                    timeout=aiohttp.ClientTimeout(total=PD_TIMEOUT_S)) as reply:
                response = web.StreamResponse(status=reply.status, headers={
                    "Content-Type": reply.headers.get("Content-Type", "application/json")})
                await response.prepare(request)
                async for chunk in reply.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if response is not None:  # mid-answer: the client sees the cut
                raise
            return web.json_response({"error": f"the PD instance failed: {exc!r}"}, status=502)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder", required=True, help="the encoder instance's URL")
    parser.add_argument("--pd", required=True, help="the prefill/decode instance's URL")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--encoder-timeout", type=float, default=ENCODER_TIMEOUT_S,
                        help="seconds the encoder instance's step may take; then PD encodes "
                        "(a frozen encoder instance costs each request this much)")
    args = parser.parse_args()
    if args.encoder_timeout <= 0:
        parser.error("--encoder-timeout must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    proxy = EPDProxy(args.encoder, args.pd, args.port, args.encoder_timeout)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(proxy.serve())
    print(f"E/PD proxy on {proxy.url}: encoder {proxy.encoder_url}, PD {proxy.pd_url}",
          flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        loop.run_forever()
    loop.run_until_complete(proxy.close())


if __name__ == "__main__":
    main()
