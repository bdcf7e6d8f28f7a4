"""The vLLM plugin (ec_client.vllm_plugin): `"ec_connector": "ECDaemonConnector"`
with no `ec_connector_module_path`, as vLLM loads it."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

from ec_client.vllm_connector import ECDaemonConnector
from tests.vllm.engine_proc import A, B, run_engine
from tests.vllm.scheduler_harness import reported

pytestmark = pytest.mark.timeout(1200)


def test_the_entry_point_registers_the_connector_by_name_once_or_many_times():
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "ec_daemon"]
    register = plugin.load()
    register()
    register()  # vLLM may load plugins more than once in a process
    named = ECTransferConfig(ec_connector="ECDaemonConnector", ec_role="ec_both")
    assert ECConnectorFactory.get_connector_class(named) is ECDaemonConnector
    with_path = ECTransferConfig(ec_connector="ECDaemonConnector", ec_role="ec_both",
                                 ec_connector_module_path="ec_client.vllm_connector")
    assert ECConnectorFactory.get_connector_class(with_path) is ECDaemonConnector


def test_a_real_engine_runs_the_connector_with_no_module_path(tiny_model, daemon):
    """A producer engine configured by name only: vLLM's plugin loading
    finds the connector; it saves both images and reports vLLM's
    `ec_transfer_params` for each request (item 3, end to end)."""
    result = run_engine(tiny_model, [A, B], socket=daemon.socket, role="ec_producer",
                        connector="ECDaemonConnector")
    assert "ECDaemonConnector SCHEDULER" in result["output"]
    assert [r["encoder_images"] for r in result["requests"]] == [1, 1]
    daemon.wait_for(lambda: daemon.stats()["saves"] == 2, what="both saves")
    hashes = set()
    for request in result["requests"]:
        ((mm_hash, item),) = request["ec_transfer_params"].items()
        assert reported(item)
        hashes.add(mm_hash)
    assert len(hashes) == 2
