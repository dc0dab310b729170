"""What NixlConnector's scheduler side and worker side share: the per-step metadata, this
engine's id and side channel address, the defaults.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py (ReqMeta,
NixlConnectorMetadata) and the side-channel settings of vllm/envs.py, reduced to one read per
request and no tensor-parallel or hybrid-model fields. Pure Python.
"""

from dataclasses import dataclass, field
from typing import Any

from minicore.config import EngineConfig
from minicore.kv_transfer.base import KVConnectorMetadata

# vLLM's defaults: VLLM_NIXL_SIDE_CHANNEL_HOST/PORT and VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s).
DEFAULT_SIDE_CHANNEL_HOST = "localhost"
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_ABORT_REQUEST_TIMEOUT_S = 480.0


@dataclass(slots=True)
class ReqMeta:
    """One read for the worker: the local blocks to fill from the remote ones."""
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str


@dataclass(slots=True)
class NixlConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, ReqMeta] = field(default_factory=dict)
    # Requests whose blocks the prefill side holds, with the time.perf_counter() deadline after
    # which they are freed unread.
    reqs_to_send: dict[str, float] = field(default_factory=dict)

    def add_new_req(self, request_id: str, local_block_ids: list[int],
                    params: dict[str, Any]) -> None:
        self.reqs_to_recv[request_id] = ReqMeta(
            local_block_ids, list(params.get("remote_block_ids") or ()),
            params["remote_engine_id"], params["remote_host"], int(params["remote_port"]),
            params["remote_request_id"])


def side_channel(config: EngineConfig) -> tuple[str, int]:
    """(host, port) of this engine's handshake listener; the port is offset by the DP rank, as
    vLLM offsets VLLM_NIXL_SIDE_CHANNEL_PORT, so that the ranks of one instance do not collide."""
    extra = config.kv_transfer_config.kv_connector_extra_config
    port = int(extra.get("side_channel_port", DEFAULT_SIDE_CHANNEL_PORT))
    return (str(extra.get("side_channel_host", DEFAULT_SIDE_CHANNEL_HOST)),
            port + config.parallel_config.data_parallel_rank)


def engine_id(config: EngineConfig) -> str:
    """This engine's id to its peers: the configured one, with the DP rank when there are several
    (vLLM suffixes it the same way)."""
    base = config.kv_transfer_config.engine_id
    dp = config.parallel_config
    return f"{base}_dp{dp.data_parallel_rank}" if dp.data_parallel_size > 1 else base
