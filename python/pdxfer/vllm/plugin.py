"""vLLM general plugin (entry point group ``vllm.general_plugins``): registers
``PdxferConnector`` with vLLM's ``KVConnectorFactory`` so that
``"kv_connector":"PdxferConnector"`` selects it without a module path. vLLM
may load plugins more than once a process: registering twice is a no-op."""

from __future__ import annotations

NAME = "PdxferConnector"


def register() -> None:
    """Registers the connector (lazily imported by vLLM on first use)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "pdxfer.vllm", NAME)
