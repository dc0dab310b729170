"""Drafts with async scheduling: the runner proposes each request's drafts right after it samples,
and verifies them in the step the scheduler has already scheduled with placeholders for them.

Mirrors vLLM's async speculative decoding in vllm/v1/worker/gpu_model_runner.py (drafts kept on
the worker, num_computed_tokens corrected by the previous step's rejections) with the proposer on
the forward's thread, as the ngram_gpu method runs it. The scheduler scheduled step N+1 before it
knew step N's rejections (minicore/scheduler/async_scheduler.py), so for a request N verified its
count runs ahead by N's rejected drafts; the runner knows the true one, and the position each
token goes to. The drafts scheduled are placeholders: the runner runs its own proposals in their
place, as many as it has (at most as many as were scheduled), and reports the count, and its
proposals, from which the scheduler's side fills a structured request's bitmask rows. Left out:
proposers that run a model.
"""

from minicore.model.rejection_sampler import SpecDecodeSampler
from minicore.model.runner_base import CachedRequestState
from minicore.model.sampler import take_grammar_rows
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput
from minicore.spec_decode.drafter import Drafter, DraftRequest


class AsyncSpecDecodeSampler(SpecDecodeSampler):
    def __init__(self, *args, drafter: Drafter):
        super().__init__(*args)
        self.drafter = drafter
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
            self.drafter.forget(gone)
        limit = self.drafter.disable_by_batch_size
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
        proposals = {}
        for row in rows:
            state, req_id = states[row], output.req_ids[row]
            self._num_computed[req_id] = len(state.token_ids) - 1
            proposals[req_id] = self.drafter.propose_for(DraftRequest(
                req_id, state.token_ids, state.num_prompt_tokens, state.sampling_params)
            ) if self._drafting else []
        self._drafts.update(proposals)
        # Sent back with the tokens: a grammar's bitmask rows for the drafts are filled from them
        # (minicore/structured_output/manager.py).
        output.draft_token_ids = proposals
