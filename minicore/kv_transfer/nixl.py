"""NixlConnector: prefill/decode disaggregation over NIXL, and its scheduler side.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py (NixlConnector,
NixlConnectorMetadata, NixlConnectorScheduler; vLLM 0.32 has split it into the nixl/ package):
the NixlConnector class dispatches to NixlConnectorScheduler (this file, pure Python) in the
scheduler role and to NixlConnectorWorker (nixl_worker.py, which imports NIXL, torch and zmq) in
the worker role; nixl_metadata.py has what both share.

The flow, as in vLLM: a proxy sends a request to the prefill instance with max_tokens=1 and
kv_transfer_params {"do_remote_decode": true}; when it finishes (length-capped), request_finished
holds its blocks (delay_free) with a deadline of abort_request_timeout seconds and returns
do_remote_prefill, remote_engine_id, remote_block_ids, remote_host, remote_port and
remote_request_id. The decode instance, given those, reports the prompt (beyond its own prefix hit)
as external tokens loaded asynchronously; its worker reads them from the prefill instance's blocks
and the prefill instance frees them when NIXL notifies it of the read (or at the deadline).
A request's kv_transfer_params are checked before the scheduler sees them (the classmethod
validate_kv_transfer_params, run by the InputProcessor and EngineCore.add_request).
Left out: host buffers (kv_buffer_device), hybrid/sliding-window and Mamba models, tensor
parallelism (tp_size is always 1), the HTTP handshake, connector stats.
"""

import logging
import time
from typing import TYPE_CHECKING, Any

from minicore.config import EngineConfig
from minicore.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from minicore.kv_transfer.nixl_metadata import (
    DEFAULT_ABORT_REQUEST_TIMEOUT_S,
    REMOTE_PREFILL_KEYS,
    NixlConnectorMetadata,
    allowed_remote_hosts,
    engine_id,
    side_channel,
    validate_nixl_params,
)
from minicore.request import Request, RequestStatus

if TYPE_CHECKING:
    from minicore.scheduler.kv_cache_manager import KVCacheBlocks
    from minicore.scheduler.output import KVConnectorOutput, SchedulerOutput

logger = logging.getLogger(__name__)

class NixlConnector(KVConnectorBase_V1):
    def __init__(self, config: EngineConfig, role: KVConnectorRole):
        super().__init__(config, role)
        allowed_remote_hosts(config.kv_transfer_config.kv_connector_extra_config)  # or ValueError
        self.connector_scheduler: NixlConnectorScheduler | None = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlConnectorScheduler(config)
        else:
            from minicore.kv_transfer.nixl_worker import NixlConnectorWorker

            self.connector_worker = NixlConnectorWorker(config)

    # ---- scheduler side ------------------------------------------------------------------------

    @classmethod
    def validate_kv_transfer_params(cls, params: dict[str, Any], num_prompt_tokens: int,
                                    block_size: int, kv_transfer_config) -> None:
        validate_nixl_params(params, num_prompt_tokens, block_size, allowed_remote_hosts(
            kv_transfer_config.kv_connector_extra_config))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> NixlConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def has_pending_requests(self) -> bool:
        return self.connector_scheduler.has_pending_requests()

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def has_load_in_flight(self, request_id: str) -> bool:
        return self.connector_scheduler.has_load_in_flight(request_id)

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        self.connector_worker.start_load_kv(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


class NixlConnectorScheduler:
    """The scheduler side: which requests read remote KV, which hold blocks for a peer."""

    def __init__(self, config: EngineConfig):
        kv_config = config.kv_transfer_config
        self.engine_id = engine_id(config)
        self.side_channel_host, self.side_channel_port = side_channel(config)
        self.abort_request_timeout = float(kv_config.get_from_extra_config(
            "abort_request_timeout", DEFAULT_ABORT_REQUEST_TIMEOUT_S))
        # Reads to start, by request id: the request and the local blocks to fill (none: only
        # notify the prefill side that it may free its blocks).
        self._reqs_need_recv: dict[str, tuple[Request, list[int]]] = {}
        # Requests whose blocks are held for a peer, with their deadlines, not yet sent to the
        # worker side.
        self._reqs_need_send: dict[str, float] = {}
        # Reads into local blocks queued for the worker side and not yet reported finished.
        self._reads_in_flight: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """With do_remote_prefill, every prompt token beyond the local prefix hit is remote, and
        arrives asynchronously."""
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            count = request.num_prompt_tokens - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # EngineCore.add_request refuses incomplete params (validate_nixl_params); this guards a
        # caller that went straight to Scheduler.add_request: no read, so the request is not
        # held for one (ConnectorRemoteKV computes its prompt after LOAD_START_TIMEOUT_S).
        if all(params.get(key) for key in REMOTE_PREFILL_KEYS):
            # The blocks not hit in the local prefix cache are the ones to read into.
            local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
            self._reqs_need_recv[request.request_id] = (request, local)
            if local:
                self._reads_in_flight.add(request.request_id)
        else:
            logger.warning("Got invalid kv_transfer_params %s: request %s will not use KV "
                           "transfer", params, request.request_id)
        # One transfer per request: a preempted request recomputes.
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata()
        for req_id, (request, block_ids) in self._reqs_need_recv.items():
            meta.add_new_req(req_id, block_ids, request.kv_transfer_params)
        meta.reqs_to_send = self._reqs_need_send
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted) before its read was set up: tell the prefill side, with no
            # blocks to read, so that it frees its own at once instead of at its deadline.
            self._reqs_need_recv[request.request_id] = (request, [])
            params["do_remote_prefill"] = False
            return False, None
        if (not params.get("do_remote_decode")
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED):
            # Not a prefill for a peer, or one that stopped early or was aborted: free now.
            return False, None
        delay_free = bool(block_ids)
        if delay_free:
            self._reqs_need_send[request.request_id] = (time.perf_counter()
                                                        + self.abort_request_timeout)
        return delay_free, dict(
            do_remote_prefill=True, do_remote_decode=False, remote_block_ids=block_ids,
            remote_engine_id=self.engine_id, remote_request_id=request.request_id,
            remote_host=self.side_channel_host, remote_port=self.side_channel_port, tp_size=1)

    def has_pending_requests(self) -> bool:
        return bool(self._reqs_need_recv) or bool(self._reqs_need_send)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        # A read reported finished (done or failed) writes no more.
        self._reads_in_flight.difference_update(connector_output.finished_recving or ())

    def has_load_in_flight(self, request_id: str) -> bool:
        return request_id in self._reads_in_flight
