"""Drafts with async scheduling: the runner proposes each request's drafts right after it samples,
and verifies them in the step the scheduler has already scheduled with placeholders for them.

Mirrors vLLM's async speculative decoding in vllm/v1/worker/gpu_model_runner.py (drafts kept on
the worker, num_computed_tokens corrected by the previous step's rejections) with the proposer on
the forward's thread, as the ngram_gpu method runs it. The scheduler scheduled step N+1 before it
knew step N's rejections (minicore/scheduler/async_scheduler.py), so for a request N verified its
count runs ahead by N's rejected drafts; the runner knows the true one, and the position each
token goes to. The drafts scheduled are placeholders: the runner runs its own proposals in their
place, as many as it has (at most as many as were scheduled), and reports the count, and its
proposals, from which the scheduler's side fills a structured request's bitmask rows. The
proposals come after the step's sampling from a proposer chosen once: RequestDrafts, a Drafter's
proposals from each request's own tokens (ngram), or the MTP layers' (minicore/model/eagle.py).
"""

from minicore.model.attention import AttentionMetadata
from minicore.model.rejection_sampler import SpecDecodeSampler
from minicore.model.runner_base import CachedRequestState
from minicore.model.sampler import take_grammar_rows
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput
from minicore.spec_decode.drafter import Drafter, DraftRequest


class RequestDrafts:
    """Drafts from each request's own tokens, by a Drafter's propose_for (ngram)."""
    num_layers = 0  # no KV cache of its own

    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def forget(self, req_ids: set[str]) -> None:
        self.drafter.forget(req_ids)

    def propose(self, hidden, meta: AttentionMetadata, states: list[CachedRequestState],
                output: ModelRunnerOutput, drafting: bool) -> dict[str, list[int]]:
        return {req_id: self.drafter.propose_for(DraftRequest(
            req_id, state.token_ids, state.num_prompt_tokens, state.sampling_params))
                if drafting else []
                for req_id, state, sampled in zip(output.req_ids, states,
                                                  output.sampled_token_ids) if sampled}


class AsyncSpecDecodeSampler(SpecDecodeSampler):
    def __init__(self, *args, proposer: RequestDrafts, disable_by_batch_size: int | None):
        """proposer: RequestDrafts or minicore/model/eagle.py's EagleProposer."""
        super().__init__(*args)
        self.proposer = proposer
        self.num_layers = proposer.num_layers
        self.disable_by_batch_size = disable_by_batch_size
        # Per request that sampled: its drafts for the next step, and how many of its tokens are
        # computed (all but the newest).
        self._drafts: dict[str, list[int]] = {}
        self._num_computed: dict[str, int] = {}
        # Whether this step's requests are few enough to draft for (disable_by_batch_size, which
        # the scheduler applies to its placeholders the same way).
        self._drafting = True

    def take_drafts(self, so: SchedulerOutput, requests: dict[str, CachedRequestState]) -> None:
        """Before the forward: the true computed counts, and the drafts in the placeholders'
        place."""
        if gone := so.finished_req_ids | so.preempted_req_ids:
            for req_id in gone:
                self._drafts.pop(req_id, None)
                self._num_computed.pop(req_id, None)
            self.proposer.forget(gone)
        limit = self.disable_by_batch_size
        self._drafting = not limit or len(requests) < limit
        for req_id in so.scheduled_cached_reqs.req_ids:
            if (num_computed := self._num_computed.pop(req_id, None)) is not None:
                requests[req_id].num_computed_tokens = num_computed
        for req_id, placeholders in so.scheduled_spec_decode_tokens.items():
            state = requests[req_id]
            state.spec_token_ids = self._drafts.pop(req_id, [])[:len(placeholders)]
            state.token_ids.extend(state.spec_token_ids)
        take_grammar_rows(so, requests)

    def __call__(self, hidden, query_start_loc: list[int], states: list[CachedRequestState],
                 rows: list[int], output: ModelRunnerOutput) -> None:
        num_drafts = {output.req_ids[row]: len(states[row].spec_token_ids) for row in rows}
        super().__call__(hidden, query_start_loc, states, rows, output)
        output.num_draft_tokens = {req_id: n for req_id, n in num_drafts.items() if n}
        for row in rows:
            self._num_computed[output.req_ids[row]] = len(states[row].token_ids) - 1

    def propose_draft_token_ids(self, hidden, meta: AttentionMetadata,
                                states: list[CachedRequestState],
                                output: ModelRunnerOutput) -> None:
        """After the step's sampling: each request's drafts for its next step."""
        proposals = self.proposer.propose(hidden, meta, states, output, self._drafting)
        self._drafts.update(proposals)
        # Sent back with the tokens: a grammar's bitmask rows for the drafts are filled from them
        # (minicore/structured_output/manager.py).
        output.draft_token_ids = proposals
