"""What passes between the scheduler and the model runner: SchedulerOutput, what one step runs,
and ModelRunnerOutput, what it sampled.

Mirrors vllm/v1/core/sched/output.py, and ModelRunnerOutput and KVConnectorOutput from
vllm/v1/outputs.py. As in vLLM's v2 model runner, a request resumed after
preemption is sent as new (with all its token ids), so the runner keeps no state across a
preemption. Left out: encoder inputs.
"""

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from minicore.protocol import LogprobsLists
from minicore.request import Request
from minicore.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    # Prompt plus any output tokens kept through a preemption.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The sampler masks it (and the stop ids) until min_tokens outputs exist.
    eos_token_id: int | None = None

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> "NewRequestData":
        return cls(request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                   request.sampling_params, block_ids, request.num_computed_tokens,
                   request.eos_token_id)


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already knows: only what changed this step."""
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Sequence[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def remove(self, req_id: str) -> None:
        i = self.req_ids.index(req_id)
        del self.req_ids[i], self.new_block_ids[i], self.num_computed_tokens[i]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    # Finished (stopped or aborted) since the previous step: the runner drops their state.
    finished_req_ids: set[str]
    # The KV connector's KVConnectorMetadata for its worker side (minicore/kv_transfer/base.py);
    # None without a connector.
    kv_connector_metadata: Any = None
    # Per request with drafts this step, the draft tokens its scheduled run ends with (after its
    # newest token); the runner verifies them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs: each structured request's row in grammar_bitmask, a [rows, ceil(V / 32)]
    # int32 tensor of allowed-token bits (vLLM: GrammarOutput); empty and None without any.
    # A request's first row; with drafts it has one per draft and then its own.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    # Scheduled while a structured request's previous token was in flight (async scheduling): the
    # bitmask is filled once that token is back, and grammar_filled set then; the runner waits
    # for it before it samples (vLLM: pending_structured_output_tokens).
    pending_structured_output_tokens: bool = False
    grammar_filled: threading.Event | None = None


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
    # still in the middle of a chunked prefill; with drafts, the accepted ones and one more.
    sampled_token_ids: list[list[int]]
    # Set only when the engine runs a KV connector.
    kv_connector_output: KVConnectorOutput | None = None
    # Per request id, for the requests that asked: the sampled token's top logprobs (one row per
    # sampled token) and the logprobs of this step's chunk of prompt positions.
    logprobs: dict[str, LogprobsLists] | None = None
    prompt_logprobs: dict[str, LogprobsLists] | None = None
    # With drafts proposed by the runner (async scheduling): per request that verified drafts, how
    # many it ran (at most the placeholders scheduled), and per request that sampled, the drafts
    # it proposed for the request's next step (vLLM: DraftTokenIds).
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
