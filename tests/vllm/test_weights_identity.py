"""Other weights under the same model path are never served the old weights'
encoder outputs: the namespace carries the weights' identity
(ec_client.identity), computed alike by an engine's scheduler and worker."""

from __future__ import annotations

import re
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from ec_client.common.limits import MAX_WEIGHTS_ID_CHARS
from ec_client.common.settings import ConnectorSettings
from ec_client.identity import files_identity
from ec_client.vllm_namespace import layout_of
from tests.vllm import vllm_harness as h
from tests.vllm.engine_proc import A, B, run_engine, same_output
from tests.vllm.tiny_model import build_tiny_paligemma

pytestmark = pytest.mark.timeout(1200)

WEIGHTS = "model.safetensors"
# The connector's start-up line, one per process: "ECDaemonConnector WORKER
# for engine X on SOCKET (Layout(...))".
STARTED = re.compile(r"ECDaemonConnector (SCHEDULER|WORKER) for engine \S+ on \S+ "
                     r"\((Layout\(.*\))\)")


def layouts(result: dict[str, Any]) -> dict[str, set[str]]:
    """The layouts each role of an engine logged."""
    found: dict[str, set[str]] = {}
    for role, layout in STARTED.findall(result["output"]):
        found.setdefault(role, set()).add(layout)
    return found


def test_weights_replaced_under_the_same_path_are_encoded_again(tmp_path, daemon, reference):
    model = build_tiny_paligemma(tmp_path / "model", seed=0)  # the weights of `reference`
    first = run_engine(model, [A, B], socket=daemon.socket)
    assert first["encoder_images"] == 2
    for image in (A, B):
        assert same_output(first["results"][image], reference[image])
    daemon.wait_for(lambda: daemon.stats()["entries"] == 2, what="A and B saved")

    # Another checkpoint of the same size copied over the first, same path.
    other = build_tiny_paligemma(tmp_path / "other", seed=1)
    assert (other / WEIGHTS).stat().st_size == (model / WEIGHTS).stat().st_size
    shutil.copyfile(other / WEIGHTS, model / WEIGHTS)

    second = run_engine(model, [A, B], socket=daemon.socket)
    assert [r["encoder_images"] for r in second["requests"]] == [1, 1]  # no hits
    new_reference = run_engine(other, [A, B])["results"]
    for image in (A, B):
        assert same_output(second["results"][image], new_reference[image])
    # The old encoder outputs would have given other answers.
    assert any(not same_output(new_reference[image], reference[image]) for image in (A, B))

    # Each engine's scheduler and worker computed one namespace (the first
    # engine's saves are where its scheduler looks: test_engine_e2e's hits),
    # and the new weights got a namespace of their own.
    before, after = layouts(first), layouts(second)
    assert before["SCHEDULER"] == before["WORKER"] and len(before["WORKER"]) == 1
    assert after["SCHEDULER"] == after["WORKER"] and len(after["WORKER"]) == 1
    assert before["WORKER"] != after["WORKER"]
    stats = daemon.stats()
    assert stats["saves"] == 4
    assert sorted(ns["entries"] for ns in stats["namespaces"]) == [2, 2]


def test_the_layout_names_the_weights_and_the_encoder_settings(tiny_model):
    config = h.make_config(tiny_model, "unix:///nonexistent/ec.sock")
    variant = layout_of(config).variant
    assert f"w={files_identity(str(tiny_model))}" in variant.split("|")
    assert "w=release-7" in layout_of(config, weights_id="release-7").variant.split("|")
    assert layout_of(config).variant == variant  # the same in every process

    mm = config.model_config.multimodal_config
    mm.mm_processor_kwargs = {"device": "cuda"}  # where the processor runs: no change
    assert layout_of(config).variant == variant
    mm.mm_processor_kwargs = {"do_pan_and_scan": True}
    changed = layout_of(config).variant
    assert changed != variant
    assert [p for p in changed.split("|") if p.startswith("w=")] == \
        [p for p in variant.split("|") if p.startswith("w=")]


def test_producers_and_consumers_share_the_namespace(tiny_model):
    producer = h.make_config(tiny_model, "unix:///nonexistent/ec.sock", role="ec_producer")
    consumer = h.make_config(tiny_model, "unix:///nonexistent/ec.sock", role="ec_consumer")
    assert layout_of(producer).variant == layout_of(consumer).variant


