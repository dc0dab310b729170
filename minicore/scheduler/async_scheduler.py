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
With drafts, a request that samples also gets num_speculative_tokens draft placeholders (vLLM's
_spec_token_placeholders): the runner proposes the drafts themselves right after it samples
(minicore/model/async_spec_decode.py), so the next step verifies them although nobody here knows
them. Its num_computed_tokens then counts every draft as accepted until the output says otherwise.
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
    def __init__(self, max_model_len: int, num_spec_tokens: int = 0,
                 disable_by_batch_size: int | None = None):
        # id(SchedulerOutput) -> the requests it scheduled, until its output is back.
        self._in_flight: dict[int, dict[str, Request]] = {}
        self.max_model_len = max_model_len
        self.num_spec_tokens = num_spec_tokens
        # No drafts while this many requests run or more (SpeculativeConfig's).
        self.disable_by_batch_size = disable_by_batch_size or float("inf")

    def ends_in_flight(self, request: Request, max_model_len: int) -> bool:
        return bool(request.num_output_placeholders) and ends_in_flight(request, max_model_len)

    def after_schedule(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                       num_running: int) -> None:
        """A request scheduled up to its newest placeholder samples one more, and verifies its
        drafts: a placeholder each (vLLM: _update_after_schedule); with drafts it gets placeholder
        drafts for its next step."""
        scheduled = {req_id: requests[req_id] for req_id in scheduler_output.num_scheduled_tokens}
        spec = scheduler_output.scheduled_spec_decode_tokens
        draft = self.num_spec_tokens if num_running < self.disable_by_batch_size else 0
        for req_id, request in scheduled.items():
            num_drafts = len(spec.get(req_id, ()))
            if (request.num_computed_tokens - num_drafts
                    == request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1 + num_drafts
                if draft:
                    # The newest placeholder is computed at num_computed_tokens next step; no
                    # draft may reach max_model_len - 1 (as SpecDecode cuts proposals).
                    room = self.max_model_len - 2 - request.num_computed_tokens
                    request.spec_token_ids = [-1] * max(0, min(draft, room))
        self._in_flight[id(scheduler_output)] = scheduled

    def requests_to_update(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           requests: dict[str, Request]) -> dict[str, Request]:
        """The requests this output may update: those the step scheduled, less those finished
        since (aborted, or stopped by the step before). Looked up by object, not by id: a request
        id reused after an abort names a new request that this step never ran. Their sampled
        tokens, and its drafts, accepted or not, stop being placeholders."""
        live = {req_id: request for req_id, request in
                self._in_flight.pop(id(scheduler_output)).items() if not request.is_finished()}
        sampled = runner_output.sampled_token_ids
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, index in runner_output.req_id_to_index.items():
            if (request := live.get(req_id)) is not None and sampled[index]:
                request.num_output_placeholders -= 1 + len(spec.get(req_id, ()))
        return live
