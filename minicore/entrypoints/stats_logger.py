"""The periodic stats line: each engine's throughput since the last line and its state.

Mirrors LoggingStatLogger (vllm/v1/metrics/loggers.py) with vLLM's wording, and with
--speculative-config its SpecDecoding line (spec_decode_metrics.py). It reads the plain totals
ServerMetrics (metrics.py) keeps and the engines' latest SchedulerStats. Off with
--disable-log-stats, and with several API servers (each sees only its own requests), as vLLM's.
"""

import logging
import time

from minicore.entrypoints.metrics import ServerMetrics, StatsSource
from minicore.entrypoints.spec_decode_metrics import SpecDecodingLogging
from minicore.protocol import SchedulerStats
from minicore.spec_decode.metrics import sum_spec_stats

logger = logging.getLogger("minicore.stats")


class StatsLogger:
    """vLLM's periodic line per engine: throughput since the last line, and the engine's state,
    then its SpecDecoding line when it verified drafts since the last line. An idle engine logs
    once, then stays quiet until it has work again."""

    def __init__(self, metrics: ServerMetrics, stats: StatsSource):
        self.metrics, self.stats = metrics, stats
        self.last_time = time.monotonic()
        self.last_prompt = list(metrics.num_prompt_tokens)
        self.last_generation = list(metrics.num_generation_tokens)
        self.was_idle: dict[str, bool] = {}
        self.spec_decoding_logging = SpecDecodingLogging()

    def log(self) -> None:
        """One line per engine, and with several engines one for all of them together."""
        now = time.monotonic()
        elapsed = max(now - self.last_time, 1e-9)
        m = self.metrics
        lines = [(f"Engine {m.engine_labels[engine]:0>3}", s,
                  m.num_prompt_tokens[engine] - self.last_prompt[engine],
                  m.num_generation_tokens[engine] - self.last_generation[engine])
                 for engine, s in sorted(self.stats().items())]
        if len(lines) > 1:
            lines.append(("All engines", sum_stats([line[1] for line in lines]),
                          sum(line[2] for line in lines), sum(line[3] for line in lines)))
        for name, s, prompt, generation in lines:
            idle = not (prompt or generation or s.num_running_reqs or s.num_waiting_reqs)
            if idle and self.was_idle.get(name):
                continue
            self.was_idle[name] = idle
            hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0
            logger.info(
                "%s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
                "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%", name, prompt / elapsed, generation / elapsed,
                s.num_running_reqs, s.num_waiting_reqs, 100 * s.kv_cache_usage, 100 * hit_rate)
            self.spec_decoding_logging.log(name, s.spec_decoding_stats, elapsed)
        self.last_time = now
        self.last_prompt = list(m.num_prompt_tokens)
        self.last_generation = list(m.num_generation_tokens)


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several engines' stats as one (for the log line): sums, and the mean KV cache usage."""
    total = SchedulerStats(**{f: sum(getattr(s, f) for s in stats)
                              for f in SchedulerStats.__struct_fields__
                              if f != "spec_decoding_stats"})
    total.kv_cache_usage /= len(stats)
    total.spec_decoding_stats = sum_spec_stats(s.spec_decoding_stats for s in stats)
    return total
