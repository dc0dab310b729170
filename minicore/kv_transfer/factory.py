"""KVConnectorFactory: build the connector that kv_transfer_config names, in one role.

Mirrors vllm/distributed/kv_transfer/kv_connector/factory.py: connectors are registered by name
with the module that defines them, and imported only when built, so that an engine without a
connector imports none of them (nor NIXL). A connector minicore does not ship is found through
kv_connector_module_path, as in vLLM. Left out: the v0 connectors and the per-connector
compatibility checks of vLLM's factory.
"""

import importlib

from minicore.config import EngineConfig
from minicore.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from minicore.kv_transfer.config import KVTransferConfig

# name -> (module, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "NixlConnector": ("minicore.kv_transfer.nixl", "NixlConnector"),
}


class KVConnectorFactory:
    @staticmethod
    def create_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase_V1:
        kv_config = config.kv_transfer_config
        if kv_config is None:
            raise ValueError("no kv_transfer_config: this engine runs no KV connector")
        return KVConnectorFactory.get_connector_class(kv_config)(config, role)

    @staticmethod
    def get_connector_class(kv_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        """The class kv_config names, imported, unbuilt (the frontend checks a request's
        kv_transfer_params with its classmethod validate_kv_transfer_params)."""
        name = kv_config.kv_connector
        if kv_config.kv_connector_module_path:
            module_name, class_name = kv_config.kv_connector_module_path, name
        else:
            module_name, class_name = _REGISTRY[name]
        cls = getattr(importlib.import_module(module_name), class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
            raise ValueError(f"{module_name}.{class_name} is not a KVConnectorBase_V1 subclass")
        return cls
