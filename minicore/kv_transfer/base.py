"""KVConnectorBase_V1: the interface between the engine and a KV connector, in its two roles.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/base.py. One connector class serves both
roles, as in vLLM: the engine builds it twice, once with KVConnectorRole.SCHEDULER (owned by the
Scheduler, which calls only the scheduler-side methods) and once with KVConnectorRole.WORKER (next
to the model runner, which calls only the worker-side methods). The two halves talk only through
the KVConnectorMetadata the scheduler side builds each step (SchedulerOutput.kv_connector_metadata)
and the KVConnectorOutput the worker side returns (ModelRunnerOutput.kv_connector_output).

Scheduler side, once: make_remote_kv, the Scheduler's component that calls the methods below
(minicore/kv_transfer/remote_kv.py; minicore's, where vLLM's scheduler calls them itself).
Scheduler side, per request:
  validate_kv_transfer_params a classmethod: ValueError, naming the key, for kv_transfer_params
                              the connector cannot act on (the InputProcessor and
                              EngineCore.add_request refuse the request, so the scheduler side
                              reads checked values)
  get_num_new_matched_tokens  how many prompt tokens beyond the local prefix hit come from
                              outside, and whether they arrive asynchronously (the request then
                              waits in WAITING_FOR_REMOTE_KVS with its blocks allocated)
  update_state_after_alloc    the blocks the scheduler allocated for them
  build_connector_meta        once per step: what the worker side must start
  request_finished            on finish: keep the blocks (delay_free) while a peer reads them, and
                              the kv_transfer_params to return to the client
  update_connector_output     once per step: what the worker side reported
  has_load_in_flight          whether a load may still be writing into a parked request's blocks
Worker side, per step:
  register_kv_caches          once, the paged KV cache tensors
  start_load_kv               before the forward: start this step's reads
  wait_for_save               after the forward (a connector that writes out KV waits here)
  get_finished                requests whose sends / receives completed since the last call
  get_block_ids_with_load_errors  blocks whose load failed (their requests recompute, or fail)
Pure Python: minicore.scheduler may import this module. Left out: layer-wise loading and saving
(wait_for_layer_load, save_kv_layer), the hybrid-allocator hooks, stats and KV events.
"""

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from minicore.kv_transfer.remote_kv import ConnectorRemoteKV

if TYPE_CHECKING:
    from minicore.config import EngineConfig, SchedulerConfig
    from minicore.request import Request
    from minicore.scheduler.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from minicore.scheduler.output import KVConnectorOutput, SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B903 (a base class to subclass, as in vLLM)
    """What the scheduler side tells the worker side in one step; each connector subclasses it."""


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    def __init__(self, config: "EngineConfig", role: KVConnectorRole):
        self._config = config
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def kv_transfer_config(self):
        return self._config.kv_transfer_config

    # ---- worker side ---------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound: start_load_kv runs between "
                               "bind_connector_metadata and clear_connector_metadata")
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The runner's paged KV cache, one tensor per layer (kv_cache_shape in
        minicore/model/kv_cache_interface.py). vLLM passes a dict by layer name."""
        return None

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start loading the KV of this step's metadata into the local blocks; it may complete
        after the call returns (get_finished reports it)."""

    def wait_for_save(self) -> None:
        """Block until this step's KV writes (if any) are done."""
        return None

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving): request ids whose send (the peer has read the
        held blocks, or they timed out) or receive completed since the last call.
        finished_req_ids: the requests finished since the previous step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose load failed since the last call; their requests recompute."""
        return set()

    def shutdown(self) -> None:
        """Release the connector's threads, sockets and registrations."""
        return None

    # ---- scheduler side ------------------------------------------------------------------------

    def make_remote_kv(self, kv_cache_manager: "KVCacheManager",
                       scheduler_config: "SchedulerConfig") -> ConnectorRemoteKV:
        """The component the Scheduler binds for this connector (its remote_kv), given the
        scheduler's KV blocks and settings."""
        return ConnectorRemoteKV(kv_cache_manager, scheduler_config, self)

    @classmethod
    def validate_kv_transfer_params(cls, params: dict[str, Any], num_prompt_tokens: int,
                                    block_size: int, kv_transfer_config) -> None:
        """ValueError, its message naming the key at fault, unless this connector, configured by
        kv_transfer_config, can act on a request's kv_transfer_params (num_prompt_tokens: the
        prompt's length; block_size: the KV cache's). A classmethod: the frontend checks with no
        connector built."""
        return None

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens available externally beyond num_computed_tokens, whether they load
        asynchronously, between steps). minicore's scheduler supports asynchronous loads only."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Called for every request the scheduler admits or parks, with all its blocks."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's metadata for the worker side; resets the per-step state."""

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params): whether the scheduler must hold the request's blocks
        until get_finished reports the request in finished_sending, and the params to return
        to the client with the request's last output."""
        return False, None

    def has_pending_requests(self) -> bool:
        """Whether the scheduler side holds state the worker side has not been sent yet (a
        notification to a peer, say): the engine keeps stepping while it does."""
        return False

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """What the worker side reported for the step (finished sends and receives, failed
        loads), after the scheduler's update."""
        return None

    def has_load_in_flight(self, request_id: str) -> bool:
        """Whether a load into this parked request's blocks may still be under way: handed to
        the worker side and not yet reported in finished_recving. The scheduler frees an aborted
        parked request's blocks at once when none is, and computes the prompt of one left parked
        with none itself (ConnectorRemoteKV.LOAD_START_TIMEOUT_S). True unless a connector knows
        better: its loads then end only when the worker side reports them."""
        return True
