"""The README's quick start with a real engine: the daemon `make run` starts,
then `vllm serve` with the README's --ec-transfer-config exactly as written
(no socket: both sides' default), run by the same user. A second engine
started the same way hits what the first saved: it runs its encoder on no
image, and its outputs equal an engine's without the connector."""

from __future__ import annotations

import pytest

from tests.readme import command, quick_start_commands, quick_start_daemon, transfer_config
from tests.vllm.engine_proc import A, B, run_engine, same_output

pytestmark = pytest.mark.timeout(1200)


def test_the_readmes_blocks_pasted_in_order_give_an_engine_that_hits(tiny_model, reference):
    config = transfer_config(command(quick_start_commands(), "vllm", "serve"))
    with quick_start_daemon() as daemon:
        # The user's environment: the daemon's XDG_RUNTIME_DIR, no EC_DAEMON_SOCKET.
        env = {"XDG_RUNTIME_DIR": daemon.env["XDG_RUNTIME_DIR"], "EC_DAEMON_SOCKET": ""}
        first = run_engine(tiny_model, [A, B], transfer_config=config, env=env)
        assert first["encoder_images"] == 2, first["output"][-3000:]
        second = run_engine(tiny_model, [A, B], transfer_config=config, env=env)
        assert second["encoder_images"] == 0, second["output"][-3000:]
        for image in (A, B):
            assert same_output(second["results"][image], reference[image])
        assert "not attached to the daemon" not in first["output"] + second["output"]
