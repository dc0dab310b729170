"""The scheduler's side of async scheduling: output placeholders for the tokens of steps in flight.

Mirrors AsyncScheduler in vllm/v1/core/sched/async_scheduler.py, as a component the composition
root binds (minicore/engine/components.py; NoPlaceholders without async scheduling) instead of a
subclass (so that it composes with BalanceScheduler). With async
scheduling the engine schedules step N+1 before step N's tokens are back (EngineCore's batch
queue). A request scheduled to its last known token samples one token that nobody knows yet: its
placeholder, counted in num_output_placeholders. Step N+1 then schedules that position too (the
runner has the token: it sampled it), and the request's num_computed_tokens runs one ahead of its
num_tokens until N's output lands. When the tokens in flight will end the request by length, the
scheduler's running pass skips it (vLLM's max_tokens skip), so nothing is scheduled past its last
token; a token sampled past an EOS or a stop id is dropped with its finished request.
Left out: draft placeholders (vLLM's EAGLE/MTP path) and structured output's pending tokens.
"""

from minicore.request import Request
from minicore.scheduler.interfaces import NoPlaceholders
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput


def ends_in_flight(request: Request, max_model_len: int) -> bool:
    """Whether the tokens in flight end the request by length, so that no step may follow
    (vLLM's max_tokens skip; max_model_len included, which ends a request the same way)."""
    # vLLM's (num_computed_tokens + 1) - (num_output_placeholders - 1): the length once the step
    # in flight is back, counting one token for it (the rest of vLLM's placeholders are drafts).
    length = request.num_computed_tokens + 2 - request.num_output_placeholders
    max_tokens = request.max_tokens
    return length >= max_model_len or (
        max_tokens is not None and length >= request.num_prompt_tokens + max_tokens)


class OutputPlaceholders(NoPlaceholders):
    def __init__(self):
        # id(SchedulerOutput) -> the requests it scheduled, until its output is back.
        self._in_flight: dict[int, dict[str, Request]] = {}

    def ends_in_flight(self, request: Request, max_model_len: int) -> bool:
        return bool(request.num_output_placeholders) and ends_in_flight(request, max_model_len)

    def after_schedule(self, scheduler_output: SchedulerOutput,
                       requests: dict[str, Request]) -> None:
        """A request scheduled up to its newest placeholder samples one more (vLLM:
        _update_after_schedule)."""
        scheduled = {req_id: requests[req_id] for req_id in scheduler_output.num_scheduled_tokens}
        for request in scheduled.values():
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        self._in_flight[id(scheduler_output)] = scheduled

    def requests_to_update(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           requests: dict[str, Request]) -> dict[str, Request]:
        """The requests this output may update: those the step scheduled, less those finished
        since (aborted, or stopped by the step before). Looked up by object, not by id: a request
        id reused after an abort names a new request that this step never ran. Their sampled
        tokens stop being placeholders."""
        live = {req_id: request for req_id, request in
                self._in_flight.pop(id(scheduler_output)).items() if not request.is_finished()}
        sampled = runner_output.sampled_token_ids
        for req_id, index in runner_output.req_id_to_index.items():
            if (request := live.get(req_id)) is not None:
                request.num_output_placeholders -= len(sampled[index])
        return live
