"""Messages between the engine core and its clients, as msgspec Structs (msgpack on the wire).

Mirrors vllm/v1/engine/__init__.py (EngineCoreOutput, EngineCoreOutputs) and SchedulerStats from
vllm/v1/metrics/stats.py. msgspec is pure Python-facing and cheap to build, so the scheduler returns
these records directly and nothing is converted before they are sent.
"""

import msgspec

from minicore.request import FinishReason


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    # Cumulative counters; the frontend turns them into rates.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
