"""The scheduler's side of a KV connector: requests parked while their KV is loaded from another
instance, blocks held while another instance reads them, and load failures.

Mirrors the KV-connector parts of vllm/v1/core/sched/scheduler.py: the connector calls of
schedule() and _free_request, the load_kv_async branch (here ConnectorRemoteKV.park),
_update_waiting_for_remote_kv, _update_from_kv_xfer_finished and _handle_invalid_blocks. The
Scheduler binds it at construction when it has a connector (the seam and its do-nothing default:
minicore/scheduler/interfaces.py), and calls it at fixed points.

Request states (decode side, the consumer):
  WAITING --get_num_new_matched_tokens > 0--> WAITING_FOR_REMOTE_KVS, blocks allocated (not yet in
  the prefix cache), outside the waiting queue (vLLM keeps it in the queue and skips it each step)
  --finished_recving--> front of the waiting queue with num_computed_tokens = prompt - 1, so that
  the request computes only its last prompt token itself and samples from it.
  A load that failed (invalid_block_ids) keeps the valid prefix and recomputes the rest.
  A parked request with no load in flight (connector.has_load_in_flight) after
  LOAD_START_TIMEOUT_S computes its prompt itself, as after a failed load; aborted, its blocks are
  freed at once, since nothing can be writing into them (vLLM waits for a load that never comes).
  With kv_load_failure_policy "fail" either failure ends the request with an error instead, at
  the step's update (vLLM's FINISHED_ERROR), its blocks held while a load may still write them.
Prefill side (the producer): a finished request whose connector says delay_free stays in
Scheduler.requests, its blocks held, until get_finished reports it in finished_sending (the peer
has read them, or the connector's timeout expired); has_requests() keeps the engine stepping.
EngineCore.add_request refuses a request whose kv_transfer_params the connector cannot act on
(validate_request), so that no request's params raise inside schedule().
Left out: synchronous external loads (minicore's connectors load asynchronously only),
connector prefix-cache stats.
"""

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from minicore.protocol import EngineCoreOutput, FinishReason
from minicore.request import Request, RequestStatus
from minicore.scheduler.interfaces import NoRemoteKV
from minicore.scheduler.output import KVConnectorOutput

if TYPE_CHECKING:
    from minicore.config import SchedulerConfig
    from minicore.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata
    from minicore.scheduler.kv_cache_manager import KVCacheManager
    from minicore.scheduler.kv_cache_utils import KVCacheBlock
    from minicore.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


