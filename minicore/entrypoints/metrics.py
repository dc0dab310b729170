"""Server metrics: Prometheus exposition for /metrics (the periodic log line: stats_logger.py).

Mirrors vllm/v1/metrics/loggers.py (PrometheusStatLogger) and the buckets of
vllm/v1/metrics/buckets.py: vLLM's metric names, help texts, buckets and labels (model_name and
engine="<DP rank>" on every series, as vLLM; no aggregate series, so sum() over engines is the
total). Two sources feed them: the engines' SchedulerStats (running, waiting, KV cache usage, and
the cumulative prefix-cache and preemption counters, which become Prometheus counters as they are,
at scrape time) and the frontend's RequestState of each request (tokens, its RequestStateStats
with the engine's QUEUED/SCHEDULED events and frame timestamps), recorded by OutputProcessor's
hooks as each engine frame is processed, as vLLM's IterationStats (so a slow reader does not skew
them). Process and Python collectors (process_*, python_*) are on the registry, as on vLLM's.
With --speculative-config, the spec_decode_* counters and the SpecDecoding line join them
(spec_decode_metrics.py); the dev routes time their sleep-mode and weight-transfer operations
(OperationMetrics). Counters and histograms keep prometheus_client's *_created series, as vLLM's.
With several API servers, prometheus_client's multiprocess mode sums every server's counters and
histograms (no process_* or *_created series then, as on vLLM).

The prefix (--metrics-prefix) is `vllm` by default, so vLLM's Grafana dashboard, aiperf's server
metrics views and alerts written for vLLM read minicore unchanged; `--metrics-prefix minicore`
keeps the two apart in one Prometheus (the model_name label alone would mix them).

Deviations: a request aborted by its client (frontend abort) counts in request_success with
finished_reason="abort" (vLLM counts only engine-finished requests) but is observed in no
histogram (as vLLM). request_params_n and request_max_num_generation_tokens are observed per
engine request, and the server runs n choices as n engine requests with n=1: a request with n=4
is four observations of n=1 (vLLM: one of n=4, with the longest choice's tokens).
The prefix cache hit rate in the log line is since start (vLLM: over the last 1000 requests).
Left out (nothing in minicore to measure): LoRA, multimodal cache, KV connector transfer stats
and external prefix cache, KV block residency (--kv-cache-metrics), NaN-corrupted and watermark
requests, admission rejections (no queue limits), prompt tokens by source, perf (MFU) stats.
"""

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from minicore.config import CacheConfig, EngineConfig
from minicore.engine.output_processor import RequestState
from minicore.entrypoints.spec_decode_metrics import spec_decode_counters
from minicore.protocol import FinishReason, SchedulerStats, SpecDecodingStats

DEFAULT_PREFIX = "vllm"
# prometheus_client's: set (by `serve --api-server-count`) before it is imported, it keeps every
# metric's values in files there, which each API server's /metrics sums.
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The control-plane operations' buckets, seconds (vLLM's).
OPERATION_BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)

# vLLM's bucket families (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
LABELS = ["model_name", "engine"]

StatsSource = Callable[[], dict[int, SchedulerStats]]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's request_tokens family (max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


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
    ("num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
)
WAITING_BY_REASON_HELP = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
    "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
    "status). Sum of all reasons equals {prefix}:num_requests_waiting.")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
