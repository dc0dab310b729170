"""Request: one generation request as the scheduler sees it.

Mirrors vllm/v1/request.py (Request, RequestStatus); FinishReason is a wire record, in
minicore/protocol.py as in vllm/v1/engine/__init__.py.
Left out: multimodal inputs, LoRA.
"""

import enum
import time

from minicore.protocol import EngineCoreEvent, EngineCoreRequest, FinishReason
from minicore.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # In the waiting queue while its grammar compiles (structured outputs); not admitted until then.
    WAITING_FOR_FSM = enum.auto()
    # Parked with its blocks allocated while a KV connector loads its prompt's KV from another
    # instance (prefill/decode disaggregation); back to WAITING once it has arrived.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # vLLM reports a request that could never fit (e.g. too long) as "length".
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_id",
                 "arrival_time", "priority", "cache_salt", "status", "stop_reason",
                 "all_token_ids", "output_token_ids", "num_prompt_tokens", "num_tokens",
                 "num_computed_tokens", "num_cached_tokens", "num_preemptions", "block_hashes",
                 "kv_transfer_params", "events", "num_prompt_logprobs_sent", "spec_token_ids",
                 "num_output_placeholders", "structured_output_request")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: int | None = None,
                 arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        # len(all_token_ids), kept as a field: the scheduler reads it for every request every step.
        self.num_tokens = self.num_prompt_tokens
        self.num_computed_tokens = 0
        # The prefix-cache hit at first admission, in tokens; -1 until then.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Chain hashes of this request's full blocks, filled in by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # The KV connector's per-request state, which it updates (vLLM: Request.kv_transfer_params);
        # a copy, so that requests sharing one SamplingParams do not share it.
        params = sampling_params.kv_transfer_params
        self.kv_transfer_params = None if params is None else dict(params)
        # Prompt positions whose logprobs have been sent: a preempted request recomputes its prompt,
        # and must not send them twice.
        self.num_prompt_logprobs_sent = 0
        # QUEUED / SCHEDULED / PREEMPTED events the scheduler records, until the request's next
        # output takes them (vLLM: record_event, take_events).
        self.events: list[EngineCoreEvent] = []
        # Draft tokens to verify after the newest one (speculative decoding), set by the drafter
        # after a step and scheduled (then cleared) by the next.
        self.spec_token_ids: list[int] = []
        # Tokens sampled by steps still in flight, counted in num_computed_tokens but not yet in
        # num_tokens (async scheduling; always 0 without it).
        self.num_output_placeholders = 0
        # Its grammar and matcher (structured outputs: minicore/structured_output/manager.py).
        self.structured_output_request = None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> "Request":
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params,
                   request.eos_token_id, request.arrival_time, request.priority,
                   request.cache_salt)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's: a prefix-cache hit would skip the prompt positions it wants logprobs of."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """What num_computed_tokens catches up with: the known tokens and the drafts after them."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def take_events(self) -> list[EngineCoreEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
