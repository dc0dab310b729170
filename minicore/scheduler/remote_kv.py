"""The scheduler's side of a KV connector: requests parked while their KV is loaded from another
instance, blocks held while another instance reads them, and load failures.

Mirrors the KV-connector parts of vllm/v1/core/sched/scheduler.py: the load_kv_async branch of
schedule() (here _park_for_remote_kvs), _update_waiting_for_remote_kv, _update_from_kv_xfer_finished,
_handle_invalid_blocks, and _free_request's delayed free. It is a mixin of Scheduler
(scheduler.py), kept apart so that a reader of the scheduler without a connector can skip it; every
entry point is behind `connector is not None` or a state only a connector creates.

Request states (decode side, the consumer):
  WAITING --get_num_new_matched_tokens > 0--> WAITING_FOR_REMOTE_KVS, blocks allocated (not yet in
  the prefix cache), outside the waiting queue (vLLM keeps it in the queue and skips it each step)
  --finished_recving--> front of the waiting queue with num_computed_tokens = prompt - 1, so that
  the request computes only its last prompt token itself and samples from it.
  A load that failed (invalid_block_ids) keeps the valid prefix and recomputes the rest.
Prefill side (the producer): a finished request whose connector says delay_free stays in
self.requests, its blocks held, until get_finished reports it in finished_sending (the peer has
read them, or the connector's timeout expired); has_requests() keeps the engine stepping meanwhile.
Left out: synchronous external loads (minicore's connectors load asynchronously only), the
"fail" load-failure policy, connector prefix-cache stats.
"""

from typing import TYPE_CHECKING, Any

from minicore.outputs import KVConnectorOutput
from minicore.request import Request, RequestStatus

if TYPE_CHECKING:
    from minicore.kv_transfer.base import KVConnectorBase_V1
    from minicore.scheduler.block_pool import KVCacheBlock

WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class RemoteKVMixin:
    connector: "KVConnectorBase_V1 | None"

    def _init_remote_kv(self, connector: "KVConnectorBase_V1 | None") -> None:
        self.connector = connector
        # Parked requests by id, in the order they were parked.
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        # Reported by the worker side since the last schedule(): their KV is in (or failed).
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()

    def has_requests(self) -> bool:
        """Whether the engine must keep stepping: unfinished requests, finished ones whose blocks
        are held for a peer or still being loaded into, or connector state not yet sent to the
        worker side (vLLM: Scheduler.has_requests)."""
        return bool(self.requests) or (self.connector is not None
                                       and self.connector.has_pending_requests())

    def _park_for_remote_kvs(self, request: Request, computed_blocks: "list[KVCacheBlock]",
                             num_computed: int, num_external: int, load_async: bool) -> bool:
        """Allocate blocks for the request's external tokens and park it until they arrive;
        False (nothing changed) when the blocks are not there."""
        if not load_async:
            raise NotImplementedError("minicore's scheduler loads external KV asynchronously "
                                      "only: get_num_new_matched_tokens must return (n, True)")
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_external, num_computed, computed_blocks,
                             self.scheduler_config.scheduler_reserve_full_isl,
                             delay_cache_blocks=True) is None:
            return False
        self.waiting.pop_request()
        kv.record_prefix_cache_query(request.num_tokens, num_computed)
        self.connector.update_state_after_alloc(request, kv.get_blocks(request.request_id),
                                                num_external)
        # Not loaded yet; nothing reads it before the KV arrives, and a failed load lowers it.
        request.num_computed_tokens = num_computed + num_external
        request.status = WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = request
        return True

    def _promote_received(self) -> None:
        """Move the requests whose KV arrived to the front of the waiting queue, earliest first:
        they hold their blocks already."""
        received = [self.waiting_for_remote_kvs.pop(req_id)
                    for req_id in self.finished_recving_kv_req_ids]
        self.finished_recving_kv_req_ids.clear()
        for request in sorted(received, key=lambda r: r.arrival_time, reverse=True):
            self._update_waiting_for_remote_kv(request)
            request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                              else RequestStatus.WAITING)
            self.waiting.prepend_request(request)

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

    def _update_from_kv_xfer_finished(self, output: KVConnectorOutput) -> None:
        if output.invalid_block_ids:
            self._handle_invalid_blocks(output.invalid_block_ids)
        for req_id in output.finished_recving or ():
            # Unknown: a request aborted before its read, whose blocks were never held.
            if (request := self.requests.get(req_id)) is None:
                continue
            if request.status == WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            elif request.is_finished():  # aborted during its read: the blocks are free to go
                self._free_blocks(request)
        for req_id in output.finished_sending or ():
            if (request := self.requests.get(req_id)) is not None and request.is_finished():
                self._free_blocks(request)

    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> None:
        """Parked requests whose load failed keep the KV before their first invalid block and
        recompute from there, once their load is reported finished."""
        block_size = self.kv_cache_manager.block_size
        for request in self.waiting_for_remote_kvs.values():
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            first_bad = next((i for i, b in enumerate(block_ids) if b in invalid_block_ids), None)
            if first_bad is not None:
                request.num_computed_tokens = min(request.num_computed_tokens,
                                                  first_bad * block_size)
                self.failed_recving_kv_req_ids.add(request.request_id)

    def _leave_remote_kv_wait(self, request: Request) -> bool:
        """A parked request finishes (abort): True if its blocks must wait for the load that may
        still be writing into them."""
        del self.waiting_for_remote_kvs[request.request_id]
        received = request.request_id in self.finished_recving_kv_req_ids
        self.finished_recving_kv_req_ids.discard(request.request_id)
        self.failed_recving_kv_req_ids.discard(request.request_id)
        return not received

    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self.connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request.request_id))

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
