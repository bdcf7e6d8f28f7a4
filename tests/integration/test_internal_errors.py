"""A bug in a handler is answered INTERNAL and logged with its stack, on the
unary calls and on the session stream alike, and the daemon keeps serving.

Nothing a client sends can make the core raise anything but its own domain
errors (that is what the fuzz tests check), so a bug is simulated: the
daemon is served in this process (`server.serve`, on a real Unix socket and
region, exactly as the CLI serves it) with two core methods replaced by
ones that raise. The product has no test hook for this.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from typing import Any

import grpc
import pytest

from ec_daemon.core.cache import Cache
from ec_daemon.core.views import Views
from ec_daemon.serving import config
from ec_daemon.serving.server import serve
from ec_protocol.protocol import Layout, pb, rpc
from tests.integration.daemon import short_tmpdir
from tests.integration.raw import RawStream, attach

pytestmark = pytest.mark.integration
LAYOUT = Layout("bug-model", "uint8", {"image": 64})


class Bug(Exception):
    """What a bug in the core might raise."""


def _raise_bug(*args: Any, **kwargs: Any) -> Any:
    raise Bug("simulated bug in the cache")


def daemon_config(socket: str, shm_dir: str) -> config.DaemonConfig:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_namespace(parser.parse_args(
        ["--cpu-bytes", "8MiB", "--socket", socket, "--shm-dir", shm_dir,
         "--check-invariants", "true", "--on-exit", "remove"]))


def serve_while(socket: str, shm_dir: str, client: Any) -> None:
    """Serve the daemon on this (main) thread while `client(stub)` runs in
    another; stops the daemon when the client is done."""
    errors: list[BaseException] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def run_client() -> None:
            try:
                with grpc.insecure_channel(socket) as channel:
                    stub = rpc.ECDaemonStub(channel)
                    grpc.channel_ready_future(channel).result(timeout=30)
                    client(stub)
            except BaseException as exc:
                errors.append(exc)
            finally:
                loop.call_soon_threadsafe(stop.set)

        thread = threading.Thread(target=run_client, daemon=True)
        thread.start()
        await serve(daemon_config(socket, shm_dir), stop=stop)
        thread.join(10)

    asyncio.run(main())
    if errors:
        raise errors[0]


# Protects: one error map for the whole service: a bug is never answered
# with a misleading status (or a clean end of stream), and its stack is in the log.
def test_bugs_are_internal_and_logged_with_their_stack(monkeypatch, caplog, shm_folder):
    monkeypatch.setattr(Cache, "lookup", _raise_bug)
    monkeypatch.setattr(Views, "touch", _raise_bug)  # (a view's touches: the stream)
    caplog.set_level(logging.INFO, logger="ec_daemon")
    folder = short_tmpdir()
    seen: dict[str, Any] = {}

    def client(stub: Any) -> None:
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(pb.LookupRequest(namespace="n", mm_hashes=["h"]), timeout=10)
        seen["unary"] = info.value.code(), info.value.details()
        view = attach(stub, LAYOUT, rank=None)
        stream = RawStream(stub, view.session_id)
        try:
            assert stream.next(10).snapshot_done
            stream.send(touches=[pb.Touch(mm_hash="h", entry_id=1)])
            deadline = time.monotonic() + 10
            while stream.next(10) is not None and time.monotonic() < deadline:
                pass  # until the stream ends
            assert stream.error is not None, "the stream ended without a status"
            seen["stream"] = stream.error.code(), stream.error.details()
        finally:
            stream.close()
        seen["stats"] = stub.Stats(pb.StatsRequest(), timeout=10).sessions  # still serving

    try:
        serve_while(f"unix://{folder}/ec.sock", str(shm_folder), client)
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()

    for call in ("unary", "stream"):
        code, details = seen[call]
        assert code == grpc.StatusCode.INTERNAL, (call, code, details)
        assert "Bug: simulated bug in the cache" in details
    assert seen["stats"] == 0  # the broken stream's session ended
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert len(logged) == 2, [r.getMessage() for r in caplog.records]
    for record in logged:
        assert record.getMessage().startswith("internal error")
        assert record.exc_info is not None and record.exc_info[0] is Bug
        assert "_raise_bug" in caplog.text  # the stack, down to the raising frame
