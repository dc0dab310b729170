"""The scheduler's seam for a KV connector: what the Scheduler calls at fixed points (admission,
finish, the step's metadata, the start of schedule(), after update_from_output, and for the
counts), with NoRemoteKV, the do-nothing default, bound when there is no connector. With one, the
connector binds its own component there (KVConnectorBase_V1.make_remote_kv):
minicore/kv_transfer/remote_kv.py's ConnectorRemoteKV, the KV-connector parts of vLLM's
vllm/v1/core/sched/scheduler.py. vLLM tests `self.connector is not None` at each of these points.
A reader of the scheduler without a connector can stop here.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

from minicore.protocol import EngineCoreOutput
from minicore.request import Request
from minicore.scheduler.output import KVConnectorOutput

if TYPE_CHECKING:
    from minicore.kv_transfer.base import KVConnectorMetadata
    from minicore.scheduler.kv_cache_utils import KVCacheBlock
    from minicore.scheduler.output import SchedulerOutput


class NoRemoteKV:
    """The scheduler without a KV connector: no KV comes from elsewhere (so no request is ever
    parked, and park is never called), no block is held for a peer, and there is nothing to tell
    a worker side. Its methods are the seam ConnectorRemoteKV fills in; it decides, and the
    scheduler acts on its queue and its requests."""

    __slots__ = ()

    def validate_request(self, request: Request) -> None:
        """ValueError for a request the connector could not act on (EngineCore.add_request then
        refuses it alone); without a connector, kv_transfer_params are ignored, as in vLLM."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens beyond the local prefix hit whose KV comes from elsewhere; when > 0 the
        scheduler calls park(request, ...) instead of admitting the request."""
        return 0

    def park(self, request: Request, computed_blocks: "Sequence[KVCacheBlock]",
             num_computed: int, num_external: int) -> bool:
        """Allocate the request's blocks and hold it until its KV arrives: whether it is parked
        (the scheduler then takes it out of the waiting queue); False, nothing changed, when the
        blocks are not there."""
        raise NotImplementedError("no KV comes from elsewhere without a connector")

    def update_state_after_alloc(self, request: Request) -> None:
        """The request was just admitted, its blocks allocated."""

    def request_finished(self, request: Request, output: EngineCoreOutput | None) -> bool:
        """The request has just finished (its status set); output is its last output, if it has
        one. Returns delay_free: whether its blocks stay held, and the request in
        Scheduler.requests, until a later step frees them."""
        return False

    def build_connector_meta(self, scheduler_output: "SchedulerOutput"
                             ) -> "KVConnectorMetadata | None":
        """SchedulerOutput.kv_connector_metadata of this step."""
        return None

    def promote_received(self) -> Sequence[Request]:
        """At the start of schedule(): the parked requests whose KV arrived, for the scheduler to
        put back at the front of the waiting queue, in this order."""
        return ()

    def update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput | None,
                                     requests: dict[str, Request],
                                     outputs: list[EngineCoreOutput]
                                     ) -> tuple[Sequence[str], Sequence[Request]]:
        """At the end of update_from_output: what the worker side reported for the step. Returns
        the ids of the requests the scheduler is to end (their error outputs appended to
        outputs), and the finished requests whose blocks it may free now."""
        return (), ()

    def has_pending_requests(self) -> bool:
        """Whether the engine must keep stepping with no request left to run."""
        return False

    def num_waiting_for_remote_kvs(self) -> int:
        """Requests parked while their KV loads: they count as waiting (vLLM: skipped waiting)."""
        return 0
