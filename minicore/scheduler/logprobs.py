"""The logprobs a step's outputs carry: sampled-token logprobs, and prompt logprobs chunk by chunk.

Mirrors the logprobs parts of Scheduler.update_from_output (vllm/v1/core/sched/scheduler.py): the
sampled tokens' LogprobsLists ride on their output, a chunk of prompt logprobs rides on the
request's output of the step that computed those positions, and a request mid-prefill, which
samples nothing, gets an output carrying only its chunk. The composition root binds Logprobs for
a runner with logits (NoLogprobs, minicore/scheduler/interfaces.py, for one without);
update_from_output calls it once per step, after building the outputs. Left out: vLLM's
num_nans_in_logits and the pooling outputs.
"""

from minicore.protocol import EngineCoreOutput, LogprobsLists
from minicore.request import Request
from minicore.scheduler.interfaces import NoLogprobs
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput


class Logprobs(NoLogprobs):
    def add(self, outputs: list[EngineCoreOutput], requests: dict[str, Request],
            scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Also an output for each request mid-prefill with prompt logprobs not sent yet."""
        if runner_output.prompt_logprobs is not None:
            _add_prompt_logprobs(outputs, requests, scheduler_output, runner_output)
        if (logprobs := runner_output.logprobs) is not None:
            for output in outputs:
                # A stop inside a run of accepted drafts cut the tokens: cut their rows too.
                if (rows := logprobs.get(output.request_id)) is not None:
                    num_tokens = len(output.new_token_ids)
                    output.new_logprobs = (rows if len(rows.sampled_token_ranks) == num_tokens
                                           else rows.slice(0, num_tokens))


def _add_prompt_logprobs(outputs: list[EngineCoreOutput], requests: dict[str, Request],
                         scheduler_output: SchedulerOutput,
                         runner_output: ModelRunnerOutput) -> None:
    """Each chunk starts where the step's tokens for its request began; a position already sent
    (before a preemption made the request recompute its prompt) is not sent again."""
    by_id = {output.request_id: output for output in outputs}
    num_outputs = len(outputs)
    for req_id, chunk in runner_output.prompt_logprobs.items():
        if (request := requests.get(req_id)) is None:  # aborted while the step ran
            continue
        start = request.num_computed_tokens - scheduler_output.num_scheduled_tokens[req_id]
        if (output := by_id.get(req_id)) is not None:
            output.new_prompt_logprobs = take_new_prompt_logprobs(request, chunk, start)
        elif (new_prompt_logprobs := take_new_prompt_logprobs(request, chunk, start)) is not None:
            outputs.append(EngineCoreOutput(
                req_id, [], num_cached_tokens=request.num_cached_tokens,
                events=request.take_events() if request.events else None,
                new_prompt_logprobs=new_prompt_logprobs))
    if len(outputs) > num_outputs:
        index = runner_output.req_id_to_index
        outputs.sort(key=lambda output: index[output.request_id])


def take_new_prompt_logprobs(request: Request, chunk: LogprobsLists,
                             start: int) -> LogprobsLists | None:
    """The part of chunk (the logprobs of prompt positions start, start + 1, ...) not sent yet;
    None if it was all sent before the request was preempted and recomputed."""
    end = start + len(chunk.sampled_token_ranks)
    skip = request.num_prompt_logprobs_sent - start
    if end <= request.num_prompt_logprobs_sent:
        return None
    request.num_prompt_logprobs_sent = end
    return chunk if skip <= 0 else chunk.slice(skip)
