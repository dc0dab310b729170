"""Speculative decoding's metrics from hand-made SchedulerStats: vLLM's spec_decode_* counters
(names, help, labels, a series per engine and per draft position) read from the engines'
cumulative SpecDecodingStats, present only with a speculative config; and vLLM's SpecDecoding
line after each engine's stats line, over the interval since the previous one, for all engines
together too, and silent for an interval without drafts."""

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minicore.config import create_engine_config
from minicore.entrypoints.metrics import ServerMetrics
from minicore.entrypoints.stats_logger import StatsLogger, sum_stats
from minicore.protocol import SchedulerStats, SpecDecodingStats

MODEL = "m"
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
COUNTERS = {"vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
            "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
            "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position."}


def spec(num_drafts, num_draft_tokens, per_pos) -> SpecDecodingStats:
    return SpecDecodingStats(len(per_pos), num_drafts, num_draft_tokens, sum(per_pos),
                             list(per_pos))


def samples(metrics: ServerMetrics) -> dict[tuple, float]:
    """{(sample name, engine, position or None): value} of the spec_decode_* series."""
    return {(s.name, s.labels["engine"], s.labels.get("position")): s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples if "spec_decode" in s.name}


def test_counters_per_engine_and_position_as_vllms():
    stats = {0: SchedulerStats(spec_decoding_stats=spec(4, 12, [3, 3, 1])),
             1: SchedulerStats(spec_decoding_stats=spec(1, 3, [1, 0, 0]))}
    metrics = ServerMetrics(MODEL, 2, lambda: stats,
                            config=create_engine_config(speculative_config=SPEC))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert {name: (families[name].type, families[name].documentation) for name in COUNTERS} == \
        {name: ("counter", doc) for name, doc in COUNTERS.items()}
    assert {s.labels["model_name"] for name in COUNTERS for s in families[name].samples} == {MODEL}
    assert samples(metrics) == {
        ("vllm:spec_decode_num_drafts_total", "0", None): 4,
        ("vllm:spec_decode_num_drafts_total", "1", None): 1,
        ("vllm:spec_decode_num_draft_tokens_total", "0", None): 12,
        ("vllm:spec_decode_num_draft_tokens_total", "1", None): 3,
        ("vllm:spec_decode_num_accepted_tokens_total", "0", None): 7,
        ("vllm:spec_decode_num_accepted_tokens_total", "1", None): 1,
        **{("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0", str(p)): n
           for p, n in enumerate([3, 3, 1])},
        **{("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1", str(p)): n
           for p, n in enumerate([1, 0, 0])}}


def test_an_engine_without_stats_yet_reads_zero_at_every_position():
    stats = {0: SchedulerStats()}
    metrics = ServerMetrics(MODEL, 1, lambda: stats,
                            config=create_engine_config(speculative_config=SPEC))
    values = samples(metrics)
    assert len(values) == 3 + 3 and set(values.values()) == {0}


def test_no_spec_decode_series_without_a_speculative_config():
    stats = {0: SchedulerStats()}
    assert samples(ServerMetrics(MODEL, 1, lambda: stats)) == {}


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    return now


def log_lines(caplog, stats_logger, clock, at: float) -> list[str]:
    clock[0] = at
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minicore.stats"):
        stats_logger.log()
    return [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]


def test_the_line_covers_the_interval_and_is_silent_without_drafts(caplog, clock):
    counted = spec(4, 12, [3, 3, 1])
    stats = {0: SchedulerStats(num_running_reqs=1, spec_decoding_stats=counted)}
    metrics = ServerMetrics(MODEL, 1, lambda: stats)
    stats_logger = StatsLogger(metrics, lambda: stats)
    assert log_lines(caplog, stats_logger, clock, 10.0) == [
        "Engine 000: SpecDecoding metrics: Mean acceptance length: 2.75, Accepted throughput: "
        "0.70 tokens/s, Drafted throughput: 1.20 tokens/s, Accepted: 7 tokens, Drafted: 12 "
        "tokens, Per-position acceptance rate: 0.750, 0.750, 0.250, Avg Draft acceptance rate: "
        "58.3%"]
    # In-process the engine counts on into the same record: two drafts, one token accepted.
    counted.observe_draft(3, 1)
    counted.observe_draft(3, 0)
    assert log_lines(caplog, stats_logger, clock, 15.0) == [
        "Engine 000: SpecDecoding metrics: Mean acceptance length: 1.50, Accepted throughput: "
        "0.20 tokens/s, Drafted throughput: 1.20 tokens/s, Accepted: 1 tokens, Drafted: 6 "
        "tokens, Per-position acceptance rate: 0.500, 0.000, 0.000, Avg Draft acceptance rate: "
        "16.7%"]
    assert log_lines(caplog, stats_logger, clock, 20.0) == []


def test_each_engine_and_all_engines_get_a_line(caplog, clock):
    stats = {0: SchedulerStats(num_running_reqs=1, spec_decoding_stats=spec(2, 4, [2, 1])),
             1: SchedulerStats(num_running_reqs=1, spec_decoding_stats=spec(2, 4, [0, 0]))}
    stats_logger = StatsLogger(ServerMetrics(MODEL, 2, lambda: stats), lambda: stats)
    lines = log_lines(caplog, stats_logger, clock, 1.0)
    assert [line.split(":")[0] for line in lines] == ["Engine 000", "Engine 001", "All engines"]
    assert "Mean acceptance length: 1.75, Accepted throughput: 3.00 tokens/s, Drafted " \
           "throughput: 8.00 tokens/s, Accepted: 3 tokens, Drafted: 8 tokens, Per-position " \
           "acceptance rate: 0.500, 0.250, Avg Draft acceptance rate: 37.5%" in lines[2]


def test_summed_stats_add_drafts_position_by_position():
    total = sum_stats([SchedulerStats(num_running_reqs=1, spec_decoding_stats=spec(2, 4, [2, 1])),
                       SchedulerStats(num_running_reqs=2, spec_decoding_stats=spec(1, 2, [1, 0]))])
    assert total.num_running_reqs == 3
    assert total.spec_decoding_stats == spec(3, 6, [3, 1])
    assert sum_stats([SchedulerStats(), SchedulerStats()]).spec_decoding_stats is None
