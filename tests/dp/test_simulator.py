"""The DP simulator (minicore/dp/simulator.py) and `python -m minicore simulate`: its bookkeeping
with small exact numbers (when each request gets its tokens, when the balance gate is shut,
requests delivered one step late while a wave runs, drafts through the scheduler's draft path),
the acceptance models (scalar: Binomial counts; per-position: a prefix), conservation on random
workloads, and the command's output and JSON."""

import json
import random

import pytest

from minicore.__main__ import main
from minicore.config import CacheConfig, SchedulerConfig
from minicore.dp.simulator import (
    CostModel,
    DPSimulator,
    SimConfig,
    SimRequest,
    accepted_drafts,
    make_random_workload,
)

STEP_S = 0.010


def sim_config(dp=2, max_num_seqs=2, threshold=None, budget=256, **kwargs) -> SimConfig:
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=256, balance_scheduling=threshold is not None,
                                balance_threshold=threshold or "full")
    cache = CacheConfig(block_size=4, num_blocks=1 + max_num_seqs * 64,
                        enable_prefix_caching=False)
    # Every step, dummy or not, takes 10 ms: times below count steps.
    return SimConfig(dp, scheduler, cache, CostModel(STEP_S * 1000, 0, 0, 0), **kwargs)


def workload(output_lens: list[int], input_len: int = 4) -> list[SimRequest]:
    return [SimRequest(i, [100 + i] * input_len, n) for i, n in enumerate(output_lens)]


def steps_of(seconds: float) -> int:
    return round(seconds / STEP_S)


# Six requests at once on DP=2 with 2 slots per rank. Routing by 4 * waiting + running (ties to
# the lower rank) sends 0, 2, 4 to rank 0 and 1, 3, 5 to rank 1. Step 1 admits 0 and 2 on rank
# 0, 1 and 3 on rank 1; all but request 0 (4 tokens) finish there, so the gathered running counts
# are [1, 0] until request 0 ends in step 4. "full" (gate at 2) lets 4 and 5 in at step 2, as the
# baseline does; "one-short" (gate at 1) holds both until the counts read [0, 0] after step 4.
@pytest.mark.parametrize("threshold, first_step_of_4_and_5", [
    (None, 2), ("full", 2), ("one-short", 5)])
def test_gate_shut_exactly_while_a_rank_count_reaches_the_threshold(threshold,
                                                                   first_step_of_4_and_5):
    requests, steps = DPSimulator(sim_config(threshold=threshold),
                                  workload([4, 1, 1, 1, 1, 1])).run()
    assert [r.rank for r in requests] == [0, 1, 0, 1, 0, 1]
    assert [steps_of(r.chunk_times[0]) for r in requests[:4]] == [1, 1, 1, 1]
    assert [steps_of(r.chunk_times[0]) for r in requests[4:]] == [first_step_of_4_and_5] * 2
    assert steps_of(requests[0].chunk_times[-1]) == 4
    limit = {"full": 2, "one-short": 1}.get(threshold)
    for step in steps:
        if limit is None:
            assert not step.gated
            continue
        assert step.gated == (max(step.balance_counts) >= limit)
        if step.gated:
            assert step.num_admitted == [0, 0]
    if threshold == "one-short":
        assert [s.balance_counts for s in steps[:5]] == [[0, 0], [1, 0], [1, 0], [1, 0], [0, 0]]
        assert [s.gated for s in steps[:5]] == [False, True, True, True, False]


def test_request_sent_during_a_wave_misses_the_next_step():
    # One request in flight at a time. Request 0 prefills in step 1 and ends in step 2; request
    # 1, sent then, is still on its way while step 3 runs (a dummy step), and is admitted in step 4.
    requests, steps = DPSimulator(sim_config(dp=1, max_concurrency=1), workload([2, 1])).run()
    assert [steps_of(t) for t in requests[0].chunk_times] == [1, 2]
    assert steps_of(requests[1].send_time) == 2
    assert steps_of(requests[1].chunk_times[0]) == 4
    assert steps[2].num_scheduled_tokens == [0]


def test_idle_ranks_take_a_request_at_once_and_the_wave_ends_after_a_sync():
    # Poisson arrivals far apart: every request finds the wave over (32 steps after the last
    # work) and is taken in at its send time.
    requests, steps = DPSimulator(sim_config(dp=2, request_rate=0.5),
                                  workload([3, 3, 3])).run()
    for r in requests:
        assert r.chunk_times[0] == pytest.approx(r.send_time + STEP_S)
    assert len(steps) == 3 * 32


@pytest.mark.parametrize("rate, sizes, per_pos", [
    (1.0, [1, 4, 4], [2, 2, 2]), (0.0, [1] * 9, [0, 0, 0]),
    # Per position, a prefix: draft 2 is never verified as accepted once draft 1 was rejected.
    ((1.0, 0.0, 1.0), [1] + [2] * 4, [4, 0, 0]), ((1.0, 1.0, 0.0), [1, 3, 3, 2], [3, 3, 0])])
