"""minicore.testing, the public scheduler test harness: make_scheduler's keyword routing and
defaults, make_request, the fake model's rule and its scripts (a token now, a request's tokens in
order, a function), the Step record against hand-computed values (chunked prefill, a
self-preemption, a resume), scripted EOS and stop ids finishing a request and freeing its blocks,
run_until_finished, the module's purity, and examples/test_scheduler_patch.py, run as pytest runs
it so that the example cannot rot."""

import subprocess
import sys
from pathlib import Path

import pytest

from minicore.protocol import FinishReason
from minicore.scheduler import Scheduler
from minicore.scheduler.balance import BalanceScheduler
from minicore.testing import (
    FAKE_TOKEN_BASE,
    block,
    fake_model_output,
    free_ids,
    make_request,
    make_scheduler,
    num_free,
    outputs_by_id,
    run_until_finished,
    step,
)

ROOT = Path(__file__).resolve().parents[1]
EOS = 2


def test_make_scheduler_defaults_are_small():
    s = make_scheduler()
    assert type(s) is Scheduler
    sc, cc = s.scheduler_config, s.cache_config
    assert (sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len) == (8, 64, 64)
    assert (cc.block_size, cc.num_blocks, cc.enable_prefix_caching) == (4, 64, True)
    assert (sc.policy, sc.enable_chunked_prefill, sc.scheduler_reserve_full_isl) == (
        "fcfs", True, True)
    assert num_free(s) == 63 and free_ids(s)[:3] == [1, 2, 3]


def test_make_scheduler_routes_each_keyword_to_its_config_or_the_class():
    s = make_scheduler(cls=BalanceScheduler, dp_size=3, max_num_seqs=4, policy="priority",
                       balance_threshold="one-short", block_size=8, num_blocks=10,
                       enable_prefix_caching=False)
    assert type(s) is BalanceScheduler and s.balance_counts == [0, 0, 0]
    assert s.balance_limit == 3  # one-short: max_num_seqs - 1
    assert (s.scheduler_config.policy, s.cache_config.block_size) == ("priority", 8)
    assert not s.kv_cache_manager.enable_caching and num_free(s) == 9
    with pytest.raises(TypeError):
        make_scheduler(no_such_knob=1)  # neither config has it: it reaches Scheduler()


def test_make_request_gives_each_request_its_own_tokens_and_a_later_arrival():
    a = make_request("a", 3)
    b = make_request("b", 3, stop_token_ids=[7], min_tokens=1)
    c = make_request("c", 2, first_token=50, arrival_time=0.5)
    assert not set(a.prompt_token_ids) & set(b.prompt_token_ids)
    assert a.prompt_token_ids[1:] == [a.prompt_token_ids[0] + 1, a.prompt_token_ids[0] + 2]
    assert a.arrival_time < b.arrival_time and c.arrival_time == 0.5
    assert list(c.prompt_token_ids) == [50, 51]
    assert b.sampling_params.stop_token_ids == [7] and b.sampling_params.max_tokens == 16


def test_the_fake_model_samples_only_once_all_known_tokens_are_computed():
    s = make_scheduler(max_num_batched_tokens=6)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 5))
    out = s.schedule()  # a whole, b 2 of 5: mid-prefill
    mro = fake_model_output(s, out, {"a": 7, "b": 7})
    assert mro.req_ids == ["a", "b"] and mro.req_id_to_index == {"a": 0, "b": 1}
    assert mro.sampled_token_ids == [[7], []]  # a script does not make b sample early


def test_scripts_a_token_now_a_sequence_or_a_function():
    s = make_scheduler()
    for rid in "xyz":
        s.add_request(make_request(rid, 2, max_tokens=8))
    script = {"x": [5, 6]}  # x's 1st and 2nd outputs, then the default
    got = [step(s, script).tokens for _ in range(3)]
    assert [t["x"] for t in got] == [[5], [6], [FAKE_TOKEN_BASE + 2]]
    assert [t["y"] for t in got] == [[FAKE_TOKEN_BASE + i] for i in range(3)]
    assert step(s, {"y": 9}).tokens == {"x": [FAKE_TOKEN_BASE + 3], "y": [9],
                                         "z": [FAKE_TOKEN_BASE + 3]}
    assert step(s, lambda req: [len(req.request_id)]).tokens == {"x": [1], "y": [1], "z": [1]}


