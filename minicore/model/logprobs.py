"""The runner's logprobs output: the sampled tokens' and the prompt tokens', for the requests that
asked.

Mirrors the logprobs parts of vllm/v1/worker/gpu_model_runner.py (the InputBatch's num_logprobs
and num_prompt_logprobs, kept as requests come and go, and _get_prompt_logprobs_dict, which drops a
request from num_prompt_logprobs once its prompt is done) and of vllm/v1/sample/sampler.py (the
sampled token's raw logprobs, which minicore/model/sampler.py gathers; with speculative decoding,
minicore/model/rejection_sampler.py's, one per accepted draft and one for the final token). A step
of requests that asked for none costs an empty dict's loop. Left out: logprobs modes other than
raw logprobs, and vLLM's in-place accumulation of prompt logprobs on the device.
"""

import itertools
from collections.abc import Callable

import torch

from minicore.model.runner_base import CachedRequestState
from minicore.model.sampler import LogprobsTensors, compute_logprobs, gather_logprobs, num_logprobs
from minicore.protocol import LogprobsLists
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput

# Prompt positions whose logits are computed at once for prompt logprobs: [512, V] float32.
PROMPT_LOGPROBS_SLICE = 512


class LogprobsOutput:
    """Which of the runner's requests asked for logprobs, and theirs for each step's output."""

    def __init__(self, vocab_size: int, logits: Callable[[torch.Tensor], torch.Tensor]):
        self.vocab_size = vocab_size
        # Hidden states -> float32 logits, finished as the model's head does.
        self.logits = logits
        # Per request that asked, its number of top logprobs (the vocabulary for -1): per sampled
        # token while it runs; per prompt token until its prompt is done.
        self.num_logprobs: dict[str, int] = {}
        self.num_prompt_logprobs: dict[str, int] = {}

    def update_states(self, so: SchedulerOutput) -> None:
        """Forget finished and preempted requests (a preempted one comes back as new); note the
        new ones that ask."""
        for req_ids in (so.finished_req_ids, so.preempted_req_ids):
            for req_id in req_ids:
                self.num_logprobs.pop(req_id, None)
                self.num_prompt_logprobs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            if params.logprobs is not None:
                self.num_logprobs[new.req_id] = num_logprobs(params.logprobs, self.vocab_size)
            if params.prompt_logprobs is not None:
                self.num_prompt_logprobs[new.req_id] = num_logprobs(params.prompt_logprobs,
                                                                    self.vocab_size)

    def add_sampled(self, tensors: LogprobsTensors | None, rows: list[int],
                    output: ModelRunnerOutput, num_tokens: list[int] | None = None) -> None:
        """output.logprobs of the sampled rows (batch rows, in order) that asked; tensors: the
        sampler's, None when none did, num_tokens[i] rows of it for rows[i] (its accepted drafts
        and final token, with speculative decoding), one each by default."""
        if tensors is None:
            return
        ends = list(itertools.accumulate(num_tokens or [1] * len(rows)))
        output.logprobs = {req_id: tensors.tolists(range(first, last), num)
                           for row, first, last in zip(rows, [0] + ends, ends)
                           if (num := self.num_logprobs.get(req_id := output.req_ids[row]))
                           is not None}

    def add_prompt(self, hidden: torch.Tensor, query_start_loc: list[int],
                   states: list[CachedRequestState], computed: list[int], num_new: list[int],
                   output: ModelRunnerOutput) -> None:
        """output.prompt_logprobs: the logprobs of the prompt tokens this step's chunk predicts,
        for the scheduled requests that asked: position j's raw logits give prompt token j + 1
        (vLLM: _get_prompt_logprobs_dict)."""
        index = output.req_id_to_index
        rows = sorted(row for req_id in self.num_prompt_logprobs
                      if (row := index.get(req_id)) is not None)
        chunks = {}
        for row in rows:
            req_id, state, start = output.req_ids[row], states[row], computed[row]
            end = min(start + num_new[row], state.num_prompt_tokens - 1)
            if start < end:
                first = query_start_loc[row]
                chunks[req_id] = self._logprobs_of(
                    hidden[first:first + end - start], state.token_ids[start + 1:end + 1],
                    self.num_prompt_logprobs[req_id])
            if end == state.num_prompt_tokens - 1:  # the prompt is done
                del self.num_prompt_logprobs[req_id]
        if chunks:
            output.prompt_logprobs = chunks

    def _logprobs_of(self, hidden: torch.Tensor, token_ids: list[int],
                     num: int) -> LogprobsLists:
        """LogprobsLists of token_ids under the raw logits of hidden's positions, a slice of
        positions at a time so that a long prompt chunk's [T, V] logits stay small."""
        result = LogprobsLists([], [], [])
        for first in range(0, len(token_ids), PROMPT_LOGPROBS_SLICE):
            last = first + PROMPT_LOGPROBS_SLICE
            logprobs = compute_logprobs(self.logits(hidden[first:last]))
            targets = torch.tensor(token_ids[first:last], device=hidden.device)
            part = gather_logprobs(logprobs, num, targets).tolists(range(len(targets)), num)
            result.logprob_token_ids += part.logprob_token_ids
            result.logprobs += part.logprobs
            result.sampled_token_ranks += part.sampled_token_ranks
        return result