class ConnectorRemoteKV(NoRemoteKV):
    """The scheduler's calls into its KV connector, and the requests parked for remote KV."""

    # How long a parked request may wait for its load to start before it computes its prompt
    # itself. A connector starts a load within a step of parking (NixlConnector: at once, bounded
    # by its handshake_timeout); one that never starts leaves the request nothing else to wait for.
    LOAD_START_TIMEOUT_S = 30.0

    def __init__(self, kv_cache_manager: "KVCacheManager", scheduler_config: "SchedulerConfig",
                 connector: "KVConnectorBase_V1"):
        self.kv_cache_manager = kv_cache_manager
        self.reserve_full_isl = scheduler_config.scheduler_reserve_full_isl
        self.connector = connector
        self.load_start_timeout = self.LOAD_START_TIMEOUT_S
        # Parked requests by id, in the order they were parked.
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        # Parked requests with the time.monotonic() by which their load must be in flight: in
        # park order, so the earliest deadline comes first.
        self.load_deadlines: dict[str, float] = {}
        # Reported by the worker side since the last schedule(): their KV is in (or failed).
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self.recompute_failed_loads = (
            connector.kv_transfer_config.kv_load_failure_policy == "recompute")
        # Under the "fail" policy: parked requests whose load failed, with why, to be ended with
        # an error at the next update.
        self.failed_loads: dict[str, str] = {}

    def validate_request(self, request: Request) -> None:
        if request.kv_transfer_params is not None:
            self.connector.validate_kv_transfer_params(
                request.kv_transfer_params, request.num_prompt_tokens,
                self.kv_cache_manager.block_size, self.connector.kv_transfer_config)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        num_external, load_async = self.connector.get_num_new_matched_tokens(request,
                                                                             num_computed_tokens)
        if num_external > 0 and not load_async:
            raise NotImplementedError("minicore's scheduler loads external KV asynchronously "
                                      "only: get_num_new_matched_tokens must return (n, True)")
        return num_external

    def park(self, request: Request, computed_blocks: "Sequence[KVCacheBlock]",
             num_computed: int, num_external: int) -> bool:
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_external, num_computed, computed_blocks,
                             self.reserve_full_isl, delay_cache_blocks=True) is None:
            return False
        kv.record_prefix_cache_query(request.num_tokens, num_computed)
        self.connector.update_state_after_alloc(request, kv.get_blocks(request.request_id),
                                                num_external)
        # Not loaded yet; nothing reads it before the KV arrives, and a failed load lowers it.
        request.num_computed_tokens = num_computed + num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = request
        self.load_deadlines[request.request_id] = time.monotonic() + self.load_start_timeout
        return True

    def update_state_after_alloc(self, request: Request) -> None:
        blocks = self.kv_cache_manager.get_blocks(request.request_id)
        self.connector.update_state_after_alloc(request, blocks, 0)

    def request_finished(self, request: Request, output: EngineCoreOutput | None) -> bool:
        delay_free = False
        req_id = request.request_id
        if self.waiting_for_remote_kvs.pop(req_id, None) is not None:
            # Parked (an abort): its blocks wait for a load that may still be writing them.
            delay_free = (req_id not in self.finished_recving_kv_req_ids
                          and self.connector.has_load_in_flight(req_id))
            self.finished_recving_kv_req_ids.discard(req_id)
            self.failed_recving_kv_req_ids.discard(req_id)
            self.load_deadlines.pop(req_id, None)
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        connector_delay_free, params = self.connector.request_finished(request, block_ids)
        if output is not None:
            output.kv_transfer_params = params
        return delay_free or connector_delay_free

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> "KVConnectorMetadata":
        return self.connector.build_connector_meta(scheduler_output)

    def promote_received(self) -> list[Request]:
        """The requests whose KV arrived, latest first, so that prepended one by one the
        earliest leads the queue: they hold their blocks already."""
        if self.load_deadlines and next(iter(self.load_deadlines.values())) <= time.monotonic():
            self._stop_waiting_for_loads_never_started()
        if not self.finished_recving_kv_req_ids:
            return []
        received = [self.waiting_for_remote_kvs.pop(req_id)
                    for req_id in self.finished_recving_kv_req_ids]
        for req_id in self.finished_recving_kv_req_ids:
            self.load_deadlines.pop(req_id, None)
        self.finished_recving_kv_req_ids.clear()
        received.sort(key=lambda r: r.arrival_time, reverse=True)
        for request in received:
            self._update_waiting_for_remote_kv(request)
            request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                              else RequestStatus.WAITING)
        return received

    def _stop_waiting_for_loads_never_started(self) -> None:
        """Parked requests past their deadline with no load in flight compute their prompt
        themselves, as after a load that failed entirely. One with a load in flight is watched
        no longer: its load ends with a report from the worker side."""
        now = time.monotonic()
        expired = []
        for req_id, deadline in self.load_deadlines.items():
            if deadline > now:
                break
            expired.append(req_id)
        for req_id in expired:
            del self.load_deadlines[req_id]
            if self.connector.has_load_in_flight(req_id):
                continue
            why = f"its KV load did not start within {self.load_start_timeout:g} s"
            if self._load_failed(self.waiting_for_remote_kvs[req_id], 0, why):
                self.finished_recving_kv_req_ids.add(req_id)  # no load will report it

    def _load_failed(self, request: Request, num_valid_tokens: int, why: str) -> bool:
        """A parked request's load failed after num_valid_tokens: whether it recomputes the rest
        (once its load is reported finished) or, under the "fail" policy, is to end."""
        if not self.recompute_failed_loads:
            self.failed_loads[request.request_id] = why
            return False
        logger.warning("Request %s: %s; it computes the rest of its prompt itself",
                       request.request_id, why)
        request.num_computed_tokens = min(request.num_computed_tokens, num_valid_tokens)
        self.failed_recving_kv_req_ids.add(request.request_id)
        return True

    def _update_waiting_for_remote_kv(self, request: Request) -> None:
        kv = self.kv_cache_manager
        if request.request_id in self.failed_recving_kv_req_ids:
            self.failed_recving_kv_req_ids.discard(request.request_id)
            if not request.num_computed_tokens:
                # Nothing valid: start afresh (a local prefix hit may serve it now).
                kv.free(request)
                return
        # Now that the KV is there, its full blocks may serve other requests.
        kv.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            # The model must run on one token at least, to sample from its logits.
            request.num_computed_tokens -= 1

    def update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput | None,
                                     requests: dict[str, Request],
                                     outputs: list[EngineCoreOutput]
                                     ) -> tuple[Sequence[str], Sequence[Request]]:
        freed = (() if kv_connector_output is None
                 else self._update_from_kv_connector_output(kv_connector_output, requests))
        return (self._end_failed_loads(outputs) if self.failed_loads else ()), freed

    def _update_from_kv_connector_output(self, kv_connector_output: KVConnectorOutput,
                                         requests: dict[str, Request]) -> list[Request]:
        """Take the worker side's report; the finished requests whose transfers have ended."""
        self.connector.update_connector_output(kv_connector_output)
        if kv_connector_output.invalid_block_ids:
            self._handle_invalid_blocks(kv_connector_output.invalid_block_ids)
        freed: dict[str, Request] = {}
        for req_id in kv_connector_output.finished_recving or ():
            # Unknown: a request aborted before its read, whose blocks were never held.
            if (request := requests.get(req_id)) is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            elif request.is_finished():  # aborted during its read: the blocks are free to go
                freed[req_id] = request
        for req_id in kv_connector_output.finished_sending or ():
            if (request := requests.get(req_id)) is not None and request.is_finished():
                freed[req_id] = request
        return list(freed.values())

    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> None:
        """Parked requests whose load failed keep the KV before their first invalid block and
        recompute from there, once their load is reported finished."""
        kv = self.kv_cache_manager
        for request in self.waiting_for_remote_kvs.values():
            block_ids = kv.get_block_ids(request.request_id)
            first_bad = next((i for i, b in enumerate(block_ids) if b in invalid_block_ids), None)
            if first_bad is not None:
                self._load_failed(request, first_bad * kv.block_size,
                                  f"its KV load failed from block {first_bad} on")

    def _end_failed_loads(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """The "fail" policy: each request whose load failed is to end with an error (a server
        error for its client, not a refusal: EngineCoreOutput.failed)."""
        failed, self.failed_loads = self.failed_loads, {}
        failed = {req_id: why for req_id, why in failed.items()
                  if req_id in self.waiting_for_remote_kvs}  # not aborted meanwhile
        for req_id, why in failed.items():
            message = f"{why} (kv_load_failure_policy is 'fail')"
            logger.error("Request %s failed: %s", req_id, message)
            outputs.append(EngineCoreOutput(req_id, [], FinishReason.ERROR,
                                            error_message=message, failed=True))
        return list(failed)

    def has_pending_requests(self) -> bool:
        return self.connector.has_pending_requests()

    def num_waiting_for_remote_kvs(self) -> int:
        return len(self.waiting_for_remote_kvs)
