"""What a user gets back per request.

Mirrors RequestOutput and CompletionOutput (vllm/outputs.py), Logprob with SampleLogprobs/
PromptLogprobs (vllm/logprobs.py) and RequestStateStats (vllm/v1/metrics/stats.py), without
pooling or FlatLogprobs. What the model runner hands back to the scheduler is in
minicore/scheduler/output.py.
"""

from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(slots=True)
class Logprob:
    """One token's log probability (vllm/logprobs.py): log_softmax of the model's raw logits."""
    logprob: float
    # 1 = the most likely token in the whole vocabulary.
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token first, then the top-N in rank order.
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token; the first prompt token has none.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestStateStats:
    """A request's timeline in the frontend (vllm/v1/metrics/stats.py); time.monotonic()
    seconds. queued_ts and scheduled_ts come from the engine's events."""
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    num_generation_tokens: int = 0
    # PREEMPTED events seen (vLLM's RequestStateStats.num_preemptions).
    num_preemptions: int = 0

    def phase_times(self, now: float) -> "PhaseTimes":
        """A finished request's phases, as vLLM's IterationStats.update_from_finished_request:
        queue = scheduled - queued, prefill = first token - scheduled, decode = last token -
        first token, inference = last token - scheduled (all the engine's clock); e2e = now
        (time.monotonic()) - arrival (the frontend's)."""
        return PhaseTimes(now - self.arrival_time, self.scheduled_ts - self.queued_ts,
                          self.first_token_ts - self.scheduled_ts,
                          self.last_token_ts - self.first_token_ts,
                          self.last_token_ts - self.scheduled_ts)


class PhaseTimes(NamedTuple):
    """Seconds a finished request spent in each phase (RequestStateStats.phase_times), read by the
    latency histograms (minicore/entrypoints/metrics.py) and the request spans
    (minicore/tracing/otel.py)."""
    e2e: float
    queue: float
    prefill: float
    decode: float
    inference: float


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length" or "abort"; None while unfinished.
    finish_reason: str | None = None
    # The stop token id or stop string that ended the request, if one did.
    stop_reason: int | str | None = None
    # Every generated token's logprobs so far, when the request asked (SamplingParams.logprobs).
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """One request's result (vllm/outputs.py)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # The engine's KV connector's params for a finished request (a prefill instance's answer
    # for the decode instance); None otherwise.
    kv_transfer_params: dict[str, Any] | None = None
    # When the request asked for them (SamplingParams.prompt_logprobs).
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestStateStats | None = None
