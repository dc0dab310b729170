"""Metrics with vLLM's names, help texts, buckets and labels (issue 15), and the engine events they
are measured from: the scheduler's QUEUED/SCHEDULED/PREEMPTED events and how they reach the
frontend, OutputProcessor's RequestStateStats from them and the frames' timestamps, the Prometheus
exposition (per engine only, no aggregate: sum over engines is the total; process_/python_
collectors; --metrics-prefix), the stats log line, and one DP=2 server on the simulated runner."""

import asyncio
import logging
import time
from collections import defaultdict

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerProcess
from test_detokenizer import ByteTokenizer

from minicore.__main__ import make_parser
from minicore.config import create_engine_config
from minicore.engine.output_processor import OutputProcessor
from minicore.entrypoints.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    build_1_2_5_buckets,
)
from minicore.entrypoints.stats_logger import StatsLogger
from minicore.ports import free_port_pair
from minicore.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from minicore.request import FinishReason, RequestStatus
from minicore.sampling_params import SamplingParams
from minicore.testing import make_request, make_scheduler, step

MODEL = "m"
QUEUED, SCHEDULED, PREEMPTED = (EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED,
                                EngineCoreEventType.PREEMPTED)


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sample(text: str, name: str, **labels) -> float:
    """One sample's value; its labels must be exactly these."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"{name}{labels} not in the exposition")


def _by_engine(text: str) -> dict[tuple[str, str], float]:
    values = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name, sample.labels.get("engine")] += sample.value
    return values


# ----------------------------------------------------------------------------- engine events


def test_scheduler_records_queued_scheduled_and_preempted_events():
    s = make_scheduler(block_size=4, num_blocks=4, max_num_seqs=3)
    before = time.monotonic()
    requests = [make_request(i, n) for i, n in (("a", 4), ("b", 3), ("c", 4))]
    for r in requests:
        s.add_request(r)
    outputs = step(s).outputs
    first = {o.request_id: o.events for o in outputs}
    for events in first.values():  # both events ride on the first token's output
        assert [e.type for e in events] == [QUEUED, SCHEDULED]
        assert before <= events[0].timestamp <= events[1].timestamp <= time.monotonic()
    # All three were admitted by one step: one SCHEDULED time, the step's start (as vLLM).
    assert len({events[1].timestamp for events in first.values()}) == 1
    # a needs a second block: c, the last running, is preempted; its event waits for its output.
    outputs = step(s).outputs
    assert {o.request_id: o.events for o in outputs} == {"a": None, "b": None}
    assert [e.type for e in requests[2].events] == [PREEMPTED]
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    outputs = step(s).outputs
    (resumed,) = outputs
    assert [e.type for e in resumed.events] == [PREEMPTED, SCHEDULED]
    assert resumed.events[0].timestamp < resumed.events[1].timestamp
    assert requests[2].events == []


def test_events_cross_the_wire_as_the_last_field():
    events = [EngineCoreEvent(QUEUED, 1.5), EngineCoreEvent(SCHEDULED, 2.25)]
    frame = EngineCoreOutputs(0, [EngineCoreOutput("r", [7], events=events)], timestamp=3.0)
    wire = msgspec.msgpack.encode(frame)
    back = msgspec.msgpack.decode(wire, type=EngineCoreOutputs)
    assert back.outputs[0].events == events
    assert back.outputs[0].events[0].type is QUEUED
    assert msgspec.msgpack.decode(wire)[1][0][-1] == [[1, 1.5], [2, 2.25]]


def _request(request_id: str, prompt_len: int = 5, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(range(65, 65 + prompt_len)),
                             SamplingParams(**params), None, time.monotonic())


def test_request_state_stats_from_events_and_frame_timestamps():
    processor = OutputProcessor(ByteTokenizer())
    intervals = []
    processor.on_new_tokens = lambda state, n, interval: intervals.append(interval)
    state = processor.add_request(_request("r"), None)
    processor.process_outputs([EngineCoreOutput("r", [70, 71], events=[
        EngineCoreEvent(QUEUED, 10.0), EngineCoreEvent(SCHEDULED, 10.5)])], 11.0)
    processor.process_outputs([EngineCoreOutput("r", [72], events=[
        EngineCoreEvent(PREEMPTED, 11.5), EngineCoreEvent(SCHEDULED, 12.0)])], 12.75)
    s = state.stats
    assert (s.queued_ts, s.scheduled_ts, s.first_token_ts, s.last_token_ts) == (
        10.0, 10.5, 11.0, 12.75)  # a reschedule after preemption keeps the first SCHEDULED
    assert (s.num_generation_tokens, s.num_preemptions) == (3, 1)
    assert 0 <= s.first_token_latency < 60
    assert intervals == [None, 1.75]  # the engine clock's inter-token latency


# ----------------------------------------------------------------------------- exposition


class _Request:
    """Drives one request through a real OutputProcessor wired to ServerMetrics."""

    def __init__(self, processor, request_id, engine=0, prompt_len=5, cached=0, **params):
        self.processor, self.request_id, self.cached = processor, request_id, cached
        self.state = processor.add_request(_request(request_id, prompt_len, **params), None)
        self.state.engine_index = engine

    def output(self, ts, tokens, events=(), finish=None):
        events = [EngineCoreEvent(t, when) for t, when in events] or None
        self.processor.process_outputs([EngineCoreOutput(
            self.request_id, tokens, finish, num_cached_tokens=self.cached, events=events)], ts)


def _wired(num_engines=1, **kwargs):
    stats = {e: SchedulerStats() for e in range(num_engines)}
    metrics = ServerMetrics(MODEL, num_engines, lambda: stats, **kwargs)
    processor = OutputProcessor(ByteTokenizer())
    processor.on_new_tokens = metrics.on_new_tokens
    processor.on_request_finished = metrics.on_request_finished
    processor.on_iteration_end = metrics.on_iteration_end
    return metrics, processor, stats


def test_request_phases_tokens_and_params_observed_as_vllm():
    metrics, processor, _ = _wired(config=create_engine_config(max_model_len=1000))
    r = _Request(processor, "r", prompt_len=20, cached=8, max_tokens=50)
    r.output(100.0, [70], events=[(QUEUED, 99.0), (SCHEDULED, 99.25)])
    r.output(100.5, [71, 72])
    r.output(101.0, [73], finish=FinishReason.LENGTH)
    text = metrics.render().decode()
    labels = {"model_name": MODEL, "engine": "0"}

    def hist_sum(name):
        assert _sample(text, f"vllm:{name}_count", **labels) == 1
        return _sample(text, f"vllm:{name}_sum", **labels)

    assert hist_sum("request_queue_time_seconds") == 0.25
    assert hist_sum("request_prefill_time_seconds") == 0.75
    assert hist_sum("request_decode_time_seconds") == 1.0
    assert hist_sum("request_inference_time_seconds") == 1.75
    assert hist_sum("request_time_per_output_token_seconds") == pytest.approx(1.0 / 3)
    assert 0 <= hist_sum("e2e_request_latency_seconds") < 60
    assert hist_sum("request_num_preemptions") == 0
    assert hist_sum("request_prompt_tokens") == 20
    assert hist_sum("request_prefill_kv_computed_tokens") == 12
    assert hist_sum("request_generation_tokens") == 4
    assert hist_sum("request_max_num_generation_tokens") == 4
    assert hist_sum("request_params_max_tokens") == 50
    assert hist_sum("request_params_n") == 1
    assert _sample(text, "vllm:inter_token_latency_seconds_count", **labels) == 2
    assert _sample(text, "vllm:inter_token_latency_seconds_sum", **labels) == 1.0
    assert _sample(text, "vllm:time_to_first_token_seconds_count", **labels) == 1
    # One sample per frame: the first brings the 12 computed prompt tokens and 1 generated.
    assert _sample(text, "vllm:iteration_tokens_total_count", **labels) == 3
    assert _sample(text, "vllm:iteration_tokens_total_sum", **labels) == 13 + 2 + 1
    assert _sample(text, "vllm:prompt_tokens_total", **labels) == 20
    assert _sample(text, "vllm:prompt_tokens_cached_total", **labels) == 8
    assert _sample(text, "vllm:generation_tokens_total", **labels) == 4
    assert _sample(text, "vllm:request_success_total", finished_reason="length", **labels) == 1
    assert _sample(text, "vllm:request_success_total", finished_reason="stop", **labels) == 0
    # prometheus_client's *_created series, which vLLM 0.32 leaves on too.
    assert _sample(text, "vllm:generation_tokens_created", **labels) > 1e9


def test_names_help_buckets_and_labels_are_vllms():
    metrics, _, stats = _wired(config=create_engine_config(max_model_len=1000), num_blocks=99)
    stats[0] = SchedulerStats(3, 2, 0.5, 100, 40, 1, num_deferred_waiting_reqs=1)
    text = metrics.render().decode()
    families = _families(text)
    want = {
        "num_requests_running": "gauge", "num_requests_waiting": "gauge",
        "num_requests_waiting_by_reason": "gauge", "kv_cache_usage_perc": "gauge",
        "engine_sleep_state": "gauge", "cache_config_info": "gauge",
        "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
        "num_preemptions": "counter", "prompt_tokens": "counter", "generation_tokens": "counter",
        "prompt_tokens_cached": "counter", "request_success": "counter",
        "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
        "request_time_per_output_token_seconds": "histogram",
        "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
        "request_inference_time_seconds": "histogram",
        "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
        "request_num_preemptions": "histogram", "request_prompt_tokens": "histogram",
        "request_generation_tokens": "histogram", "request_max_num_generation_tokens": "histogram",
        "request_params_n": "histogram", "request_params_max_tokens": "histogram",
        "request_prefill_kv_computed_tokens": "histogram", "iteration_tokens_total": "histogram"}
    for name, kind in want.items():
        assert families[f"vllm:{name}"].type == kind, name
    assert families["vllm:request_queue_time_seconds"].documentation == (
        "Histogram of time spent in WAITING phase for request.")
    assert families["vllm:num_preemptions"].documentation == (
        "Cumulative number of preemption from the engine.")

    def buckets(name):
        return [float(s.labels["le"]) for s in families[f"vllm:{name}"].samples
                if s.name.endswith("_bucket")][:-1]

    assert buckets("time_to_first_token_seconds") == TTFT_BUCKETS
    assert buckets("inter_token_latency_seconds") == ITL_BUCKETS
    assert buckets("request_decode_time_seconds") == REQUEST_LATENCY_BUCKETS
    assert buckets("request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert buckets("request_params_n") == [1, 2, 5, 10, 20]
    assert buckets("iteration_tokens_total")[-1] == 16384
    labels = {"model_name": MODEL, "engine": "0"}
    assert _sample(text, "vllm:num_requests_waiting_by_reason", reason="capacity", **labels) == 1
    assert _sample(text, "vllm:num_requests_waiting_by_reason", reason="deferred", **labels) == 1
    assert _sample(text, "vllm:prefix_cache_hits_total", **labels) == 40
    assert _sample(text, "vllm:engine_sleep_state", sleep_state="awake", **labels) == 1
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["engine"] == "0"
    assert info.labels["num_gpu_blocks"] == "99" and info.labels["block_size"] == "16"
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes",
            "python_info", "python_gc_objects_collected_total"} <= {
        s.name for f in families.values() for s in f.samples}
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_a_client_abort_counts_but_is_observed_in_no_histogram():
    metrics, processor, _ = _wired()
    r = _Request(processor, "r")
    r.output(5.0, [70], events=[(QUEUED, 4.0), (SCHEDULED, 4.5)])
    processor.abort_requests(["r"])
    text = metrics.render().decode()
    labels = {"model_name": MODEL, "engine": "0"}
    assert _sample(text, "vllm:request_success_total", finished_reason="abort", **labels) == 1
    assert _sample(text, "vllm:e2e_request_latency_seconds_count", **labels) == 0
    assert _sample(text, "vllm:request_queue_time_seconds_count", **labels) == 0


def test_dp_series_are_per_engine_and_their_sum_is_the_total():
    metrics, processor, stats = _wired(num_engines=2)
    stats[0] = SchedulerStats(3, 1, 0.5, 10, 5, 0)
    stats[1] = SchedulerStats(1, 0, 0.25, 30, 0, 2)
    for i, engine in enumerate((0, 1, 1)):
        r = _Request(processor, f"r{i}", engine=engine, prompt_len=7)
        r.output(1.0, [70], events=[(QUEUED, 0.5), (SCHEDULED, 0.75)])
        r.output(2.0, [71], finish=FinishReason.STOP)
    text = metrics.render().decode()
    assert 'engine="all"' not in text
    v = _by_engine(text)
    assert (v["vllm:num_requests_running", "0"], v["vllm:num_requests_running", "1"]) == (3, 1)
    assert v["vllm:num_preemptions_total", "1"] == 2
    assert (v["vllm:prompt_tokens_total", "0"], v["vllm:prompt_tokens_total", "1"]) == (7, 14)
    assert v["vllm:request_success_total", "0"] + v["vllm:request_success_total", "1"] == 3
    assert v["vllm:e2e_request_latency_seconds_count", "1"] == 2


def test_metrics_prefix():
    metrics, _, _ = _wired(prefix="minicore")
    text = metrics.render().decode()
    assert "minicore:num_requests_running{" in text and "vllm" not in text
    parser = make_parser()
    assert parser.parse_args(["serve"]).metrics_prefix == "vllm"
    assert parser.parse_args(["serve", "--metrics-prefix", "mc_2"]).metrics_prefix == "mc_2"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--metrics-prefix", "bad:prefix"])


# ----------------------------------------------------------------------------- the log line


def test_stats_log_line_reports_throughput_and_is_quiet_when_idle(caplog, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    stats = {0: SchedulerStats(num_running_reqs=1, kv_cache_usage=0.125, prefix_cache_queries=10,
                               prefix_cache_hits=5)}
    metrics = ServerMetrics(MODEL, 1, lambda: stats)
    stats_logger = StatsLogger(metrics, lambda: stats)
    processor = OutputProcessor(ByteTokenizer())
    processor.on_new_tokens = metrics.on_new_tokens
    r = _Request(processor, "r", prompt_len=20)
    r.output(0.0, [70])
    r.output(0.0, [71] * 9)
    clock[0] = 10.0
    with caplog.at_level(logging.INFO, logger="minicore.stats"):
        stats_logger.log()
        stats[0] = SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=5)
        clock[0] = 20.0
        stats_logger.log()  # idle: logged once
        clock[0] = 30.0
        stats_logger.log()  # still idle: quiet
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("Engine 000: Avg prompt throughput: 2.0 tokens/s, Avg generation "
                        "throughput: 1.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, KV cache "
                        "usage: 12.5%, Prefix cache hit rate: 50.0%")
    assert len(lines) == 2 and "Running: 0 reqs" in lines[1]


def test_stats_line_prints_each_engine_and_all_together(caplog):
    stats = {0: SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5,
                               prefix_cache_queries=10, prefix_cache_hits=5),
             1: SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=30)}
    metrics = ServerMetrics(MODEL, 2, lambda: stats)
    with caplog.at_level(logging.INFO, logger="minicore.stats"):
        StatsLogger(metrics, lambda: stats).log()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["Engine 000", "Engine 001", "All engines"]
    assert "Running: 4 reqs, Waiting: 1 reqs, KV cache usage: 37.5%" in lines[2]
    assert "Prefix cache hit rate: 12.5%" in lines[2]


# ----------------------------------------------------------------------------- a DP=2 server


async def test_dp2_server_on_the_simulated_runner_sums_to_the_true_totals():
    num_requests, max_tokens = 12, 6
    with ServerProcess("--runner", "simulated", "--data-parallel-size", "2",
                       "--data-parallel-rpc-port", str(free_port_pair()),
                       "--max-model-len", "256") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async def complete(i):
                response = await http.post("/v1/completions", json={
                    "prompt": f"request {i} " * (i + 1), "max_tokens": max_tokens,
                    "ignore_eos": True})
                assert response.status_code == 200, response.text
                return response.json()["usage"]

            usages = await asyncio.gather(*(complete(i) for i in range(num_requests)))
            text = (await http.get("/metrics")).text
    v = _by_engine(text)
    assert 'engine="all"' not in text

    def total(name):
        return v[name, "0"] + v[name, "1"]

    assert v["vllm:request_success_total", "0"] > 0 and v["vllm:request_success_total", "1"] > 0
    assert total("vllm:request_success_total") == num_requests
    assert total("vllm:generation_tokens_total") == num_requests * max_tokens
    assert total("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "e2e_request_latency_seconds"):
        assert total(f"vllm:{name}_count") == num_requests, name
    # Every phase lies within the request's end-to-end latency.
    assert 0 < total("vllm:request_prefill_time_seconds_sum") < total(
        "vllm:e2e_request_latency_seconds_sum")
    assert 0 <= total("vllm:request_queue_time_seconds_sum") < total(
        "vllm:e2e_request_latency_seconds_sum")
    assert total("vllm:request_inference_time_seconds_sum") == pytest.approx(
        total("vllm:request_prefill_time_seconds_sum")
        + total("vllm:request_decode_time_seconds_sum"))
    assert v["process_resident_memory_bytes", None] > 0
