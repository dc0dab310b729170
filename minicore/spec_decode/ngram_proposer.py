"""NgramProposer: draft tokens by prompt lookup, the request's own tokens as the draft model.

Mirrors vllm/v1/spec_decode/ngram_proposer.py: after a step, for each request now decoding (the
selection is Drafter's, drafter.py), the longest suffix of its tokens (prompt_lookup_max tokens down
to prompt_lookup_min) that occurred earlier proposes the up to num_speculative_tokens tokens that
followed it. The most recent occurrence is taken (vLLM's KMP takes the earliest: the model verifies
either, only the acceptance may differ).
vLLM's numba kernels become bytes.rfind over the token ids packed as int32, each request's packing
extended in place by its new tokens, so a step costs a few C-level searches a request. Left out:
vLLM's batched numba propose across threads (one Python loop here; no numba dependency).
"""

from array import array

from minicore.spec_decode.config import SpeculativeConfig
from minicore.spec_decode.drafter import Drafter, DraftRequest

# Bytes per packed token id (array typecode "i": a C int, 4 bytes on every supported platform).
_ITEM = array("i").itemsize


class NgramProposer(Drafter):
    method = "ngram"

    @classmethod
    def verify_config(cls, config: SpeculativeConfig) -> None:
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
        if config.prompt_lookup_min is None and config.prompt_lookup_max is None:
            config.prompt_lookup_min = config.prompt_lookup_max = 5
        elif config.prompt_lookup_min is None:
            config.prompt_lookup_min = config.prompt_lookup_max
        elif config.prompt_lookup_max is None:
            config.prompt_lookup_max = config.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if not isinstance(value := getattr(config, name), int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, "
                                 f"got {value!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({config.prompt_lookup_min})"
                             f" must be <= prompt_lookup_max ({config.prompt_lookup_max})")

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        super().__init__(config, max_model_len)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        # req_id -> (its all_token_ids list, packed). The list only grows (a preempted request
        # keeps its outputs), so the packing is extended, never rebuilt, unless the id now names
        # another request (another list).
        self._packed: dict[str, tuple[list[int], bytearray]] = {}

    def forget(self, finished_req_ids: set[str]) -> None:
        for req_id in finished_req_ids:
            self._packed.pop(req_id, None)

    def propose_for(self, request: DraftRequest) -> list[int]:
        """The tokens that followed the most recent earlier occurrence of the request's longest
        matching suffix."""
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

    def _pack(self, request: DraftRequest) -> bytearray:
        """The request's token ids as int32 bytes, extended by the tokens since the last call."""
        cached = self._packed.get(request.request_id)
        tokens = request.all_token_ids
        if cached is None or cached[0] is not tokens:
            cached = (tokens, bytearray(array("i", tokens)))
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
