"""KVTransferConfig: which KV connector an engine runs, in which role (--kv-transfer-config).

Mirrors vllm/config/kv_transfer.py (KVTransferConfig) with the fields a NixlConnector needs:
kv_connector, kv_role, engine_id, kv_connector_extra_config, kv_connector_module_path. Left out:
kv_buffer_device/size, kv_rank, kv_parallel_size, kv_ip/kv_port (NIXL's side channel is set in
kv_connector_extra_config, where vLLM reads VLLM_NIXL_SIDE_CHANNEL_HOST/PORT from the
environment). Pure Python: minicore.config imports it.
"""

import uuid
from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Connectors built in; another one is named with kv_connector_module_path.
KNOWN_CONNECTORS = ("NixlConnector",)
LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(slots=True)
class KVTransferConfig:
    kv_connector: str | None = None
    # kv_producer: a prefill instance (sends its KV); kv_consumer: a decode instance (reads KV);
    # kv_both: either, as the request's kv_transfer_params say. NIXL's connector is the same code
    # in every role, as in vLLM.
    kv_role: str | None = None
    # This instance's name to its peers; unique per instance (vLLM: a uuid4 by default).
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    # NixlConnector: side_channel_host, side_channel_port (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST/PORT;
    # the port is offset by DP rank), abort_request_timeout (s, VLLM_NIXL_ABORT_REQUEST_TIMEOUT),
    # handshake_timeout (s), backends (NIXL backends, default ["UCX"]).
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # The module to import kv_connector from, for a connector minicore does not ship.
    kv_connector_module_path: str | None = None
    # What a decode instance does with a request whose KV could not be loaded (a read that
    # failed, or one that never started): "recompute" its prompt here, or "fail" it with an
    # error (for decode instances that must not spend their steps on prefills).
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self):
        if not self.kv_connector:
            raise ValueError("kv_transfer_config: kv_connector is required, e.g. "
                             '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
        if self.kv_connector not in KNOWN_CONNECTORS and not self.kv_connector_module_path:
            raise ValueError(f"kv_transfer_config: unknown kv_connector {self.kv_connector!r}: "
                             f"minicore ships {', '.join(KNOWN_CONNECTORS)}; name the module of "
                             "another one with kv_connector_module_path")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError("kv_transfer_config: kv_load_failure_policy must be one of "
                             f"{', '.join(LOAD_FAILURE_POLICIES)}, got "
                             f"{self.kv_load_failure_policy!r}")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"kv_transfer_config: engine_id must be a non-empty string, got "
                             f"{self.engine_id!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be a JSON object, "
                             f"got {self.kv_connector_extra_config!r}")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
