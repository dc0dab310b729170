"""Server metrics: Prometheus exposition for /metrics and the periodic stats log line.

Mirrors vllm/v1/metrics/loggers.py (PrometheusStatLogger, LoggingStatLogger) with vLLM's metric
names under a `minicore:` prefix, each labelled by model_name and engine. Two sources feed them:
the engines' SchedulerStats (running, waiting, KV cache usage, and the cumulative prefix-cache and
preemption counters, which become Prometheus counters as they are, at scrape time) and the
frontend's view of each request (tokens, time to first token, inter-token latency, end-to-end
latency, finish reason), recorded by OutputProcessor's hooks as each engine output is
processed, as vLLM's output processor does (so a slow reader does not skew them). Left
out: queue/prefill/decode time splits, per-request token histograms, spec-decode and LoRA metrics.
The prefix cache hit rate in the log line is since start (vLLM: over the last 1000 requests).
"""

import logging
import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minicore.engine.output_processor import RequestState
from minicore.protocol import SchedulerStats

logger = logging.getLogger("minicore.stats")

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
LABELS = ["model_name", "engine"]

StatsSource = Callable[[], dict[int, SchedulerStats]]


# (metric, help, SchedulerStats field): engine state, read from the latest stats at scrape time.
ENGINE_GAUGES = (
    ("num_requests_running", "Number of requests in model execution batches.", "num_running_reqs"),
    ("num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting_reqs"),
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
)
# The engine counts these cumulatively, so they are Prometheus counters as they are.
ENGINE_COUNTERS = (
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
    ("num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
)


class SchedulerStatsCollector:
    """A custom Prometheus collector over the engines' latest SchedulerStats. With several (DP)
    engines each series also has engine="all": the sum over the engines (the mean for KV cache
    usage), so leave it out when summing by hand: sum(...{engine!="all"})."""

    def __init__(self, model_name: str, stats: StatsSource):
        self.model_name, self.stats = model_name, stats

    def collect(self):
        stats = [(str(engine), s) for engine, s in sorted(self.stats().items())]
        if len(stats) > 1:
            stats.append(("all", sum_stats([s for _, s in stats])))
        for family, table in ((GaugeMetricFamily, ENGINE_GAUGES),
                              (CounterMetricFamily, ENGINE_COUNTERS)):
            for name, doc, field in table:
                metric = family(f"minicore:{name}", doc, labels=LABELS)
                for engine, s in stats:
                    metric.add_metric([self.model_name, engine], getattr(s, field))
                yield metric


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several engines' stats as one: sums, and the mean KV cache usage."""
    total = SchedulerStats(**{f: sum(getattr(s, f) for s in stats)
                              for f in SchedulerStats.__struct_fields__})
    total.kv_cache_usage /= len(stats)
    return total


class ServerMetrics:
    """The Prometheus registry of one server, and the per-request recording that feeds it."""

    def __init__(self, model_name: str, num_engines: int, stats: StatsSource):
        # As vLLM: no *_created series (a process-wide switch of prometheus_client).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.registry.register(SchedulerStatsCollector(model_name, stats))

        def per_engine(metric):
            return [metric.labels(model_name, str(e)) for e in range(num_engines)]

        reg = self.registry
        self._prompt_tokens = per_engine(Counter(
            "minicore:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=reg))
        self._generation_tokens = per_engine(Counter(
            "minicore:generation_tokens", "Number of generation tokens processed.", LABELS,
            registry=reg))
        self._ttft = per_engine(Histogram(
            "minicore:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            LABELS, buckets=TTFT_BUCKETS, registry=reg))
        self._itl = per_engine(Histogram(
            "minicore:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            LABELS, buckets=ITL_BUCKETS, registry=reg))
        self._e2e = per_engine(Histogram(
            "minicore:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", LABELS, buckets=E2E_BUCKETS,
            registry=reg))
        self._success = Counter("minicore:request_success",
                                "Count of successfully processed requests.",
                                LABELS + ["finished_reason"], registry=reg)
        self.model_name = model_name
        # Plain totals for the log line (prometheus_client does not expose its values).
        self.num_prompt_tokens = [0] * num_engines
        self.num_generation_tokens = [0] * num_engines

    def on_new_tokens(self, state: RequestState, num_new_tokens: int,
                      interval: float | None) -> None:
        """OutputProcessor's hook: an engine output brought a request num_new_tokens tokens,
        interval seconds after its previous output (None: these are its first)."""
        engine = state.engine_index
        if interval is None:
            self._ttft[engine].observe(state.stats.first_token_latency)
            num_prompt = len(state.prompt_token_ids)
            self._prompt_tokens[engine].inc(num_prompt)
            self.num_prompt_tokens[engine] += num_prompt
        else:
            self._itl[engine].observe(interval)
        self._generation_tokens[engine].inc(num_new_tokens)
        self.num_generation_tokens[engine] += num_new_tokens

    def on_request_finished(self, state: RequestState) -> None:
        """OutputProcessor's hook: a request finished (stop, length or abort)."""
        self._e2e[state.engine_index].observe(time.monotonic() - state.arrival_time)
        self._success.labels(self.model_name, str(state.engine_index), state.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogger:
    """vLLM's periodic line per engine: throughput since the last line, and the engine's state.
    An idle engine logs once, then stays quiet until it has work again."""

    def __init__(self, metrics: ServerMetrics, stats: StatsSource):
        self.metrics, self.stats = metrics, stats
        self.last_time = time.monotonic()
        self.last_prompt = list(metrics.num_prompt_tokens)
        self.last_generation = list(metrics.num_generation_tokens)
        self.was_idle: dict[str, bool] = {}

    def log(self) -> None:
        """One line per engine, and with several engines one for all of them together."""
        now = time.monotonic()
        elapsed = max(now - self.last_time, 1e-9)
        m = self.metrics
        lines = [(f"Engine {engine:03d}", s, m.num_prompt_tokens[engine] - self.last_prompt[engine],
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
        self.last_time = now
        self.last_prompt = list(m.num_prompt_tokens)
        self.last_generation = list(m.num_generation_tokens)