def test_speculative_decode_emits_accepted_drafts_and_one_more(rate, sizes, per_pos):
    simulator = DPSimulator(sim_config(dp=1, num_speculative_tokens=3, acceptance_rate=rate),
                            workload([9]))
    requests, steps = simulator.run()
    assert requests[0].chunk_sizes == sizes
    # Each decode schedules the newest token and the three drafts the scheduler was given.
    assert steps[1].num_scheduled_tokens == [4]
    stats = simulator.spec_decoding_stats()
    assert stats.num_drafts == len(sizes) - 1 and stats.num_draft_tokens == 3 * stats.num_drafts
    assert stats.num_accepted_tokens_per_pos == per_pos


def test_drafts_go_through_the_schedulers_draft_path():
    # The drafts are the scheduler's own: reported in scheduled_spec_decode_tokens, given back
    # after the update, and the tokens the made-up model emits.
    simulator = DPSimulator(sim_config(dp=1, num_speculative_tokens=2, acceptance_rate=1.0),
                            workload([5]))
    scheduler = simulator.ranks[0].scheduler
    seen = []
    schedule = scheduler.schedule

    def recording_schedule():
        so = schedule()
        seen.append(dict(so.scheduled_spec_decode_tokens))
        return so

    scheduler.schedule = recording_schedule
    simulator.run()
    # Prompt of 4 (positions 0-3), first token at 4, drafts for 5 and 6 (and 7 sampled); then
    # drafts for 8 and 9, though one token is left before max_tokens (vLLM's drafters do not
    # look at max_tokens: the update cuts the accepted run there).
    assert seen[:3] == [{}, {"0": [105, 106]}, {"0": [108, 109]}]
    assert seen[3:] == [{}] * (len(seen) - 3)


def test_a_decode_cut_by_the_token_budget_verifies_fewer_drafts():
    # Budget 6, two 3-token prompts: both complete in step 1; then request 0 takes 1 + 3 drafts
    # and request 1 the 2 tokens left (1 + 1 draft), until request 0 is done.
    requests, _ = DPSimulator(
        sim_config(dp=1, budget=6, num_speculative_tokens=3, acceptance_rate=1.0),
        workload([9, 9], input_len=3)).run()
    assert [r.chunk_sizes for r in requests] == [[1, 4, 4], [1, 2, 2, 4]]


@pytest.mark.parametrize("rate, expected", [
    (0.7, [1 - 0.3 ** 3, 3 * 0.7 ** 2 * 0.3 + 0.7 ** 3, 0.7 ** 3]),
    ((0.9, 0.5, 0.2), [0.9, 0.45, 0.09])])
def test_acceptance_models_per_position(rate, expected):
    # vLLM's per-position acceptance (accepted at position i / drafts): the Binomial's
    # P(count > i), and the prefix model's product of the rates up to i.
    rng, n = random.Random(0), 20000
    counts = [accepted_drafts([rng.random() for _ in range(3)], rate) for _ in range(n)]
    for i, want in enumerate(expected):
        assert sum(c > i for c in counts) / n == pytest.approx(want, abs=0.012)


def test_speculative_tokens_stop_at_max_tokens():
    requests, _ = DPSimulator(sim_config(dp=1, num_speculative_tokens=3, acceptance_rate=1.0),
                              workload([7])).run()
    assert requests[0].chunk_sizes == [1, 4, 2]


@pytest.mark.parametrize("threshold", [None, "full", "one-short"])
@pytest.mark.parametrize("client", [{}, {"max_concurrency": 5}, {"request_rate": 40.0}])
def test_every_request_answered_once_with_its_exact_length(threshold, client):
    work = make_random_workload(40, 24, 12, range_ratio=0.5, vocab_size=500, seed=3)
    config = sim_config(dp=3, max_num_seqs=3, threshold=threshold, num_speculative_tokens=2,
                        acceptance_rate=0.6, seed=3, **client)
    requests, steps = DPSimulator(config, work).run()
    assert all(r.num_output == r.output_len for r in requests)
    assert all(r.send_time is not None and r.chunk_times[0] > r.send_time for r in requests)
    assert all(times == sorted(times) for times in (r.chunk_times for r in requests))
    # Tokens are conserved: what the steps computed is every prompt, and every output token
    # bar the last (sampled, never fed back), plus the drafts that were rolled back.
    assert sum(map(sum, (s.num_scheduled_tokens for s in steps))) >= sum(
        len(r.prompt_token_ids) + r.output_len - 1 for r in requests)
    assert sum(map(sum, (s.num_admitted for s in steps))) == len(requests)
    if "max_concurrency" in client:
        events = sorted([(r.send_time, 1) for r in requests]
                        + [(r.chunk_times[-1], -1) for r in requests])
        in_flight = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
            in_flight += delta
            assert in_flight <= 5


@pytest.mark.parametrize("rate", [0.5, (0.8, 0.6, 0.4)])
def test_variants_see_the_same_workload_and_accepted_drafts(rate):
    def chunk_sizes(threshold):
        config = sim_config(dp=2, max_num_seqs=2, threshold=threshold, num_speculative_tokens=3,
                            acceptance_rate=rate, max_concurrency=4, seed=7)
        work = make_random_workload(12, 8, 20, seed=7)
        return [r.chunk_sizes for r in DPSimulator(config, work).run()[0]]

    assert chunk_sizes(None) == chunk_sizes("full")