def test_the_weights_id_comes_from_the_extra_config():
    assert ConnectorSettings.from_extra_config({}).weights_id == ""
    settings = ConnectorSettings.from_extra_config({"ec_daemon_weights_id": "sha256:abc"})
    assert settings.weights_id == "sha256:abc"
    too_long = "x" * (MAX_WEIGHTS_ID_CHARS + 1)  # the daemon would refuse the layout
    with pytest.raises(ValueError, match="ec_daemon_weights_id"):
        ConnectorSettings.from_extra_config({"ec_daemon_weights_id": too_long})


def test_weights_that_cannot_be_identified_are_never_shared(tiny_model, monkeypatch, tmp_path):
    """A hub id in no cache (fetched some other way): its weights are unknown,
    so each engine keeps its entries to itself rather than risk another
    engine's weights under the same name."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    one = h.make_config(tiny_model, "unix:///nonexistent/ec.sock")
    two = h.make_config(tiny_model, "unix:///nonexistent/ec.sock")
    for config in (one, two):
        config.model_config.model = config.model_config.model_weights = "org/not-cached"
    monkeypatch.setattr("ec_client.vllm_namespace.hub_caches", lambda: [str(tmp_path)])
    first, second = layout_of(one).variant, layout_of(two).variant
    assert first == layout_of(one).variant  # the same in every process of one engine
    assert "w=unknown-" in first and first != second


def test_items_keyed_by_a_lora_adapter_are_never_cached(tiny_model, daemon):
    """With tower/connector LoRA, vLLM names an item `adapter:mm_hash`: an
    adapter retrained under the same name would be served its predecessor's
    outputs, so such items are neither saved nor looked up; plain items are."""
    config = h.make_config(tiny_model, daemon.socket, instance_id="lora")
    config.lora_config = SimpleNamespace(enable_tower_connector_lora=True)
    scheduler = h.connector(config, ECConnectorRole.SCHEDULER)
    worker = h.connector(config, ECConnectorRole.WORKER)
    try:
        h.wait_attached(scheduler)
        h.wait_attached(worker)
        outputs = {"adapter:img": h.encoder_output(1), "img": h.encoder_output(2)}
        _, hits = h.step(scheduler, worker, [h.request("r1", "adapter:img"),
                                             h.request("r2", "img")], outputs)
        assert hits == [False, False]
        assert worker.worker_delegate.flush(20)
        h.wait_until(lambda: scheduler.scheduler_delegate.view.get("img") is not None)
        assert daemon.stats()["saves"] == 1  # "img" only
        h.forget(scheduler, ["adapter:img", "img"])  # (vLLM's encoder cache let them go)
        requests = [h.request("r3", "adapter:img"), h.request("r4", "img")]
        assert scheduler.ensure_cache_available(requests[0], 0)  # never looked up
        assert not scheduler.ensure_cache_available(requests[1], 0)  # its load is staged
        assert not scheduler.has_cache_item("adapter:img")
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_a_worker_that_identified_other_weights_than_its_scheduler_saves_nothing(
        tiny_model, daemon, caplog):
    """The scheduler and a worker of one engine computed different namespaces
    (the weights identified at different moments, around a download that
    moved a hub ref): the worker's saves would land where engines on other
    weights read. Each step's metadata names the scheduler's namespace; the
    worker then stops saving and says so."""
    config = h.make_config(tiny_model, daemon.socket, instance_id="split")
    scheduler = h.connector(config, ECConnectorRole.SCHEDULER)
    stale = h.make_config(tiny_model, daemon.socket, instance_id="split",
                          ec_daemon_weights_id="the-weights-before-the-download")
    worker = h.connector(stale, ECConnectorRole.WORKER)
    try:
        h.wait_attached(scheduler)
        h.wait_attached(worker)
        _, hits = h.step(scheduler, worker, [h.request("r", "img-x")],
                         {"img-x": h.encoder_output(3)})
        assert hits == [False]
        assert worker.worker_delegate.flush(20)
        assert daemon.stats()["saves"] == 0 and not worker.worker_delegate.saves_enabled
        assert "saves nothing" in caplog.text
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_the_namespace_names_the_vllm_and_transformers_versions(tiny_model, monkeypatch):
    """A cache that outlives an upgrade never serves what the new code would
    not compute: the versions are in the namespace (and its store name)."""
    import importlib.metadata

    import transformers
    import vllm

    config = h.make_config(tiny_model, "unix:///nonexistent/ec.sock")
    layout = layout_of(config)
    assert f"rt=vllm-{vllm.__version__},transformers-{transformers.__version__}" in \
        layout.variant.split("|")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "99.0.0" if name == "vllm" else real(name))
    upgraded = layout_of(config)
    assert upgraded.variant != layout.variant
    assert "rt=vllm-99.0.0," + f"transformers-{transformers.__version__}" in \
        upgraded.variant.split("|")


def test_an_fp8_scale_file_counts_by_its_content(tiny_model, tmp_path):
    """vLLM hashes `mm_encoder_fp8_scale_path` by its path: scales recalibrated
    in place must not be served the old scales' outputs."""
    config = h.make_config(tiny_model, "unix:///nonexistent/ec.sock")
    scales = tmp_path / "scales.json"
    scales.write_text('{"visual.blocks.0.attn": {"q": 0.5, "k": 0.5, "v": 0.5}}')
    config.model_config.multimodal_config.mm_encoder_fp8_scale_path = str(scales)
    first = layout_of(config).variant
    scales.write_text('{"visual.blocks.0.attn": {"q": 0.7, "k": 0.5, "v": 0.5}}')
    second = layout_of(config).variant
    assert second != first
    scales.write_text('{"visual.blocks.0.attn": {"q": 0.5, "k": 0.5, "v": 0.5}}')
    assert layout_of(config).variant == first


