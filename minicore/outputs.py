"""What the model runner hands back to the scheduler, and what a user gets back per request.

Mirrors ModelRunnerOutput (vllm/v1/outputs.py) and RequestOutput (vllm/outputs.py), without logprobs,
pooling or speculative decoding.
"""

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request in req_ids: the tokens it sampled this step, empty for a request that is
    # still in the middle of a chunked prefill.
    sampled_token_ids: list[list[int]]


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length" or "abort"; None while unfinished.
    finish_reason: str | None = None
    # The stop token id or stop string that ended the request, if one did.
    stop_reason: int | str | None = None


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
