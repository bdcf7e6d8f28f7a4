"""E/PD on one host, as an operator runs it: two real `vllm serve` engines,
an encoder instance (`ec_producer`, encoder-only in vLLM 0.32) and a
prefill/decode instance (`ec_consumer`), one ec-daemon between them, and the
E/PD proxy (benchmarks/epd_proxy.py) in front. The PD engine runs its
encoder for no image the encoder instance saw, answers what an engine
without a connector answers (greedy), and when the encoder instance is
SIGKILLed mid-stream every request is still answered, correctly, by PD
encoding itself.

Engines and the daemon start the way `make bench-serve` starts them
(benchmarks/serve_hosts.py); encoder forwards are counted from vLLM's
per-step log as there."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.epd_proxy import EPDProxy
from benchmarks.serve import CHAT_TEMPLATE
from benchmarks.serve_hosts import Daemon, Engine, EngineSetup, start_engines
from benchmarks.serve_modes import ec_config
from benchmarks.serve_stream import make_images
from tests.vllm.engine_proc import _remove_unmapped, _shm_mapped_by_group
from tests.vllm.tiny_model import IMAGE_SIZE

pytestmark = pytest.mark.timeout(1500)
SEEN = 4  # images the encoder instance encodes while it lives
STREAM = 8  # the stream during which it is killed, each image new
KILL_AFTER = 3  # answers of the stream before the SIGKILL
SPACING_S = 0.5  # between the stream's requests
COUNT_WAIT_S = 30.0  # vLLM logs a step's encoder inputs after it answers


def chat(url: str, model: str, image: Path) -> tuple[int, str]:
    """One greedy chat request of 8 tokens showing `image`: (status, text)."""
    data = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    body = {"model": model, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data}},
                {"type": "text", "text": "caption en\n"}]}]}
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            return reply.status, json.loads(reply.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def wait_forwards(engine: Engine, at_least: int) -> int:
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


class Topology:
    def __init__(self, model: str, images: list[Path], reference: dict[Path, str],
                 encoder: Engine, pd: Engine, daemon: Daemon, proxy: EPDProxy) -> None:
        self.model, self.images, self.reference = model, images, reference
        self.encoder, self.pd, self.daemon, self.proxy = encoder, pd, daemon, proxy


@pytest.fixture(scope="module")
def epd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    folder = tmp_path_factory.mktemp("epd")
    model = str(tiny_model)
    cores = tuple(sorted(os.sched_getaffinity(0)))
    setup = EngineSetup("cpu", model, CHAT_TEMPLATE, cores=cores)
    images = make_images(folder, SEEN + STREAM, IMAGE_SIZE, 34, "epd")

    # The reference: an engine without a connector, first and alone.
    plain = Engine(0, setup, [], {}, folder / "reference.log")
    try:
        start_engines([plain], setup)
        reference = {}
        for image in images:
            status, text = chat(plain.url, model, image)
            assert status == 200, text
            reference[image] = text
    finally:
        plain.stop()
    assert len(set(reference.values())) > len(images) // 2  # images steer the output

    daemon = Daemon(folder / "host", cpu_bytes="128MiB")
    daemon.start(fresh=True)
    socket = daemon.uri
    encoder = Engine(0, setup, ec_config("ec-daemon", "cpu", socket, folder, "ec_producer"), {},
                     folder / "encoder.log")
    pd = Engine(1, setup, ec_config("ec-daemon", "cpu", socket, folder, "ec_consumer"), {},
                folder / "pd.log")
    try:
        start_engines([encoder, pd], setup)
        with EPDProxy(encoder.url, pd.url) as proxy:
            yield Topology(model, images, reference, encoder, pd, daemon, proxy)
    finally:
        encoder.stop()
        pd.stop()
        daemon.stop()
        daemon.clean()


def test_pd_runs_no_encode_for_images_the_encoder_instance_saw(epd: Topology) -> None:
    seen = epd.images[:SEEN]
    for image in seen:
        status, text = chat(epd.proxy.url, epd.model, image)
        assert status == 200, text
        assert text == epd.reference[image], image.name
    assert wait_forwards(epd.encoder, SEEN) == SEEN  # every image encoded, once, by E
    assert epd.daemon.stats()["saves"] >= SEEN
    assert epd.pd.encoder_forwards() == 0, epd.pd.log_tail()
    assert epd.proxy.stats.encoder_ok == SEEN and epd.proxy.stats.encoder_failed == 0


def test_the_encoder_instance_killed_mid_stream_costs_pd_encodes_never_an_error(
        epd: Topology) -> None:
    stream = epd.images[SEEN:SEEN + STREAM]
    before, after = stream[:KILL_AFTER + 1], stream[KILL_AFTER + 1:]
    pd_before = epd.pd.encoder_forwards()
    answered: list[Path] = []

    def send(image: Path, delay: float) -> tuple[int, str]:
        time.sleep(delay)
        outcome = chat(epd.proxy.url, epd.model, image)
        answered.append(image)
        return outcome

    with ThreadPoolExecutor(max_workers=STREAM) as pool:
        futures = [pool.submit(send, image, i * SPACING_S) for i, image in enumerate(before)]
        deadline = time.monotonic() + 600
        while len(answered) < KILL_AFTER and time.monotonic() < deadline:
            time.sleep(0.05)
        answered_at_kill = len(answered)
        sigkill_engine(epd.encoder)  # the last of `before` may be in flight
        futures += [pool.submit(send, image, i * SPACING_S) for i, image in enumerate(after)]
        results = [f.result() for f in futures]

    assert answered_at_kill >= KILL_AFTER
    for image, (status, text) in zip(stream, results, strict=True):
        assert status == 200, text
        assert text == epd.reference[image], image.name
    failed = epd.proxy.stats.encoder_failed
    assert len(after) <= failed <= len(after) + 1  # those sent after the kill found E gone
    # Each of them showed a new image: PD encoded it itself.
    encoded = wait_forwards(epd.pd, pd_before + failed) - pd_before
    assert failed <= encoded <= failed + 1, epd.pd.log_tail()
