"""What the model runner hands back to the scheduler, and what a user gets back per request.

Mirrors ModelRunnerOutput and KVConnectorOutput (vllm/v1/outputs.py) and RequestOutput
(vllm/outputs.py), without logprobs, pooling, speculative decoding, KV connector stats or events.
"""

from dataclasses import dataclass, field
from typing import Any


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