SLEEP_STATE_HELP = (
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.")

# (attribute, metric, help, bucket family): the per-request histograms, as vLLM's.
HISTOGRAMS = (
    ("ttft", "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     TTFT_BUCKETS),
    ("itl", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     ITL_BUCKETS),
    ("tpot", "request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
    ("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     REQUEST_LATENCY_BUCKETS),
    ("queue", "request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
    ("inference", "request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
    ("prefill", "request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
    ("decode", "request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
    ("preemptions", "request_num_preemptions",
     "Histogram of the number of times a request was preempted.",
     REQUEST_NUM_PREEMPTIONS_BUCKETS),
    ("iteration_tokens", "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     ITERATION_TOKENS_BUCKETS),
    ("n", "request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
    # None: the request_tokens family (1-2-5 up to max_model_len).
    ("prompt_len", "request_prompt_tokens", "Number of prefill tokens processed.", None),
    ("generation_len", "request_generation_tokens", "Number of generation tokens processed.",
     None),
    ("max_generation", "request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", None),
    ("max_tokens", "request_params_max_tokens",
     "Histogram of the max_tokens request parameter.", None),
    ("prefill_kv_computed", "request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", None),
)
COUNTERS = (
    ("prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("prompt_tokens_cached", "prompt_tokens_cached",
     "Number of cached prompt tokens (local + external)."),
)


class SchedulerStatsCollector:
    """A custom Prometheus collector over the engines' latest SchedulerStats, one series per
    engine (no aggregate: sum() over engine is the total, as on vLLM); the spec_decode_* counters
    too when the engines draft num_spec_tokens tokens (0: no speculative decoding)."""

    def __init__(self, prefix: str, model_name: str, stats: StatsSource, num_spec_tokens: int = 0,
                 first_rank: int = 0):
        self.prefix, self.model_name, self.stats = prefix, model_name, stats
        self.num_spec_tokens, self.first_rank = num_spec_tokens, first_rank

    def collect(self):
        stats = [(str(self.first_rank + e), s) for e, s in sorted(self.stats().items())]
        for family, table in ((GaugeMetricFamily, ENGINE_GAUGES),
                              (CounterMetricFamily, ENGINE_COUNTERS)):
            for name, doc, field in table:
                metric = family(f"{self.prefix}:{name}", doc, labels=LABELS)
                for engine, s in stats:
                    metric.add_metric([self.model_name, engine], getattr(s, field))
                yield metric
        by_reason = GaugeMetricFamily(f"{self.prefix}:num_requests_waiting_by_reason",
                                      WAITING_BY_REASON_HELP.format(prefix=self.prefix),
                                      labels=LABELS + ["reason"])
        for engine, s in stats:
            deferred = s.num_deferred_waiting_reqs
            by_reason.add_metric([self.model_name, engine, "capacity"],
                                 s.num_waiting_reqs - deferred)
            by_reason.add_metric([self.model_name, engine, "deferred"], deferred)
        yield by_reason
        if self.num_spec_tokens:
            zeros = SpecDecodingStats.new(self.num_spec_tokens)
            yield from spec_decode_counters(self.prefix, self.model_name, LABELS, [
                (engine, s.spec_decoding_stats or zeros) for engine, s in stats])


class OperationMetrics:
    """vLLM's duration histogram and in-flight gauge of one kind of control-plane operation,
    labelled by operation (vllm/entrypoints/serve/dev/sleep/metrics.py,
    vllm/entrypoints/rl/online/metrics.py)."""

    def __init__(self, registry: CollectorRegistry, prefix: str, name: str, kind: str):
        self.duration = Histogram(f"{prefix}:{name}_operation_duration_seconds",
                                  f"Duration of one {kind} operation.", ["operation"],
                                  buckets=OPERATION_BUCKETS, registry=registry)
        self.in_flight = Gauge(f"{prefix}:{name}_operations_in_flight",
                               f"{kind.capitalize()} operations currently awaited.",
                               ["operation"], registry=registry, multiprocess_mode="livesum")

    @contextmanager
    def record(self, operation: str) -> Iterator[None]:
        in_flight = self.in_flight.labels(operation)
        in_flight.inc()
        started = time.perf_counter()
        try:
            yield
        finally:
            in_flight.dec()
            self.duration.labels(operation).observe(time.perf_counter() - started)


class ServerMetrics:
    """The Prometheus registry of one server, and the per-request recording that feeds it.
    config gives max_model_len (the token histograms' buckets) and the cache config
    (cache_config_info, with num_blocks: the engines' KV cache blocks); its defaults without one."""

    def __init__(self, model_name: str, num_engines: int, stats: StatsSource, *,
                 prefix: str = DEFAULT_PREFIX, config: EngineConfig | None = None,
                 num_blocks: int | None = None):
        config = config or EngineConfig()
        self.registry = reg = CollectorRegistry()
        if multiprocess_dir := os.environ.get(MULTIPROCESS_DIR_ENV):
            # One API server of several: every server's values, from prometheus_client's files.
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed, multiprocess_dir)
        else:
            self.exposed = reg
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)
            GCCollector(registry=reg)
        speculative = config.speculative_config
        # Labels are DP ranks: external or hybrid load balancing serves some from first_rank on.
        first_rank = config.parallel_config.engine_ranks.start
        self.exposed.register(SchedulerStatsCollector(
            prefix, model_name, stats, speculative.num_speculative_tokens if speculative else 0,
            first_rank))
        self.model_name, self._first_rank = model_name, first_rank
        token_buckets = build_1_2_5_buckets(config.scheduler_config.max_model_len)
        # The metrics with a series per engine, and those series, by engine.
        self._counter_metrics = {attr: Counter(f"{prefix}:{name}", doc, LABELS, registry=reg)
                                 for attr, name, doc in COUNTERS}
        self._histogram_metrics = {
            attr: Histogram(f"{prefix}:{name}", doc, LABELS, registry=reg,
                            buckets=token_buckets if buckets is None else buckets)
            for attr, name, doc, buckets in HISTOGRAMS}
        self._success_metric = Counter(f"{prefix}:request_success",
                                       "Count of successfully processed requests.",
                                       LABELS + ["finished_reason"], registry=reg)
        self.counters = {attr: [] for attr in self._counter_metrics}
        self.histograms = {attr: [] for attr in self._histogram_metrics}
        self._success = {str(reason): [] for reason in FinishReason}
        self._info_gauges(prefix, dataclasses.replace(config.cache_config, num_blocks=num_blocks))
        # Plain totals for the log line (prometheus_client does not expose its values).
        self.num_prompt_tokens: list[int] = []
        self.num_generation_tokens: list[int] = []
        # The tokens of the frame being processed, by engine: iteration_tokens_total.
        self._iteration_tokens: list[int] = []
        self.engine_labels: list[str] = []
        self.add_engines(num_engines)
        # The dev routes' operations (VLLM_SERVER_DEV_MODE=1): sleep, wake; weight transfer.
        self.sleep_operations = OperationMetrics(reg, prefix, "sleep_mode", "sleep-mode")
        self.weight_operations = OperationMetrics(reg, prefix, "rl_weight_update",
                                                  "weight-transfer")

    def _info_gauges(self, prefix: str, cache_config: CacheConfig) -> None:
        """cache_config_info (a gauge set to 1, labelled by the cache config's fields, vLLM's
        num_gpu_blocks for num_blocks) and engine_sleep_state (awake until set_sleep_levels)."""
        self._cache_info = {("num_gpu_blocks" if f.name == "num_blocks" else f.name):
                            str(getattr(cache_config, f.name))
                            for f in dataclasses.fields(cache_config)}
        self._cache_info_metric = Gauge(
            f"{prefix}:cache_config_info", "Information of the LLMEngine CacheConfig",
            list(self._cache_info) + ["engine"], registry=self.registry,
            multiprocess_mode="mostrecent")
        self.sleep_state = Gauge(f"{prefix}:engine_sleep_state", SLEEP_STATE_HELP,
                                 LABELS + ["sleep_state"], registry=self.registry,
                                 multiprocess_mode="mostrecent")

    def add_engines(self, num_engines: int) -> None:
        """Series for the engines up to num_engines (more after an elastic scale up; those of an
        engine a scale down removed stay, with their counts)."""
        for e in range(len(self.engine_labels), num_engines):
            label = str(self._first_rank + e)
            self.engine_labels.append(label)
            for attr, metric in self._counter_metrics.items():
                self.counters[attr].append(metric.labels(self.model_name, label))
            for attr, metric in self._histogram_metrics.items():
                self.histograms[attr].append(metric.labels(self.model_name, label))
            for reason in FinishReason:
                self._success[str(reason)].append(
                    self._success_metric.labels(self.model_name, label, str(reason)))
            self._cache_info_metric.labels(**self._cache_info, engine=label).set(1)
            for totals in (self.num_prompt_tokens, self.num_generation_tokens,
                           self._iteration_tokens):
                totals.append(0)
            self._set_sleep_level(label, 0)

    def set_sleep_levels(self, levels: list[int]) -> None:
        """Each engine's sleep level (0 awake, 1 weights offloaded, 2 all discarded), as
        AsyncLLM reports it after sleep and wake_up."""
        for label, level in zip(self.engine_labels, levels):
            self._set_sleep_level(label, level)

    def _set_sleep_level(self, label: str, level: int) -> None:
        for index, state in enumerate(SLEEP_STATES):
            self.sleep_state.labels(self.model_name, label, state).set(index == level)

    def on_new_tokens(self, state: RequestState, num_new_tokens: int,
                      interval: float | None) -> None:
        """OutputProcessor's hook: an engine output brought a request num_new_tokens tokens,
        interval seconds (engine clock) after its previous output (None: these are its first)."""
        engine = state.engine_index
        if interval is None:
            self.histograms["ttft"][engine].observe(state.stats.first_token_latency)
            num_prompt = len(state.prompt_token_ids)
            num_cached = max(state.num_cached_tokens, 0)
            self.counters["prompt_tokens"][engine].inc(num_prompt)
            self.counters["prompt_tokens_cached"][engine].inc(num_cached)
            self.num_prompt_tokens[engine] += num_prompt
            # As vLLM: a step's tokens are the prefills' computed prompt tokens + generated ones.
            self._iteration_tokens[engine] += num_prompt - num_cached
        else:
            self.histograms["itl"][engine].observe(interval)
        self.counters["generation_tokens"][engine].inc(num_new_tokens)
        self.num_generation_tokens[engine] += num_new_tokens
        self._iteration_tokens[engine] += num_new_tokens

    def on_iteration_end(self) -> None:
        """OutputProcessor's hook after each engine frame: one iteration_tokens_total sample."""
        for engine, num_tokens in enumerate(self._iteration_tokens):
            if num_tokens:
                self.histograms["iteration_tokens"][engine].observe(num_tokens)
                self._iteration_tokens[engine] = 0

    def on_request_finished(self, state: RequestState) -> None:
        """OutputProcessor's hook: a request finished. Its phases as vLLM's
        IterationStats.update_from_finished_request (RequestStateStats.phase_times)."""
        engine = state.engine_index
        self._success[state.finish_reason][engine].inc()
        if state.finish_reason == "abort":
            return  # the client went away: vLLM observes nothing for it
        s, h = state.stats, self.histograms
        num_generated = s.num_generation_tokens
        t = s.phase_times(time.monotonic())
        params = state.sampling_params
        num_cached = max(state.num_cached_tokens, 0)
        for attr, value in (
                ("e2e", t.e2e),
                ("queue", t.queue),
                ("prefill", t.prefill),
                ("decode", t.decode),
                ("inference", t.inference),
                ("tpot", t.decode / (num_generated - 1) if num_generated > 1 else 0),
                ("preemptions", s.num_preemptions),
                ("prefill_kv_computed", len(state.prompt_token_ids) - num_cached),
                ("prompt_len", len(state.prompt_token_ids)),
                ("generation_len", num_generated),
                ("max_generation", num_generated),
                ("n", params.n)):
            h[attr][engine].observe(value)
        if params.max_tokens:
            h["max_tokens"][engine].observe(params.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.exposed)
