"""The scheduler's seams: the components Scheduler calls at fixed points of a step, each here as
its do-nothing default, which the composition root (minicore/engine/components.py) replaces where
a feature is on. A reader of the scheduler without features can stop here.

- NoRemoteKV, for a KV connector: admission, finish, the step's metadata, the start of schedule()
  and the end of update_from_output (vLLM tests `self.connector is not None` at each point); a
  connector binds its own, ConnectorRemoteKV (minicore/kv_transfer/remote_kv.py).
- NoSpecDecode, for drafts: the drafts a step verifies and what came of them (SpecDecode,
  minicore/scheduler/spec_decode.py); DraftTokenIds carries a drafter's proposals in.
- NoPlaceholders, for async scheduling: the tokens of steps in flight (OutputPlaceholders,
  minicore/scheduler/async_scheduler.py).
- NoLogprobs, for a runner without logits: the logprobs a step's outputs carry (Logprobs,
  minicore/scheduler/logprobs.py).
- NoStructuredOutput, for grammars: the wait for a compiled grammar, the step's bitmask and the
  matchers' advance (the managers of minicore/structured_output/manager.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minicore.protocol import EngineCoreOutput
from minicore.request import Request
from minicore.scheduler.output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from minicore.scheduler.policies.base import RequestQueue

if TYPE_CHECKING:
    from minicore.kv_transfer.base import KVConnectorMetadata
    from minicore.scheduler.kv_cache_utils import KVCacheBlock


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

    def build_connector_meta(self, scheduler_output: SchedulerOutput
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


@dataclass(slots=True)
class DraftTokenIds:
    """The drafter's proposals after a step, one list per request, possibly empty (vLLM:
    vllm/v1/outputs.py)."""
    req_ids: list[str]
    draft_token_ids: list[list[int]]


class NoSpecDecode:
    stats = None
    # The KV cache manager's drafter slots and shorter prefix hits (spec_decode.py's).
    num_lookahead_tokens, use_eagle = 0, False

    def take_scheduled_drafts(self, req_ids: list[str],
                              requests: dict[str, Request]) -> dict[str, list[int]]:
        return {}

    def take_back_rejected(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput, requests: dict[str, Request]) -> None:
        pass

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds,
                               requests: dict[str, Request], max_model_len: int) -> None:
        """Nothing to take: EngineCore hands over a NoDrafter's empty proposals every step."""
        if draft_token_ids.req_ids:
            raise ValueError("draft tokens need a scheduler built with a speculative_config")


class NoPlaceholders:
    """Without async scheduling: every step's output is back before the next is scheduled."""

    def ends_in_flight(self, request: Request, max_model_len: int) -> bool:
        """Whether the running pass must skip the request this step."""
        return False

    def after_schedule(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                       num_running: int) -> None:
        pass

    def requests_to_update(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           requests: dict[str, Request]) -> dict[str, Request]:
        return requests


class NoLogprobs:
    def add(self, outputs: list[EngineCoreOutput], requests: dict[str, Request],
            scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Give the step's outputs (in runner order) their logprobs, once per step, after they
        are built. requests: Scheduler.requests, before this step's finished requests leave."""


class NoStructuredOutput:
    def promote_compiled(self) -> None:
        pass

    def skip_uncompiled(self, waiting: RequestQueue) -> bool:
        """Before each admission: pass over the requests at the head of the waiting queue whose
        grammar still compiles; whether a request is left to admit (the queue is not empty)."""
        return True

    def restore_skipped(self, waiting: RequestQueue) -> None:
        """After admission: the requests passed over, back at the head in their order."""

    def grammar_bitmask(self, scheduler_output: SchedulerOutput,
                        requests: dict[str, Request]) -> None:
        pass

    def accept_tokens(self, outputs: list[EngineCoreOutput], requests: dict[str, Request],
                      proposals: dict[str, list[int]]) -> Sequence[str]:
        """Advance each structured request's matcher with the tokens it sampled this step; the
        ids of the requests to end (their grammar did not compile: their error outputs are
        appended to outputs). proposals: ModelRunnerOutput.draft_token_ids."""
        return ()


NO_REMOTE_KV = NoRemoteKV()
NO_SPEC_DECODE = NoSpecDecode()
NO_PLACEHOLDERS = NoPlaceholders()
NO_LOGPROBS = NoLogprobs()
NO_STRUCTURED_OUTPUT = NoStructuredOutput()
