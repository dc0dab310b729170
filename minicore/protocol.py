"""Messages between the engine core and its clients, as msgspec Structs (msgpack on the wire).

Mirrors vllm/v1/engine/__init__.py (EngineCoreRequest, EngineCoreRequestType, EngineCoreOutput,
EngineCoreOutputs, UtilityOutput), SchedulerStats from vllm/v1/metrics/stats.py and the
SpecDecodingStats it carries (vllm/v1/spec_decode/metrics.py). msgspec is
cheap to build, so the scheduler returns these records directly and nothing is converted before
they are sent. Frames on the wire:

- frontend -> engine (ROUTER -> DEALER): [type byte (EngineCoreRequestType), msgpack payload];
  ADD carries an EngineCoreRequest, ABORT a list of request ids, UTILITY (call_id, method, args),
  START_DP_WAVE (wave, excluded engine index).
- engine -> frontend (PUSH -> PULL): one msgpack EngineCoreOutputs per frame, or, when the engine
  dies of a fatal error, the raw frame ENGINE_CORE_DEAD followed by its index as 2 bytes
  (little-endian): engine_dead_frame(i).

KV-transfer parameters travel as SamplingParams.kv_transfer_params (frontend -> engine) and
EngineCoreOutput.kv_transfer_params (engine -> frontend, on a finishing request's output).
Logprobs travel as LogprobsLists (vllm/v1/outputs.py): token ids, logprobs and ranks only; the
frontend decodes the tokens. Request events (EngineCoreEvent: QUEUED, SCHEDULED, PREEMPTED,
time.monotonic() in the engine) ride on the request's next EngineCoreOutput (vLLM:
Request.take_events); the frontend takes only differences between them and the frame's timestamp
(queue, prefill, decode and inference times).
Left out: multimodal features, LoRA, pooling.
"""

import enum
import time
from typing import Any

import msgspec

from minicore.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    # The engine refused the request, or it failed there (EngineCoreOutput.failed), alone.
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


def engine_dead_frame(engine_index: int) -> bytes:
    return ENGINE_CORE_DEAD + engine_index.to_bytes(2, "little")


def parse_engine_dead_frame(frame: bytes) -> int | None:
    """The engine index of an ENGINE_CORE_DEAD frame; None if the frame is not one."""
    if len(frame) != len(ENGINE_CORE_DEAD) + 2 or not frame.startswith(ENGINE_CORE_DEAD):
        return None
    return int.from_bytes(frame[len(ENGINE_CORE_DEAD):], "little")


class EngineCoreRequestType(enum.Enum):
    """The first frame of every frontend -> engine message: one byte, as in vLLM."""
    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    # A slots dataclass: msgspec runs its __post_init__ on decode, so a request with invalid
    # sampling values fails to decode in the engine (and is dropped) instead of reaching the
    # scheduler.
    sampling_params: SamplingParams
    eos_token_id: int | None
    # time.monotonic() in the frontend; the priority policy orders ties by it.
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    current_wave: int = 0


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of a run of positions (sampled tokens, or a chunk of prompt tokens)."""
    # Per position: [the token's id, top-1 id, ..., top-N id].
    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    # The token's own rank in the whole vocabulary (1 = the most likely).
    sampled_token_ranks: list[int]

    def slice(self, start: int, end: int | None = None) -> "LogprobsLists":
        return LogprobsLists(self.logprob_token_ids[start:end], self.logprobs[start:end],
                             self.sampled_token_ranks[start:end])


class EngineCoreEventType(enum.IntEnum):
    """The type of a request's engine event (vllm/v1/engine/__init__.py)."""
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    """A timestamped event of one request in the engine. The timestamp is time.monotonic() in the
    engine process: only differences with the same engine's timestamps mean anything."""
    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType,
                  timestamp: float | None = None) -> "EngineCoreEvent":
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # Why the request finished with ERROR: the engine refused it (the caller's fault) or, with
    # failed, it failed there once accepted (vLLM's FINISHED_ERROR; a server error).
    error_message: str | None = None
    failed: bool = False
    # What the KV connector returns for a finished request (request_finished): a prefill
    # instance's remote_engine_id, remote_block_ids, ... for the decode instance. None costs one
    # msgpack nil byte per output (array_like encodes every field; omit_defaults does not apply).
    kv_transfer_params: dict[str, Any] | None = None
    # The new tokens' logprobs, and a chunk of prompt logprobs (the frontend puts None first for
    # the first prompt token), for requests that asked.
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    # The request's engine events since its previous output (None: none).
    events: list[EngineCoreEvent] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Cumulative counters, on SchedulerStats (vLLM's are per step; the frontend sums them): drafts
    verified, their tokens, those accepted, and those accepted at each draft position."""
    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted_tokens):
            per_pos[i] += 1


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    # Cumulative counters; the frontend turns them into rates.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Of num_waiting_reqs, those parked while a KV connector loads their KV (vLLM counts them
    # apart, as num_skipped_waiting_reqs: num_requests_waiting_by_reason{reason="deferred"}).
    num_deferred_waiting_reqs: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None  # None without speculative decoding


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to one UTILITY call: its result, or why it failed."""
    call_id: int
    result: Any = None
    failure_message: str | None = None
    caller_error: bool = False  # the caller's (arguments, or a call the state refuses): a 4xx


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine sends in one frame: a step's outputs with the scheduler's stats, a
    utility result, or (for data parallelism) wave bookkeeping."""
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.monotonic() in the engine when the frame was made
    utility_output: UtilityOutput | None = None
    # ADD messages the engine has taken so far: the frontend's load balancer counts the requests
    # sent that an engine's stats do not include yet.
    num_received_requests: int = 0
    # Data parallel waves: rank 0 reports the wave that ended; an engine that got a request for an
    # ended wave asks for this one to start.
    wave_complete: int | None = None
    start_wave: int | None = None
