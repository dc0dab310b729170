"""The scheduler's side of speculative decoding: which drafts a step verifies, what came of them.

Mirrors the draft-token parts of vllm/v1/core/sched/scheduler.py. schedule() gives a running
request num_tokens_with_spec - num_computed_tokens tokens, its drafts included; after the running
pass, take_scheduled_drafts reports the drafts the token budget let through
(scheduled_spec_decode_tokens) and uses every scheduled request's drafts up. update_from_output
first calls take_back_rejected: the runner returns the accepted drafts and one more token, so the
rejected drafts' positions leave num_computed_tokens, and their KV slots are written again by the
next step (allocate_slots never hashes a draft's block: only known tokens are cached). Bound by
the composition root (minicore/engine/components.py): without --speculative-config,
NoSpecDecode (minicore/scheduler/interfaces.py) does nothing at either point.
With async scheduling the drafts are the runner's (RunnerDrafts): placeholders here
(minicore/scheduler/async_scheduler.py), and the runner reports how many it proposed.
A proposer that writes KV of its own (MTP: use_eagle) has the KV cache manager allocate
num_lookahead_tokens slots past each step's tokens, where its draft steps write, and its prefix hits
end a block early (minicore/scheduler/kv_cache_manager.py); bound with the manager.
"""

from minicore.protocol import SpecDecodingStats
from minicore.request import Request
from minicore.scheduler.interfaces import DraftTokenIds, NoSpecDecode
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput


class SpecDecode(NoSpecDecode):
    def __init__(self, num_spec_tokens: int, num_lookahead_tokens: int = 0,
                 use_eagle: bool = False):
        self.stats = SpecDecodingStats.new(num_spec_tokens)
        self.num_lookahead_tokens, self.use_eagle = num_lookahead_tokens, use_eagle
        # The requests of the last step that sampled nothing: their chunk left them mid-prefill.
        self.prefill_chunks: set[str] = set()

    def take_scheduled_drafts(self, req_ids: list[str],
                              requests: dict[str, Request]) -> dict[str, list[int]]:
        """Per request of the running pass (req_ids) scheduled with drafts, those its tokens
        reach: num_computed_tokens already counts this step's tokens, so the drafts scheduled are
        the tokens past num_tokens and the placeholders of a step in flight."""
        scheduled = {}
        for req_id in req_ids:
            request = requests[req_id]
            if request.spec_token_ids:
                num_scheduled = (request.num_computed_tokens - request.num_tokens
                                 - request.num_output_placeholders)
                if num_scheduled > 0:
                    scheduled[req_id] = request.spec_token_ids[:num_scheduled]
                # The drafter proposes afresh after the step.
                request.spec_token_ids = []
        return scheduled

    def take_back_rejected(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput, requests: dict[str, Request]) -> None:
        """Lower each verified request's num_computed_tokens by its rejected drafts, and count
        the acceptance (before any stop cuts the accepted run, as vLLM counts it)."""
        index, sampled = runner_output.req_id_to_index, runner_output.sampled_token_ids
        self.prefill_chunks = {req_id for req_id, row in index.items() if not sampled[row]}
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if (request := requests.get(req_id)) is None or (row := index.get(req_id)) is None:
                continue  # aborted while the step ran
            num_accepted = len(sampled[row]) - 1
            if request.num_computed_tokens:  # else preempted while the step ran
                request.num_computed_tokens -= len(drafts) - num_accepted
            if num_proposed := self.num_proposed(req_id, drafts, runner_output):
                self.stats.observe_draft(num_proposed, num_accepted)

    def num_proposed(self, req_id: str, drafts: list[int], runner_output: ModelRunnerOutput) -> int:
        return len(drafts)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds,
                               requests: dict[str, Request], max_model_len: int) -> None:
        """Each request's drafts for its next step (one finished meanwhile is skipped). A request
        still prefilling gets none (vLLM: is_prefill_chunk), and drafts are cut so that no
        scheduled position reaches max_model_len - 1: vLLM caps every running request's tokens
        there in schedule(), which only drafts can reach."""
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            if (request := requests.get(req_id)) is None or request.is_finished():
                continue
            room = 0 if req_id in self.prefill_chunks else max_model_len - 1 - request.num_tokens
            request.spec_token_ids = drafts[:max(0, room)]


class RunnerDrafts(SpecDecode):
    """With async scheduling: the runner proposes each request's drafts right after it samples
    (minicore/model/async_spec_decode.py), so a step schedules placeholders for them, and the
    runner may fill fewer than were scheduled (its lookup found fewer)."""

    def num_proposed(self, req_id: str, drafts: list[int], runner_output: ModelRunnerOutput) -> int:
        return runner_output.num_draft_tokens.get(req_id, 0)
