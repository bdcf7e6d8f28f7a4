"""E/PD on one host, as an operator runs it: two real `vllm serve` engines,
an encoder instance (`ec_producer`, encoder-only in vLLM 0.32) and a
prefill/decode instance (`ec_consumer`), one ec-daemon between them, and the
E/PD proxy (benchmarks/epd_proxy.py) in front. The PD engine runs its
encoder for no image the encoder instance saw, answers what an engine
without a connector answers (greedy), and when the encoder instance is
SIGKILLed mid-stream every request is still answered, correctly, by PD
encoding itself. The same engines behind vLLM's own proxy (its
`disagg_epd_proxy.py`, from vLLM's source release): with `--no-rewrite`,
the mode for a model that declares no placeholder metadata (PaliGemma), PD
loads every image; in its default rewrite mode PD never hits for such a
model (the proxy keys the encoder instance's item by a uuid and sends PD the
media without it), which docs/epd.md says. (Rewrite mode with a model that
declares placeholder metadata: test_epd_vllm_proxy.py.)

Engines and the daemon start the way `make bench-serve` starts them
(benchmarks/serve_hosts.py); encoder forwards are counted from vLLM's
per-step log as there."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.epd_proxy import EPDProxy
from benchmarks.serve import CHAT_TEMPLATE
from benchmarks.serve_hosts import Daemon, Engine, EngineSetup, start_engines
from benchmarks.serve_modes import ec_config
from benchmarks.serve_stream import make_images
from benchmarks.vllm_proxy import VLLMProxy
from tests.vllm.chat import chat, sigkill_engine, wait_forwards
from tests.vllm.tiny_model import IMAGE_SIZE

pytestmark = pytest.mark.timeout(1500)
SEEN = 4  # images the encoder instance encodes while it lives
STREAM = 8  # the stream during which it is killed, each image new
KILL_AFTER = 3  # answers of the stream before the SIGKILL
SPACING_S = 0.5  # between the stream's requests
NO_REWRITE = 3  # images sent through vLLM's proxy with --no-rewrite


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
    # seen, the stream, vLLM's proxy with --no-rewrite, then in rewrite mode
    images = make_images(folder, SEEN + STREAM + NO_REWRITE + 1, IMAGE_SIZE, 34, "epd")

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


def test_vllms_proxy_with_no_rewrite_has_pd_load_every_image(
        epd: Topology, vllm_proxy_script: Path, tmp_path: Path) -> None:
    """vLLM's proxy sends each image to the encoder instance without a uuid
    and PD the request unchanged: both key the image by its content."""
    images = epd.images[SEEN + STREAM:SEEN + STREAM + NO_REWRITE]
    e_before, pd_before = epd.encoder.encoder_forwards(), epd.pd.encoder_forwards()
    with VLLMProxy(epd.encoder.url, epd.pd.url, tmp_path / "proxy.log", no_rewrite=True,
                   proxy=vllm_proxy_script) as proxy:
        for image in images:
            status, text = chat(proxy.url, epd.model, image)
            assert status == 200, text + proxy.log_tail()
            assert text == epd.reference[image], image.name
        stages = proxy.stages()
    assert [(s.mode, s.attempt) for s in stages] == [("no-rewrite", 0)] * NO_REWRITE
    assert wait_forwards(epd.encoder, e_before + NO_REWRITE) == e_before + NO_REWRITE
    assert epd.pd.encoder_forwards() == pd_before, epd.pd.log_tail()  # every image loaded


def test_vllms_proxy_rewriting_for_a_model_without_placeholder_metadata_never_hits(
        epd: Topology, vllm_proxy_script: Path, tmp_path: Path) -> None:
    """PaliGemma declares no placeholder metadata: the encoder instance
    reports none, so the proxy sends PD the media, but without the uuid it
    gave the encoder instance's item. PD keys the image by its content and
    misses what E saved under the uuid: it encodes the image itself (right,
    and what docs/epd.md tells such models to avoid with --no-rewrite)."""
    image = epd.images[-1]
    e_before, pd_before = epd.encoder.encoder_forwards(), epd.pd.encoder_forwards()
    with VLLMProxy(epd.encoder.url, epd.pd.url, tmp_path / "proxy.log",
                   proxy=vllm_proxy_script) as proxy:
        status, text = chat(proxy.url, epd.model, image)
        assert status == 200, text + proxy.log_tail()
        assert [s.mode for s in proxy.stages()] == ["rewrite"]
        assert proxy.count("as metadata references") == 0  # nothing was rewritten
    assert text == epd.reference[image]
    assert wait_forwards(epd.encoder, e_before + 1) == e_before + 1
    assert wait_forwards(epd.pd, pd_before + 1) == pd_before + 1  # encoded again by PD


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
