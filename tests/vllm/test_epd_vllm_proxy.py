"""Metadata-only E/PD through vLLM's own proxy, with real engines.

Two `vllm serve` engines of a tiny Qwen2-VL (tests/vllm/tiny_qwen2vl.py: a
model that declares placeholder metadata, `image_grid_thw`), an encoder
instance (`ec_producer`, with the flags vLLM's example gives encoder
instances) and a prefill/decode instance (`ec_consumer`), one ec-daemon,
and in front vLLM's `disagg_epd_proxy.py` from the source release of the
installed vLLM (benchmarks.vllm_source), in its default rewrite mode: PD
gets each image as `image_embeds` carrying the grid the encoder instance
reported, and the proxy's uuid, no pixels.

- PD runs its encoder for no image, receives none of them with media (the
  connector counts the items that came without it: nothing to preprocess),
  and answers what an engine without a connector answers (greedy).
- A save the encoder instance drops (its save queue is too small for the
  larger images here) after announcing the image costs PD no wait: the
  daemon tells PD at once that nobody will make it, PD fails the request,
  and the proxy's retry sends the image to the encoder instance again,
  which takes it from vLLM's encoder cache without a save, so announces no
  metadata for it: the proxy sends PD the media, and PD encodes it.
- The encoder instance claims each image before it encodes it: a PD request
  for an image it is still encoding waits for its save and loads it, and an
  encoder instance killed mid-encode costs PD no more than that (PD encodes
  the image itself at once).

Each engine start costs minutes here: the reference engine, then the pair,
serve every test of the module.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.serve_hosts import STOP_S, Daemon, Engine, EngineSetup, start_engines
from benchmarks.serve_stream import make_images
from benchmarks.vllm_proxy import ENCODER_FLAGS, VLLMProxy
from tests.vllm.chat import chat, sigkill_engine, wait_forwards
from tests.vllm.slow_encode import SECONDS_ENV, TRIGGER_ENV
from tests.vllm.tiny_qwen2vl import MAX_SIDE, image_embeddings

pytestmark = pytest.mark.timeout(1500)
LOADED = 3  # images PD loads (saved by the encoder instance)
SMALL = 84  # their side: 9 embeddings, 4.5 KiB of float32 rows
LARGE = MAX_SIDE  # 16 embeddings, 8 KiB: more than the encoder instance's save queue
SAVE_QUEUE_BYTES = 6 << 10
MAX_DEFER_S = 120  # PD's bound on a wait: far above what any test here may take
SLOW_ENCODE_S = 8.0  # the encode the claim tests catch the encoder instance in


class Topology:
    def __init__(self, model: str, folder: Path, reference: dict[Path, str], encoder: Engine,
                 pd: Engine, daemon: Daemon, proxy: Path) -> None:
        self.model, self.folder, self.reference = model, folder, reference
        self.encoder, self.pd, self.daemon, self.proxy = encoder, pd, daemon, proxy
        self.trigger = folder / "slow-encode"

    def images(self, name: str, side: int) -> list[Path]:
        return [p for p in sorted(self.reference) if p.name.startswith(f"{name}-")
                and p.stem.endswith(f"-{side}")] or pytest.fail(f"no {name} images")

    def pd_counters(self) -> dict[str, float]:
        """PD's connector counters on /metrics, all of them: vLLM takes a
        connector's stats during steps only (and ours once a second), so one
        text-only request a second after the last one makes PD hand over
        what it still holds."""
        time.sleep(1.2)
        status, text = chat(self.pd.url, self.model, None)
        assert status == 200, text
        return self.pd.connector_counters()


IMAGE_SETS = {"loaded": (LOADED, SMALL), "dropped": (1, LARGE), "claimed": (1, SMALL),
              "orphaned": (1, SMALL)}


def ec_args(role: str, socket: str, **extra: object) -> list[str]:
    config = {"ec_connector": "SlowEncodeConnector",
              "ec_connector_module_path": "tests.vllm.slow_encode", "ec_role": role,
              "ec_connector_extra_config": {"ec_daemon_socket": socket,
                                            "ec_daemon_copy_backend": "cpu", **extra}}
    return ["--ec-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def epd(tiny_qwen2vl: Path, vllm_proxy_script: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    folder = tmp_path_factory.mktemp("epd-qwen")
    model = str(tiny_qwen2vl)
    cores = tuple(sorted(os.sched_getaffinity(0)))
    setup = EngineSetup("cpu", model, None, cores=cores)  # (the model's chat template)
    images: list[Path] = []
    for seed, (name, (count, side)) in enumerate(IMAGE_SETS.items()):
        made = make_images(folder, count, side, 70 + seed, name)
        for i, path in enumerate(made):
            images.append(path.rename(path.with_name(f"{name}-{i}-{side}.png")))

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

    daemon = Daemon(folder / "host", cpu_bytes="64MiB")
    daemon.start(fresh=True)
    trigger_env = {TRIGGER_ENV: str(folder / "slow-encode"), SECONDS_ENV: str(SLOW_ENCODE_S)}
    encoder = Engine(0, setup, ec_args("ec_producer", daemon.uri,
                                       ec_daemon_save_queue_bytes=SAVE_QUEUE_BYTES)
                     + ENCODER_FLAGS, trigger_env, folder / "encoder.log")
    pd = Engine(1, setup,
                ec_args("ec_consumer", daemon.uri, ec_daemon_max_defer_seconds=MAX_DEFER_S),
                {}, folder / "pd.log")
    try:
        start_engines([encoder, pd], setup)
        yield Topology(model, folder, reference, encoder, pd, daemon, vllm_proxy_script)
    finally:
        encoder.stop()
        pd.stop()
        daemon.stop()
        daemon.clean()


def test_pd_loads_every_image_metadata_only_and_answers_as_without_a_connector(
        epd: Topology, tmp_path: Path) -> None:
    images = epd.images("loaded", SMALL)
    assert image_embeddings(SMALL) * 128 * 4 < SAVE_QUEUE_BYTES  # (saved, not dropped)
    with VLLMProxy(epd.encoder.url, epd.pd.url, tmp_path / "proxy.log",
                   proxy=epd.proxy) as proxy:
        for image in images:
            status, text = chat(proxy.url, epd.model, image)
            assert status == 200, text + proxy.log_tail()
            assert text == epd.reference[image], image.name
        assert proxy.count("Rewrote 1 media item(s) as metadata references") == LOADED
        assert [(s.mode, s.attempt) for s in proxy.stages()] == [("rewrite", 0)] * LOADED
    assert wait_forwards(epd.encoder, LOADED) == LOADED  # each image encoded once, by E
    assert epd.pd.encoder_forwards() == 0, epd.pd.log_tail()
    counters = epd.pd_counters()
    assert counters.get("metadata_only_items") == LOADED  # no image came with its pixels
    assert counters.get("loads") == LOADED and counters.get("metadata_only_failures") == 0
    stats = epd.daemon.stats()
    assert stats["saves"] == LOADED and stats["convergence"]["claims"] == LOADED


def test_a_dropped_save_fails_pd_at_once_and_the_retry_sends_pd_the_media(
        epd: Topology, tmp_path: Path) -> None:
    (image,) = epd.images("dropped", LARGE)
    e_before, pd_before = epd.encoder.encoder_forwards(), epd.pd.encoder_forwards()
    failures_before = epd.pd_counters().get("metadata_only_failures", 0)
    with VLLMProxy(epd.encoder.url, epd.pd.url, tmp_path / "proxy.log",
                   proxy=epd.proxy) as proxy:
        started = time.monotonic()
        status, text = chat(proxy.url, epd.model, image)
        took = time.monotonic() - started
        assert status == 200, text + proxy.log_tail()
        stages = proxy.stages()
        assert proxy.count("re-encoding and retrying") == 1, proxy.log_tail()
        assert proxy.count("as metadata references") == 1  # the retry carried the media
    assert text == epd.reference[image]
    assert [s.attempt for s in stages] == [1]  # PD answered the retry
    assert took < MAX_DEFER_S / 2  # PD failed the first attempt at once, not at its bound
    assert "nobody will make" in epd.pd.log_tail(20000)
    assert wait_forwards(epd.pd, pd_before + 1) == pd_before + 1  # with the media: encoded
    assert wait_forwards(epd.encoder, e_before + 1) - e_before in (1, 2)  # (may hold it)
    counters = epd.pd_counters()
    assert counters.get("metadata_only_failures", 0) - failures_before == 1


def _encode_slowly(epd: Topology,
                   image: Path) -> tuple[threading.Thread, list[tuple[int, str]]]:
    """Send `image` to the encoder instance (as vLLM's proxy does with
    --no-rewrite: its media, no uuid) and return once its worker is in the
    slow encode (its scheduler claimed the image, nothing is saved yet)."""
    epd.trigger.write_text("")
    outcome: list[tuple[int, str]] = []

    def send() -> None:
        try:
            outcome.append(chat(epd.encoder.url, epd.model, image))
        except OSError as exc:  # (the instance was killed)
            outcome.append((0, str(exc)))

    sender = threading.Thread(target=send)
    sender.start()
    started = epd.trigger.with_name(epd.trigger.name + ".started")
    deadline = time.monotonic() + 120
    while not started.exists():
        assert time.monotonic() < deadline and sender.is_alive(), epd.encoder.log_tail()
        time.sleep(0.05)
    started.unlink()
    return sender, outcome


def test_pd_waits_for_the_encoder_instances_claim_instead_of_encoding_again(
        epd: Topology) -> None:
    (image,) = epd.images("claimed", SMALL)
    pd_before, claims = epd.pd.encoder_forwards(), epd.daemon.stats()["convergence"]["claims"]
    sender, outcome = _encode_slowly(epd, image)
    status, text = chat(epd.pd.url, epd.model, image)  # while E is still encoding it
    sender.join(STOP_S)
    assert status == 200 and text == epd.reference[image], text
    assert outcome and outcome[0][0] == 200, outcome
    assert epd.pd.encoder_forwards() == pd_before, epd.pd.log_tail()  # PD loaded E's save
    convergence = epd.daemon.stats()["convergence"]
    assert convergence["claims"] == claims + 1 and convergence["waits"] >= 1


def test_an_encoder_instance_killed_mid_encode_costs_pd_its_own_encode_only(
        epd: Topology) -> None:
    """Last: it kills the encoder instance. Its claim passes on the moment
    its session ends, and PD, which waited for it, encodes the image itself
    at once rather than after its bound."""
    (image,) = epd.images("orphaned", SMALL)
    pd_before = epd.pd.encoder_forwards()
    deferred = epd.pd_counters().get("deferred_items", 0)
    sender, _ = _encode_slowly(epd, image)
    result: list[tuple[int, str]] = []
    asking = threading.Thread(target=lambda: result.append(chat(epd.pd.url, epd.model, image)))
    started = time.monotonic()
    asking.start()
    time.sleep(1.0)  # PD asked, and waits for E's claim
    sigkill_engine(epd.encoder)
    asking.join(MAX_DEFER_S)
    sender.join(STOP_S)
    assert result and result[0] == (200, epd.reference[image]), result
    assert time.monotonic() - started < MAX_DEFER_S / 2
    assert wait_forwards(epd.pd, pd_before + 1) == pd_before + 1
    counters = epd.pd_counters()
    assert counters["deferred_items"] > deferred  # PD waited for E's claim...
    assert counters["defer_timeouts"] == 0  # ...and was told when it ended: no bound ran out