def test_step_record_against_hand_computed_values():
    # 4 usable blocks of 4, 10 tokens a step. a (8 tokens: 2 blocks) and the first 2 of b's 5
    # tokens (b's whole prompt needs 2 blocks: 2 are free) fit step 1.
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=10)
    s.add_request(make_request("a", 8, max_tokens=2))
    s.add_request(make_request("b", 5))
    st = step(s)
    assert (st.scheduled, st.new, st.cached, st.preempted) == ({"a": 8, "b": 2}, ["a", "b"],
                                                               [], set())
    assert st.tokens == {"a": [FAKE_TOKEN_BASE]}  # b is mid-prefill: no output
    assert [o.request_id for o in st.outputs] == ["a"] and st.finished == []
    assert (st.num_free, st.block_ids) == (1, {"a": [1, 2], "b": [3]})
    assert st.out.num_scheduled_tokens is st.scheduled
    # a's 9th token takes the last free block; b then needs a 2nd block: b, the last running
    # request, preempts itself. a reaches max_tokens: everything is free again.
    st = step(s)
    assert (st.scheduled, st.new, st.cached, st.preempted) == ({"a": 1}, [], ["a"], {"b"})
    assert st.finished == ["a"] and st.tokens == {"a": [FAKE_TOKEN_BASE + 1]}
    assert (st.num_free, st.block_ids) == (4, {})
    # Unhashed blocks head the free queue (b's 3, a's 4); a's full ones follow, last first.
    assert free_ids(s) == [4, 3, 2, 1]
    st = step(s)  # b resumes from scratch, sent as new
    assert (st.scheduled, st.new, st.cached) == ({"b": 5}, ["b"], [])
    assert st.out.finished_req_ids == {"a"}  # the runner's view: finished before this step
    assert (st.num_free, st.block_ids) == (2, {"b": [4, 3]})
    assert block(s, 4).ref_cnt == 1 and block(s, 1).ref_cnt == 0


@pytest.mark.parametrize("sp, token, reason, stop_reason", [
    ({"eos_token_id": EOS}, EOS, FinishReason.STOP, None),
    ({"stop_token_ids": [7]}, 7, FinishReason.STOP, 7),
])
def test_a_scripted_stop_finishes_the_request_and_frees_its_blocks(sp, token, reason,
                                                                   stop_reason):
    s = make_scheduler(num_blocks=10)
    s.add_request(make_request("r", 6, **sp))
    s.add_request(make_request("w", 2))
    st = step(s)
    assert st.finished == [] and st.block_ids == {"r": [1, 2], "w": [3]} and st.num_free == 6
    st = step(s, {"r": token})
    assert st.finished == ["r"] and st.tokens == {"r": [token], "w": [FAKE_TOKEN_BASE + 1]}
    o = outputs_by_id(st.outputs)["r"]
    assert (o.finish_reason, o.stop_reason) == (reason, stop_reason)
    assert st.block_ids == {"w": [3]} and st.num_free == 8 and "r" not in s.requests


def test_run_until_finished_returns_every_step_or_fails_after_max_steps():
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=3))
    steps = run_until_finished(s)
    assert [st.scheduled for st in steps] == [{"a": 4}, {"a": 1}, {"a": 1}]
    assert steps[-1].finished == ["a"] and run_until_finished(s) == []
    s.add_request(make_request("b", 4, max_tokens=3))
    with pytest.raises(AssertionError, match="after 2 steps"):
        run_until_finished(s, max_steps=2)


def test_the_harness_imports_no_heavy_module():
    code = ("import sys, minicore.testing\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'zmq', 'transformers'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_example_scheduler_patch_test_passes():
    # A subprocess: the example is collected and run exactly as a contributor would run it.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "examples/test_scheduler_patch.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