def run_cli(tmp_path, capsys, *extra) -> tuple[dict, str]:
    path = tmp_path / "sim.json"
    argv = ["simulate", "--data-parallel-size", "2", "--max-num-seqs", "4", "--num-prompts",
            "24", "--random-input-len", "64", "--random-output-len", "16", "--max-concurrency",
            "8", "--result-file", str(path), *extra]
    main(argv)
    return json.loads(path.read_text()), capsys.readouterr().out


def test_simulate_command_prints_and_saves_each_variant(tmp_path, capsys):
    result, out = run_cli(tmp_path, capsys, "--num-speculative-tokens", "2")
    assert result["simulated"] is True
    assert {"baseline", "full", "one-short"} <= set(result)
    for name in ("baseline", "full", "one-short"):
        r = result[name]
        assert r["simulated"] is True and r["completed"] == 24
        assert r["total_input_tokens"] == 24 * 64 and r["total_output_tokens"] == 24 * 16
        assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
        for key in ("request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                    "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "max_concurrency"):
            assert key in r
    assert result["baseline"]["simulation"]["gated_steps"] == 0
    assert "SIMULATED" in out and "full / baseline" in out and "one-short / baseline" in out


@pytest.mark.parametrize("flags, variants", [
    (["--balance-threshold", "full"], {"baseline", "full"}),
    (["--no-balance-scheduling"], {"baseline"})])
def test_simulate_variant_flags(tmp_path, capsys, flags, variants):
    result, _ = run_cli(tmp_path, capsys, *flags)
    assert set(result) - {"simulated", "args"} == variants


@pytest.mark.parametrize("flags, message", [
    (["--acceptance-rate", "1.5"], "acceptance_rate must be in [0, 1], got 1.5"),
    (["--num-speculative-tokens", "3", "--acceptance-rate", "0.9,1.2,0.5"],
     "acceptance_rate must be in [0, 1], got 1.2"),
    (["--num-speculative-tokens", "3", "--acceptance-rate", "0.9,0.8"],
     "acceptance_rate: 2 per-position rates given for 3 speculative tokens")])
def test_simulate_rejects_bad_settings(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        run_cli(tmp_path, capsys, *flags)
    assert message in str(exc.value)


def test_simulate_rejects_a_rate_that_is_not_a_number(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli(tmp_path, capsys, "--acceptance-rate", "0.9;0.8")
    assert "comma-separated rates per draft position, got '0.9;0.8'" in capsys.readouterr().err


def test_simulate_takes_per_position_rates(tmp_path, capsys):
    result, out = run_cli(tmp_path, capsys, "--num-speculative-tokens", "2",
                          "--acceptance-rate", "1,0.5", "--no-balance-scheduling")
    assert result["args"]["acceptance_rate"] == [1.0, 0.5]
    spec = result["baseline"]["simulation"]["spec_decoding"]
    assert spec["acceptance_per_position"][0] == 1.0
    assert 0.3 < spec["acceptance_per_position"][1] < 0.7
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + sum(spec["acceptance_per_position"]))
    assert "baseline drafts (simulated): mean acceptance length" in out


def test_published_experiment_full_gate_beats_the_baseline(tmp_path, capsys):
    # vllm-ascend PR #5212's experiment at full scale (about 10 s): the gate lines prefills up.
    result, _ = run_cli(tmp_path, capsys, *"""--data-parallel-size 4 --max-num-seqs 32
        --max-num-batched-tokens 4096 --num-prompts 512 --random-input-len 3500
        --random-output-len 1500 --max-concurrency 128 --num-speculative-tokens 3
        --acceptance-rate 0.7 --balance-threshold full""".split())
    base, full = result["baseline"], result["full"]
    assert full["output_throughput"] > base["output_throughput"]
    assert full["mean_tpot_ms"] < base["mean_tpot_ms"]
    assert full["simulation"]["prefill_steps"] < base["simulation"]["prefill_steps"]


def test_the_simulator_steps_by_the_engines_own_rules():
    """Which steps sync (and so may end a wave) and when a rank runs a dummy batch are
    minicore/dp/wave.py's, imported by the DP engine and the simulator alike."""
    import minicore.dp.engine as engine
    import minicore.dp.simulator as simulator
    from minicore.dp import wave

    for rule in ("is_sync_step", "runs_dummy_batch"):
        assert getattr(engine, rule) is getattr(simulator, rule) is getattr(wave, rule)
    assert [n for n in range(1, 100) if wave.is_sync_step(n)] == [32, 64, 96]
    # (executed, has unfinished requests, wave running): a dummy batch only in place of a step
    # that ran nothing, while the wave runs or the rank holds requests.
    runs = {(e, u, r) for e in (False, True) for u in (False, True) for r in (False, True)
            if wave.runs_dummy_batch(e, u, r)}
    assert runs == {(False, True, False), (False, False, True), (False, True, True)}
