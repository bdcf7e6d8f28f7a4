"""vLLM plugin: `"ec_connector": "ECDaemonConnector"` with no module path.

vLLM runs every `vllm.general_plugins` entry point (pyproject.toml) in each of
its processes before it builds connectors; `register` adds the connector to
vLLM's `ECConnectorFactory` by name, lazily (the connector's module, and
torch with it, is imported only when an engine asks for it). A config that
also names `ec_connector_module_path` keeps working: vLLM's factory prefers
its registry. vLLM may run plugins more than once in one process, so a
second registration is a no-op.
"""

from __future__ import annotations

CONNECTOR_NAME = "ECDaemonConnector"
CONNECTOR_MODULE = "ec_client.vllm_connector"


def register() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if CONNECTOR_NAME in ECConnectorFactory._registry:  # vLLM has no public query for it
        return
    ECConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
