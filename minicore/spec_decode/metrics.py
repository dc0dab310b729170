"""Speculative decoding's acceptance counters, as the scheduler counts them.

The record, SpecDecodingStats (vllm/v1/spec_decode/metrics.py), is minicore/protocol.py's, as it
travels inside SchedulerStats; here are the sums and differences of counters that the server's line
and the simulator take; the Prometheus counters and the
periodic log line that vLLM builds from them there (SpecDecodingProm, SpecDecodingLogging) are in
minicore/entrypoints/spec_decode_metrics.py.
"""

from collections.abc import Iterable

from minicore.protocol import SpecDecodingStats

_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


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
