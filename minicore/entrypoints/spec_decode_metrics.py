"""Speculative decoding on the server: the spec_decode_* Prometheus counters, the SpecDecoding line.

Mirrors SpecDecodingProm and SpecDecodingLogging of vllm/v1/spec_decode/metrics.py with vLLM's
names, help texts, labels and line; minicore/entrypoints/metrics.py adds them to /metrics and to
the stats log when --speculative-config is set. The engine sends cumulative counters
(SpecDecodingStats, minicore/spec_decode/metrics.py, on each SchedulerStats), so the Prometheus
counters are those values as they are at scrape time, as the prefix cache's, and the line is the
difference since the previous line, where vLLM sums each step's stats over the interval.
"""

import logging

from prometheus_client.core import CounterMetricFamily

from minicore.protocol import SpecDecodingStats
from minicore.spec_decode.metrics import add_spec_stats

logger = logging.getLogger("minicore.stats")

# (metric, help, SpecDecodingStats field), as vLLM's SpecDecodingProm.
SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
    ("spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
)
PER_POS_HELP = "Accepted tokens per draft position."


def spec_decode_counters(prefix: str, model_name: str, labels: list[str],
                         stats: list[tuple[str, SpecDecodingStats]]):
    """The spec_decode_* counter families: per (engine label, its cumulative stats) one series,
    and one per draft position."""
    for name, doc, field in SPEC_DECODE_COUNTERS:
        metric = CounterMetricFamily(f"{prefix}:{name}", doc, labels=labels)
        for engine, s in stats:
            metric.add_metric([model_name, engine], getattr(s, field))
        yield metric
    per_pos = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                                  PER_POS_HELP, labels=labels + ["position"])
    for engine, s in stats:
        for position, count in enumerate(s.num_accepted_tokens_per_pos):
            per_pos.add_metric([model_name, engine, str(position)], count)
    yield per_pos


class SpecDecodingLogging:
    """vLLM's SpecDecoding line, per named line of the stats log (an engine, or all of them),
    over the interval since that name's previous line; nothing for an interval without drafts."""

    def __init__(self):
        self.last: dict[str, SpecDecodingStats] = {}

    def log(self, name: str, stats: SpecDecodingStats | None, elapsed: float) -> None:
        if stats is None:
            return
        interval = add_spec_stats(stats, self.last.get(name), -1)
        # A copy: in-process, the engine goes on counting into the record it reported.
        self.last[name] = add_spec_stats(stats, None)
        if not interval.num_drafts:
            return
        drafts, drafted = interval.num_drafts, interval.num_draft_tokens
        accepted = interval.num_accepted_tokens
        rates = ", ".join(f"{n / drafts:.3f}" for n in interval.num_accepted_tokens_per_pos)
        logger.info(
            "%s: SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: "
            "%.2f tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            # As vLLM's, the mean acceptance length counts the bonus token.
            name, 1 + accepted / drafts, accepted / elapsed, drafted / elapsed, accepted, drafted,
            rates, 100 * accepted / drafted if drafted else float("nan"))
