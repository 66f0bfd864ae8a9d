"""vLLM 0.33 KV connector over pdxfer (MLA models): select it with

    --kv-transfer-config '{"kv_connector":"PdxferConnector","kv_connector_module_path":"pdxfer.vllm",
                           "kv_role":"kv_producer","kv_connector_extra_config":{"bootstrap_port":8998}}'

or, with pdxfer installed, by name alone (``"kv_connector":"PdxferConnector"``):
its ``vllm.general_plugins`` entry point registers it with vLLM's
``KVConnectorFactory``. See docs/vllm.md.

The connector classes import vLLM, so they load on first use
(``pdxfer.vllm.PdxferConnector``); ``pdxfer.vllm.config`` needs no vLLM.
"""

from typing import Any

__all__ = ["PdxferConnector", "PdxferConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'pdxfer.vllm' has no attribute {name!r}")
