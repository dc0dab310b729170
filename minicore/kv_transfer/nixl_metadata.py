"""What NixlConnector's scheduler side and worker side share: the per-step metadata, this
engine's id and side channel address, the defaults, and the check of a request's
kv_transfer_params (validate_nixl_params: the frontend and the engine run it before the scheduler
sees the request, so the scheduler and worker sides read checked values).

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py (ReqMeta,
NixlConnectorMetadata) and the side-channel settings of vllm/envs.py, reduced to one read per
request and no tensor-parallel or hybrid-model fields; vLLM checks no kv_transfer_params (a bad
one fails inside its scheduler). Pure Python.
"""

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from minicore.config import EngineConfig
from minicore.kv_transfer.base import KVConnectorMetadata
from minicore.sampling_checks import check_text

# vLLM's defaults: VLLM_NIXL_SIDE_CHANNEL_HOST/PORT and VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s).
DEFAULT_SIDE_CHANNEL_HOST = "localhost"
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_ABORT_REQUEST_TIMEOUT_S = 480.0
# minicore's: how long a decode instance's READ may stay in flight before it is cancelled and the
# request recomputes (a READ of a prompt's blocks takes milliseconds; a stopped peer, for ever).
DEFAULT_READ_TIMEOUT_S = 30.0
# The prefill peers a decode instance reads KV from unless kv_connector_extra_config's
# allowed_remote_hosts says otherwise: this machine only. A request names its peer, so without a
# list anyone who reaches the decode instance could make it connect anywhere.
DEFAULT_ALLOWED_REMOTE_HOSTS = ("localhost", "127.0.0.0/8", "::1")


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
        """params: a request's kv_transfer_params, as validate_nixl_params passed them."""
        self.reqs_to_recv[request_id] = ReqMeta(
            local_block_ids, params["remote_block_ids"], params["remote_engine_id"],
            params["remote_host"], params["remote_port"], params["remote_request_id"])


# What a decode request (do_remote_prefill) must carry: where the prefill instance holds the
# prompt's blocks and how to reach it (NixlConnectorScheduler.request_finished returns them).
REMOTE_PREFILL_KEYS = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port",
                       "remote_request_id")
# A host name or an IP address (IPv6 with its brackets or zone): it becomes tcp://host:port.
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")
# Ids travel in the handshake and as NIXL's notification: no need for more.
MAX_ID_CHARS = 1024
# Block ids index NIXL descriptor lists as int64 (region * num_blocks + id): far below overflow.
MAX_BLOCK_ID = 2**31 - 1


def allowed_remote_hosts(extra_config: dict[str, Any]) -> tuple[str, ...]:
    """kv_connector_extra_config's allowed_remote_hosts: host names, IP addresses or networks
    (CIDR), or "*" for any; ValueError naming the key if it is anything else."""
    hosts = extra_config.get("allowed_remote_hosts", DEFAULT_ALLOWED_REMOTE_HOSTS)
    if not isinstance(hosts, list | tuple) or not all(
            isinstance(h, str) and (h == "*" or _HOST.fullmatch(h) or _network(h))
            for h in hosts):
        raise ValueError("kv_transfer_config: kv_connector_extra_config.allowed_remote_hosts must "
                         'be a list of host names, IP addresses or networks (or ["*"] for any), '
                         f"got {hosts!r}")
    return tuple(hosts)


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(text.strip("[]").partition("%")[0], strict=False)
    except ValueError:
        return None


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    if "*" in allowed or host.lower() in (a.lower() for a in allowed):  # names ignore case
        return True
    address = _network(host)
    return address is not None and address.num_addresses == 1 and any(
        (net := _network(a)) is not None and address.version == net.version
        and address.network_address in net for a in allowed)


def validate_nixl_params(params: dict[str, Any], num_prompt_tokens: int, block_size: int,
                         allowed_hosts: tuple[str, ...] = DEFAULT_ALLOWED_REMOTE_HOSTS) -> None:
    """ValueError naming the key unless NixlConnector can act on these kv_transfer_params: the
    flags are booleans (or null); with do_remote_prefill every key of REMOTE_PREFILL_KEYS is there
    and remote_block_ids is not empty; a key that is given has its type and range (a port in
    [1, 65535], at most ceil(prompt / block_size) block ids, each in [0, 2**31)). Null stands for
    absent (vLLM's proxies send the remote_* keys as null to a prefill instance); other keys are
    ignored, as NixlConnector ignores them."""
    for key in ("do_remote_prefill", "do_remote_decode"):
        if params.get(key) is not None and not isinstance(params[key], bool):
            raise ValueError(f"kv_transfer_params.{key} must be a boolean, got {params[key]!r}")
    if params.get("do_remote_prefill"):
        for key in REMOTE_PREFILL_KEYS:
            if params.get(key) is None:
                raise ValueError(f"kv_transfer_params.{key} is required with do_remote_prefill "
                                 f"(needed: {', '.join(REMOTE_PREFILL_KEYS)})")
        if not params["remote_block_ids"]:
            raise ValueError("kv_transfer_params.remote_block_ids must not be empty with "
                             "do_remote_prefill")
    if (block_ids := params.get("remote_block_ids")) is not None:
        _check_block_ids(block_ids, -(-num_prompt_tokens // block_size))
    if (port := params.get("remote_port")) is not None and (
            type(port) is not int or not 1 <= port <= 65535):
        raise ValueError(f"kv_transfer_params.remote_port must be an integer in [1, 65535], "
                         f"got {port!r}")
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        if (value := params.get(key)) is not None:
            _check_id(key, value)
    if (host := params.get("remote_host")) is not None and not _HOST.fullmatch(host):
        raise ValueError(f"kv_transfer_params.remote_host must be a host name or an IP address, "
                         f"got {repr(host)[:64]}")
    if params.get("do_remote_prefill") and not _host_allowed(params["remote_host"], allowed_hosts):
        raise ValueError(f"kv_transfer_params.remote_host {params['remote_host']!r} is not a "
                         f"prefill peer this instance reads from ({', '.join(allowed_hosts)}; "
                         "kv_connector_extra_config.allowed_remote_hosts in --kv-transfer-config)")
    if (tp_size := params.get("tp_size")) is not None and (type(tp_size) is not int
                                                           or tp_size != 1):
        raise ValueError(f"kv_transfer_params.tp_size must be 1 (minicore has no tensor "
                         f"parallelism), got {tp_size!r}")


def _check_block_ids(block_ids, max_blocks: int) -> None:
    if not isinstance(block_ids, list | tuple):
        raise ValueError(f"kv_transfer_params.remote_block_ids must be a list of block ids, got "
                         f"{type(block_ids).__name__}")
    if len(block_ids) > max_blocks:
        raise ValueError(f"kv_transfer_params.remote_block_ids has {len(block_ids)} block ids: "
                         f"the prompt fills at most {max_blocks} blocks")
    if bad := [b for b in block_ids if type(b) is not int or not 0 <= b <= MAX_BLOCK_ID]:
        raise ValueError(f"kv_transfer_params.remote_block_ids must hold integers in "
                         f"[0, {MAX_BLOCK_ID}], got {bad[0]!r}")


def _check_id(key: str, value) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise ValueError(f"kv_transfer_params.{key} must be a string of 1 to {MAX_ID_CHARS} "
                         f"characters, got {repr(value)[:64]}")
    check_text(f"kv_transfer_params.{key}", value)


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
