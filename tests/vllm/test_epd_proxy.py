"""The E/PD proxy (benchmarks/epd_proxy.py) against stand-in engines on
loopback: what each instance is sent, that PD's answer (streamed or not)
reaches the client as PD sent it, and that an encoder instance that is down
or answers an error costs nothing but its step. (Real engines:
test_epd_e2e.py.)"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from benchmarks.epd_proxy import EPDProxy
from benchmarks.serve_hosts import free_port

STREAMED = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n'


class StandIn:
    """An HTTP server that records each body it is sent and answers
    `status` (PD: JSON, or an event stream when asked to stream)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.bodies: list[dict[str, Any]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.bodies.append(body)
                streamed = body.get("stream")
                payload = STREAMED if streamed else json.dumps({"path": self.path}).encode()
                self.send_response(stand_in.status)
                self.send_header("Content-Type",
                                 "text/event-stream" if streamed else "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pd() -> Iterator[StandIn]:
    server = StandIn()
    yield server
    server.close()


def post(url: str, body: Any) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


REQUEST = {"model": "m", "max_completion_tokens": 8, "stream": True,
           "stream_options": {"include_usage": True},
           "messages": [{"role": "user", "content": [
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}


def test_the_encoder_instance_gets_one_token_then_pd_the_full_request(pd: StandIn) -> None:
    encoder = StandIn()
    try:
        with EPDProxy(encoder.url, pd.url) as proxy:
            status, body = post(f"{proxy.url}/v1/chat/completions", REQUEST)
            assert (status, body) == (200, STREAMED)  # PD's stream, as PD sent it
            assert proxy.stats.encoder_ok == 1 and proxy.stats.encoder_failed == 0
    finally:
        encoder.close()
    (sent,) = encoder.bodies
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert "max_completion_tokens" not in sent and "stream_options" not in sent
    assert sent["messages"] == REQUEST["messages"]  # the same media
    assert pd.bodies == [REQUEST]  # the full request, unchanged


@pytest.mark.parametrize("encoder_state", ["down", "error"])
def test_an_encoder_instance_down_or_failing_costs_only_its_step(pd: StandIn,
                                                                 encoder_state: str) -> None:
    encoder = StandIn(status=500)
    url = encoder.url
    if encoder_state == "down":
        encoder.close()
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    try:
        with EPDProxy(url, pd.url) as proxy:
            plain = {**REQUEST, "stream": False}
            status, body = post(f"{proxy.url}/v1/chat/completions", plain)
            assert status == 200 and json.loads(body) == {"path": "/v1/chat/completions"}
            assert proxy.stats.encoder_failed == 1 and proxy.stats.encoder_ok == 0
    finally:
        encoder.close()
    assert pd.bodies == [plain]


def test_pd_errors_and_bad_bodies_reach_the_client(pd: StandIn) -> None:
    pd.status = 400
    with EPDProxy(pd.url, pd.url) as proxy:
        status, _ = post(f"{proxy.url}/v1/completions", {"prompt": "x"})
        assert status == 400  # PD's own status, not a 200
        status, body = post(f"{proxy.url}/v1/completions", ["not", "an", "object"])
        assert status == 400 and b"JSON object" in body
