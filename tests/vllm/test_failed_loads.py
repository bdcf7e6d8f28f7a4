"""No failed load stops an engine (issue 40, finding 7): vLLM's own Scheduler
with the connector, stepped as vLLM's V1 runner and Model Runner V2 step it
(tests.vllm.scheduler_harness, tests.vllm.runner_v2), a real daemon, and
another process that writes into the region as any engine worker may. A
load whose bytes were rewritten (checked with `ec_daemon_verify_checksum`)
or whose stamp was is refused: its request encodes the item, or, sent
without its media, fails; the engine goes on; the daemon, told, hides the
entry, so the next save of the key lands and is loaded bit-exact. A load
refused for any other reason costs its request only."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.multimodal.inputs import MultiModalKwargsItem
from vllm.v1.engine import FinishReason

from ec_client import vllm_connector
from ec_protocol.protocol import pb
from tests.vllm import runner_v2 as r2
from tests.vllm import scheduler_harness as sh
from tests.vllm import vllm_harness as h
from tests.vllm.failing_copy import FailingLoadBackend

pytestmark = pytest.mark.writes_region
RUNNERS = ["v1", "v2"]


@pytest.fixture(params=RUNNERS)
def engines(request, tiny_model, daemon, monkeypatch) -> Iterator[Any]:
    """Engines of one runner kind (`v1`: vLLM's V1 runner where vLLM has it;
    `v2`: Model Runner V2's own class), all shut down at the end:
    `make(role, instance_id, **extra)`."""
    if request.param == "v2":
        monkeypatch.setattr(vllm_connector, "workers_run_idle_steps", lambda config: True)
        runner: Any = r2.RunnerV2
    else:
        runner = sh.RunnerStandIn
    with sh.engines(tiny_model, daemon.socket,
                    lambda scheduler, config: runner(scheduler, config, sh.encode)) as make:
        yield make


def request(request_id: str, mm_hash: str, **options: Any) -> Any:
    return r2.request(request_id, mm_hash, **options)


def produced(engines: Any, *mm_hashes: str) -> dict[str, Any]:
    """An encoder engine saved these items: the transfer params it reported."""
    producer = engines("ec_producer", "encoder")
    steps = sh.run_to_end(producer, *(request(f"e-{m}", m) for m in mm_hashes))
    assert producer.worker.worker_delegate.flush(20)
    return {m: out.ec_transfer_params[m] for s in steps for out in s.finished.values()
            for m in (out.ec_transfer_params or {})}


def writes(path: str, offset: int, data: bytes) -> None:
    """Another process (any engine worker maps the region read-write) writes
    `data` at `offset` of the region file."""
    code = ("import os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
            "os.pwrite(fd, bytes.fromhex(sys.argv[3]), int(sys.argv[2])); os.close(fd)")
    subprocess.run([sys.executable, "-c", code, path, str(offset), data.hex()], check=True,
                   timeout=60)


def scribble(engine: Any, mm_hash: str) -> Any:
    """64 bytes of the cached entry rewritten by another process; its view entry."""
    entry = engine.connector.scheduler_delegate.view.get(mm_hash)
    region = engine.connector.scheduler_delegate.link.attachment.region
    writes(region.path, entry.extents[0][0] + 256, bytes(range(64)))
    return entry


def restamp(engine: Any, mm_hash: str) -> Any:
    """One page of the cached entry stamped for another entry by another process."""
    entry = engine.connector.scheduler_delegate.view.get(mm_hash)
    region = engine.connector.scheduler_delegate.link.attachment.region
    page = (entry.extents[0][0] - region.data_offset) // region.page_bytes
    writes(region.path, 8 * page, (entry.entry_id + 1000).to_bytes(8, "little"))
    return entry


def cached(engine: Any, *mm_hashes: str) -> None:
    view = engine.connector.scheduler_delegate.view
    h.wait_until(lambda: all(view.get(m) is not None for m in mm_hashes))


def ready_entry(daemon: Any, engine: Any, mm_hash: str) -> int:
    """The id of the key's ready entry in the daemon; 0 when it has none."""
    namespace = engine.connector.scheduler_delegate.link.attachment.namespace
    (result,) = daemon.stub.Lookup(pb.LookupRequest(namespace=namespace, mm_hashes=[mm_hash]),
                                   timeout=5).results
    return int(result.entry.entry_id) if result.state == pb.READY else 0


def finish_reasons(steps: list[sh.Step]) -> dict[str, Any]:
    return {r: out.finish_reason for s in steps for r, out in s.finished.items()}


@pytest.mark.parametrize("how", ["bytes", "stamp"])
def test_an_entry_another_process_changed_is_refused_re_encoded_and_saved_again(engines,
                                                                               daemon, how):
    produced(engines, "img-good", "img-bad")
    engine = engines("ec_both", "victim", ec_daemon_verify_checksum=True)
    cached(engine, "img-good", "img-bad")
    bad = (scribble if how == "bytes" else restamp)(engine, "img-bad")

    steps = sh.run_to_end(engine, request("r1", "img-good"), request("r2", "img-bad"))
    assert sh.adopted(steps) == ["img-good"]  # the other load is refused
    assert [m for s in steps for m in s.encoded] == ["img-bad"]  # its request encodes it
    assert finish_reasons(steps) == {"r1": FinishReason.LENGTH, "r2": FinishReason.LENGTH}
    assert torch.equal(engine.encoder_cache["img-bad"], sh.encode("img-bad"))
    if engine.connector.scheduler_delegate.workers_run_idle_steps:  # (else staged here)
        stats = engine.worker.worker_delegate.stats
        assert stats[f"loads_{'checksum' if how == 'bytes' else 'stamp'}_mismatch"] == 1
    # Told, the daemon checks the pages and hides the entry, so the next save
    # of the key lands (another engine's encode here), and loads bit-exact.
    daemon.wait_for(lambda: daemon.stats()["checksum_mismatches"] == 1,
                    what="the daemon's check of the report")
    # (The victim's own save of what it encoded may land as soon as the entry
    # is gone: that is a next save too.)
    daemon.wait_for(lambda: ready_entry(daemon, engine, "img-bad") != bad.entry_id,
                    what="hidden")
    again = engines("ec_producer", "encoder-2")
    assert [m for s in sh.run_to_end(again, request("e2", "img-bad")) for m in s.encoded] == [
        "img-bad"]
    assert again.worker.worker_delegate.flush(20)
    daemon.wait_for(lambda: ready_entry(daemon, engine, "img-bad") not in (0, bad.entry_id),
                    what="saved again")
    other = engines("ec_consumer", "another", ec_daemon_verify_checksum=True)
    cached(other, "img-bad")
    assert other.connector.scheduler_delegate.view.get("img-bad").entry_id != bad.entry_id
    steps = sh.run_to_end(other, request("r3", "img-bad"))
    assert sh.adopted(steps) == ["img-bad"] and [s.encoded for s in steps] == [[]] * len(steps)
    assert torch.equal(other.encoder_cache["img-bad"], sh.encode("img-bad"))


def test_a_request_without_media_whose_load_was_refused_fails_and_the_engine_goes_on(engines):
    params = produced(engines, "img-e")
    consumer = engines("ec_consumer", "pd", ec_daemon_verify_checksum=True)
    cached(consumer, "img-e")
    scribble(consumer, "img-e")
    steps = sh.run_to_end(consumer, request("p1", "img-e", data=MultiModalKwargsItem({}),
                                         ec_transfer_params={"img-e": params["img-e"]}))
    assert finish_reasons(steps) == {"p1": FinishReason.ERROR}
    assert [m for s in steps for m in s.encoded] == [] and sh.adopted(steps) == []
    assert "img-e" not in consumer.encoder_cache
    steps = sh.run_to_end(consumer, request("p2", "img-other"))  # the engine goes on
    assert [m for s in steps for m in s.encoded] == ["img-other"]
    assert finish_reasons(steps) == {"p2": FinishReason.LENGTH}


def test_a_load_refused_for_any_other_reason_costs_its_request_only(engines, monkeypatch):
    """Here the copy backend refuses it (as a device out of memory might),
    while another request decodes (so every step has tokens: the workers
    stage whatever runner runs them)."""
    produced(engines, "img-a", "img-b")
    engine = engines("ec_consumer", "refusing",
                     ec_daemon_copy_backend="tests.vllm.failing_copy:FailingLoadBackend")
    cached(engine, "img-a", "img-b")
    engine.scheduler.add_request(request("busy", "img-busy", max_tokens=8))
    engine.step()  # encodes img-busy; the request then decodes
    monkeypatch.setattr(FailingLoadBackend, "fail_next", 1)  # the first load of the step
    steps = sh.run_to_end(engine, request("r1", "img-a"), request("r2", "img-b"))
    assert sh.staged(steps) == ["img-a", "img-b"] and sh.adopted(steps) == ["img-b"]
    assert [m for s in steps for m in s.encoded] == ["img-a"]  # refused: encoded instead
    assert torch.equal(engine.encoder_cache["img-a"], sh.encode("img-a"))
    assert finish_reasons(steps) == {"busy": FinishReason.LENGTH, "r1": FinishReason.LENGTH,
                                     "r2": FinishReason.LENGTH}
    assert engine.worker.worker_delegate.staging.bytes == 0
