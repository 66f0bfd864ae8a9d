"""vLLM 0.33 KV connector over pdxfer (MLA models): select it with

    --kv-transfer-config '{"kv_connector":"PdxferConnector","kv_connector_module_path":"pdxfer.vllm",
                           "kv_role":"kv_producer","kv_connector_extra_config":{"bootstrap_port":8998}}'

or, with pdxfer installed, by name alone (``"kv_connector":"PdxferConnector"``):
its ``vllm.general_plugins`` entry point registers it with vLLM's
``KVConnectorFactory``. See docs/vllm.md.
"""

from .connector import PdxferConnector, PdxferConnectorMetadata

__all__ = ["PdxferConnector", "PdxferConnectorMetadata"]
