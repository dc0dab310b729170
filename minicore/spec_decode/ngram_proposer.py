"""NgramProposer: draft tokens by prompt lookup, the request's own tokens as the draft model.

Mirrors vllm/v1/spec_decode/ngram_proposer.py: after a step, for each request now decoding, the
longest suffix of its tokens (prompt_lookup_max tokens down to prompt_lookup_min) that occurred
earlier proposes the up to num_speculative_tokens tokens that followed it; none while
disable_by_batch_size requests or more run. The most recent occurrence is taken (vLLM's KMP takes
the earliest: the model verifies either, only the acceptance may differ).
vLLM's numba kernels become bytes.rfind over the token ids packed as int32, each request's packing
extended in place by its new tokens, so a step costs a few C-level searches a request. Left out:
vLLM's batched numba propose across threads (one Python loop here; no numba dependency).
"""

from array import array
from typing import TYPE_CHECKING

from minicore.request import Request, RequestStatus
from minicore.scheduler.spec_decode import DraftTokenIds
from minicore.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from minicore.scheduler import Scheduler, SchedulerOutput

# Bytes per packed token id (array typecode "i": a C int, 4 bytes on every supported platform).
_ITEM = array("i").itemsize


def decoding_requests(scheduler: "Scheduler", scheduler_output: "SchedulerOutput") -> list[Request]:
    """The step's requests a drafter proposes for: still running, with only the newest token
    left to compute (the scheduler drops the drafts of one still prefilling)."""
    requests = scheduler.requests
    return [request for req_id in scheduler_output.num_scheduled_tokens
            if (request := requests.get(req_id)) is not None
            and request.status == RequestStatus.RUNNING
            and request.num_tokens - request.num_computed_tokens == 1]


class NgramProposer:
    def __init__(self, speculative_config: SpeculativeConfig, max_model_len: int):
        self.k = speculative_config.num_speculative_tokens
        self.min_n = speculative_config.prompt_lookup_min
        self.max_n = speculative_config.prompt_lookup_max
        self.disable_by_batch_size = speculative_config.disable_by_batch_size
        self.max_model_len = max_model_len
        # req_id -> (the Request, its all_token_ids packed). all_token_ids only grows (a
        # preempted request keeps its outputs), so the packing is extended, never rebuilt, unless
        # the id now names another request.
        self._packed: dict[str, tuple[Request, bytearray]] = {}

    def propose(self, scheduler: "Scheduler", scheduler_output: "SchedulerOutput") -> None:
        """Set the draft tokens of the step's requests that now decode, through
        scheduler.update_draft_token_ids (vLLM's propose_draft_token_ids, then the update)."""
        for req_id in scheduler_output.finished_req_ids:
            self._packed.pop(req_id, None)
        requests = ([] if self.disable_by_batch_size
                    and len(scheduler.running) >= self.disable_by_batch_size
                    else decoding_requests(scheduler, scheduler_output))
        scheduler.update_draft_token_ids(DraftTokenIds(
            [r.request_id for r in requests], [self.propose_for(r) for r in requests]))

    def propose_for(self, request: Request) -> list[int]:
        """The draft of one request: the tokens that followed the most recent earlier occurrence
        of its longest matching suffix, at most k of them and none at or past max_model_len - 1
        (the verifying step writes 1 + len(draft) tokens)."""
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        k = min(self.k, self.max_model_len - 1 - num_tokens)
        if k <= 0:
            return []
        packed = self._pack(request)
        # An occurrence must start before the suffix does (it may overlap it): end the search
        # one token short of the end.
        end = (num_tokens - 1) * _ITEM
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = find_aligned(packed, packed[-n * _ITEM:], end)
            if start >= 0:
                return tokens[start + n:start + n + k]
        return []

    def _pack(self, request: Request) -> bytearray:
        """The request's token ids as int32 bytes, extended by the tokens since the last call."""
        cached = self._packed.get(request.request_id)
        tokens = request.all_token_ids
        if cached is None or cached[0] is not request:
            cached = (request, bytearray(array("i", tokens)))
            self._packed[request.request_id] = cached
        packed = cached[1]
        done = len(packed) // _ITEM
        if done < len(tokens):
            packed += array("i", tokens[done:])
        return packed


def find_aligned(packed: bytearray, needle: bytes, end: int) -> int:
    """The token index of the last occurrence of needle in packed[:end] that starts on a token
    boundary, or -1. A hit off the boundary (bytes of two tokens that happen to spell needle)
    narrows the search to before it."""
    while True:
        pos = packed.rfind(needle, 0, end)
        if pos < 0:
            return -1
        if pos % _ITEM == 0:
            return pos // _ITEM
        end = pos + len(needle) - 1
