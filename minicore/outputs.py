"""What the model runner hands back to the scheduler, and what a user gets back per request.

Mirrors ModelRunnerOutput and KVConnectorOutput (vllm/v1/outputs.py), RequestOutput
(vllm/outputs.py), Logprob with SampleLogprobs/PromptLogprobs (vllm/logprobs.py) and
RequestStateStats (vllm/v1/metrics/stats.py), without pooling, speculative decoding, KV connector
stats or FlatLogprobs.
"""

from dataclasses import dataclass, field
from typing import Any

from minicore.protocol import LogprobsLists


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker side of a KV connector reports after a step (vLLM: KVConnectorOutput)."""
    # Held blocks the peer has read (or whose wait timed out): the scheduler frees them.
    finished_sending: set[str] | None = None
    # Remote KV that has arrived: the request leaves WAITING_FOR_REMOTE_KVS.
    finished_recving: set[str] | None = None
    # Local blocks whose load failed: their requests recompute from the last valid block.
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request in req_ids: the tokens it sampled this step, empty for a request that is
    # still in the middle of a chunked prefill.
    sampled_token_ids: list[list[int]]
    # Set only when the engine runs a KV connector.
    kv_connector_output: KVConnectorOutput | None = None
    # Per request id, for the requests that asked: the sampled token's top logprobs (one row per
    # sampled token) and the logprobs of this step's chunk of prompt positions.
    logprobs: dict[str, LogprobsLists] | None = None
    prompt_logprobs: dict[str, LogprobsLists] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


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
