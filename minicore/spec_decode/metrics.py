"""Speculative decoding's acceptance counters, as the scheduler counts them.

Mirrors SpecDecodingStats of vllm/v1/spec_decode/metrics.py, with the sums and differences of
counters that the server's line and the simulator take; the Prometheus counters and the
periodic log line that vLLM builds from them there (SpecDecodingProm, SpecDecodingLogging) are in
minicore/entrypoints/spec_decode_metrics.py. A wire record (msgspec), sent inside SchedulerStats.
"""

from collections.abc import Iterable

import msgspec

_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


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


def add_spec_stats(a: SpecDecodingStats, b: SpecDecodingStats | None,
                   sign: int = 1) -> SpecDecodingStats:
    """a + sign * b, counter by counter and position by position (a new record; b None: zeros)."""
    b = b or SpecDecodingStats.new(a.num_spec_tokens)
    return SpecDecodingStats(
        a.num_spec_tokens, **{f: getattr(a, f) + sign * getattr(b, f) for f in _COUNTS},
        num_accepted_tokens_per_pos=[x + sign * y for x, y in zip(
            a.num_accepted_tokens_per_pos, b.num_accepted_tokens_per_pos, strict=True)])


def sum_spec_stats(stats: Iterable[SpecDecodingStats | None]) -> SpecDecodingStats | None:
    """Several engines' stats as one; None when none has any (no speculative decoding)."""
    total = None
    for s in stats:
        if s is not None:
            total = add_spec_stats(s, total)
    return total
