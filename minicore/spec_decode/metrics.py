"""Speculative decoding's acceptance counters, as the scheduler counts them.

Mirrors SpecDecodingStats of vllm/v1/spec_decode/metrics.py; the Prometheus counters and the
periodic log line that vLLM builds from them there (SpecDecodingProm, SpecDecodingLogging) are in
minicore/entrypoints/spec_decode_metrics.py. A wire record (msgspec), sent inside SchedulerStats.
"""

import msgspec


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