def test_tensorizer_weights_count_by_content(tiny_model, tmp_path):
    """With the tensorizer loader the weights come from its URI, not the
    model's folder: other tensors under the same URI get another namespace;
    a URI this host cannot read is never shared."""
    import os

    config = h.make_config(tiny_model, "unix:///nonexistent/ec.sock")
    tensors = tmp_path / "model.tensors"
    tensors.write_bytes(b"\x01" * 65536)
    os.utime(tensors, ns=(10**18, 10**18))
    config.load_config.load_format = "tensorizer"
    config.load_config.model_loader_extra_config = {
        "tensorizer_config": {"tensorizer_uri": str(tensors)}}
    first = layout_of(config).variant
    tensors.write_bytes(b"\x02" * 65536)  # the same path, size and mtime: other weights
    os.utime(tensors, ns=(10**18, 10**18))
    assert layout_of(config).variant != first
    config.load_config.model_loader_extra_config = {
        "tensorizer_config": {"tensorizer_uri": "s3://bucket/model.tensors"}}
    assert "w=unknown-" in layout_of(config).variant


@pytest.mark.parametrize("same", [True, False], ids=["same-namespace", "stale-namespace"])
def test_saves_wait_until_the_worker_hears_its_schedulers_namespace(
        tiny_model, daemon, caplog, same):
    """A step whose scheduler is not attached (yet) names no namespace: the
    worker's saves wait, within its save queue, until a step names one; they
    are saved when it is the worker's, dropped (and the worker saves nothing
    more) when it is not. Before, they were saved under the worker's own,
    possibly stale, namespace."""
    from ec_client.vllm_connector import ECDaemonConnectorMetadata

    config = h.make_config(tiny_model, daemon.socket, instance_id=f"held-{same}")
    scheduler = h.connector(config, ECConnectorRole.SCHEDULER)
    worker_config = config if same else h.make_config(
        tiny_model, daemon.socket, instance_id=f"held-{same}",
        ec_daemon_weights_id="the-weights-before-the-download")
    worker = h.connector(worker_config, ECConnectorRole.WORKER)
    try:
        h.wait_attached(worker)
        # The step of a scheduler not attached: its metadata names no namespace.
        worker.bind_connector_metadata(ECDaemonConnectorMetadata())
        worker.save_caches({"img-held": h.encoder_output(5)}, "img-held")
        worker.clear_connector_metadata()
        assert not worker.worker_delegate.flush(1.0)  # held
        assert daemon.stats()["saves"] == 0
        h.wait_attached(scheduler)
        h.step(scheduler, worker, [], {})  # names the scheduler's namespace
        assert worker.worker_delegate.flush(20)
        if same:
            h.wait_until(lambda: scheduler.scheduler_delegate.view.get("img-held") is not None)
            assert daemon.stats()["saves"] == 1
        else:
            assert daemon.stats()["saves"] == 0 and not worker.worker_delegate.saves_enabled
            assert "1 held saves dropped" in caplog.text
    finally:
        scheduler.shutdown()
        worker.shutdown()
