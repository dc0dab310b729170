"""Scheduler semantics with small exact numbers: what each step schedules (FCFS and priority, with
and without chunked prefill and prefix caching), budget cuts, long_prefill_token_threshold (only
with more than one request), scheduler_reserve_full_isl admission, max_num_seqs, preemption
(victim choice, returned budget, self-victim stop, front of the waiting queue, recompute on
resume), stop conditions in their exact order (min_tokens is the sampler's), aborts,
num_cached_tokens, prefix-cache stats, add_request errors and request counts."""

import time

import pytest

from minicore.request import FinishReason, Request, RequestStatus
from minicore.sampling_params import SamplingParams
from minicore.scheduler.output import ModelRunnerOutput
from minicore.testing import (
    FAKE_TOKEN_BASE,
    fake_model_output,
    make_request,
    make_scheduler,
    num_free,
    outputs_by_id,
    run_until_finished,
    step,
)

POLICIES = ["fcfs", "priority"]
ABORT = RequestStatus.FINISHED_ABORTED


def _mro(sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    ids = list(sampled)
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[sampled[r] for r in ids],
    )


def spy_unscheduled_victims(s) -> list[str]:
    """Record the ids of priority victims that were unscheduled after being scheduled in the same
    step (the scheduler calls kv_cache_manager.uncache_blocks_after for exactly those); returns
    the list it appends to."""
    kv = s.kv_cache_manager
    calls: list[str] = []
    original = kv.uncache_blocks_after

    def spy(request, num_computed_tokens):
        calls.append(request.request_id)
        return original(request, num_computed_tokens)

    kv.uncache_blocks_after = spy
    return calls


# ---------------------------------------------------------------- records


def test_request_initial_state():
    r = make_request("a", [5, 6, 7], max_tokens=4)
    assert r.status == RequestStatus.WAITING
    assert r.num_computed_tokens == 0
    assert r.num_prompt_tokens == 3
    assert r.num_tokens == 3
    assert list(r.output_token_ids) == []
    assert r.num_output_tokens == 0
    assert list(r.all_token_ids) == [5, 6, 7]
    assert r.num_cached_tokens == -1
    assert r.num_preemptions == 0
    assert r.stop_reason is None
    assert not r.is_finished()
    assert r.get_finished_reason() is None


def test_request_arrival_time_defaults_to_monotonic():
    t0 = time.monotonic()
    r = Request(request_id="a", prompt_token_ids=[1], sampling_params=SamplingParams())
    assert t0 <= r.arrival_time <= time.monotonic()
    assert r.priority == 0 and r.cache_salt is None and r.eos_token_id is None


def test_request_empty_prompt_rejected():
    with pytest.raises(ValueError):
        Request(request_id="a", prompt_token_ids=[], sampling_params=SamplingParams())


def test_status_and_finish_reason_helpers():
    assert not RequestStatus.is_finished(RequestStatus.WAITING)
    assert not RequestStatus.is_finished(RequestStatus.RUNNING)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    for st in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
               RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_IGNORED):
        assert RequestStatus.is_finished(st)
    assert [str(FinishReason.STOP), str(FinishReason.LENGTH), str(FinishReason.ABORT)] == [
        "stop", "length", "abort"]


# ---------------------------------------------------------------- what each step schedules


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_basic_steps(policy, prefix_caching, chunked):
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, policy=policy,
                       enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked)
    for rid, n in (("a", 10), ("b", 5), ("c", 4)):
        s.add_request(make_request(rid, n, max_tokens=3))
    st1 = step(s)
    if chunked:
        assert st1.scheduled == {"a": 10, "b": 5, "c": 1}
        assert st1.out.total_num_scheduled_tokens == 16
        assert st1.new == ["a", "b", "c"]
        assert sorted(outputs_by_id(st1.outputs)) == ["a", "b"]  # c is mid-prefill: samples nothing
        assert s.requests["c"].num_output_tokens == 0
    else:
        # c (4 tokens) does not fit in the 1 token left: admission stops there
        assert st1.scheduled == {"a": 10, "b": 5}
        assert st1.out.total_num_scheduled_tokens == 15
        assert st1.new == ["a", "b"]
        assert s.get_request_counts() == (2, 1)
    assert st1.cached == []
    st2 = step(s)
    if chunked:
        assert st2.scheduled == {"a": 1, "b": 1, "c": 3}
        assert st2.new == []
        assert st2.cached == ["a", "b", "c"]
    else:
        assert st2.scheduled == {"a": 1, "b": 1, "c": 4}
        assert st2.new == ["c"]
        assert st2.cached == ["a", "b"]
    assert st2.out.total_num_scheduled_tokens == sum(st2.scheduled.values())
    assert s.requests["c"].num_output_tokens == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_chunked_prefill_across_steps(policy):
    s = make_scheduler(max_num_batched_tokens=8, policy=policy)
    a = make_request("a", 20, max_tokens=2)
    s.add_request(a)
    sched, computed, outs = [], [], []
    while s.has_unfinished_requests():
        st = step(s)
        sched.append(st.scheduled["a"])
        computed.append(a.num_computed_tokens)
        outs.append(len(st.outputs))
    assert sched == [8, 8, 4, 1]
    assert computed == [8, 16, 20, 21]
    assert outs == [0, 0, 1, 1]  # nothing sampled mid-prefill
    assert a.num_output_tokens == 2
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_num_computed_tokens_advances_inside_schedule():
    s = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 20)
    s.add_request(a)
    s.schedule()
    assert a.num_computed_tokens == 8
    assert a.status == RequestStatus.RUNNING


@pytest.mark.parametrize("policy", POLICIES)
def test_long_prefill_token_threshold(policy):
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=4, policy=policy)
    s.add_request(make_request("a", 10, max_tokens=5))
    s.add_request(make_request("b", 3, max_tokens=5))
    got = [step(s).scheduled for _ in range(3)]
    assert got == [{"a": 4, "b": 3}, {"a": 4, "b": 1}, {"a": 2, "b": 1}]
    assert s.requests["a"].num_output_tokens == 1


def test_long_prefill_threshold_without_chunking():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16,
                       long_prefill_token_threshold=4, enable_chunked_prefill=False)
    s.add_request(make_request("a", 10, max_tokens=5))
    s.add_request(make_request("b", 2, max_tokens=5))  # not alone: the threshold applies
    assert step(s).scheduled == {"a": 4, "b": 2}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunked", [True, False])
def test_long_prefill_threshold_only_with_more_than_one_request(policy, chunked):
    # vLLM applies long_prefill_token_threshold only when running + waiting > 1 at the start of
    # schedule(): a lone request has nobody to starve and prefills in one go, budget permitting.
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, long_prefill_token_threshold=4,
                       policy=policy, enable_chunked_prefill=chunked)
    s.add_request(make_request("a", 10, max_tokens=5))
    assert step(s).scheduled == {"a": 10}
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, long_prefill_token_threshold=4,
                       policy=policy, enable_chunked_prefill=chunked)
    s.add_request(make_request("a", 10, max_tokens=5))
    s.add_request(make_request("b", 10, max_tokens=5))
    assert step(s).scheduled == {"a": 4, "b": 4}


def test_long_prefill_threshold_counts_requests_at_schedule_start():
    # a alone: 10 tokens at once. Then b arrives: two requests, so both are cut to 4 (a decodes
    # 1). Once b is the only one left, its remaining prompt is no longer cut.
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=32, long_prefill_token_threshold=4)
    s.add_request(make_request("a", 10, max_tokens=1))
    assert step(s).scheduled == {"a": 10}  # a finishes (max_tokens=1)
    s.add_request(make_request("b", 14, max_tokens=2))
    s.add_request(make_request("c", 2, max_tokens=1))
    assert step(s).scheduled == {"b": 4, "c": 2}  # c finishes
    assert step(s).scheduled == {"b": 10}


@pytest.mark.parametrize("policy", POLICIES)
def test_max_num_seqs(policy):
    s = make_scheduler(max_num_seqs=2, policy=policy)
    s.add_request(make_request("a", 2, max_tokens=1))
    s.add_request(make_request("b", 2, max_tokens=5))
    s.add_request(make_request("c", 2, max_tokens=5))
    out1 = step(s).out
    assert out1.num_scheduled_tokens == {"a": 2, "b": 2}
    assert s.get_request_counts() == (1, 1)  # a finished (max_tokens=1)
    out2 = step(s).out
    assert out2.num_scheduled_tokens == {"b": 1, "c": 2}
    assert s.get_request_counts() == (2, 0)


def test_max_num_seqs_counts_running_before_step():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 2, max_tokens=5))
    step(s)
    out = step(s).out
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert s.get_request_counts() == (2, 1)


def test_no_chunking_no_skipping_to_shorter_request():
    s = make_scheduler(max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False)
    s.add_request(make_request("a", 60, max_tokens=5))
    s.add_request(make_request("b", 50, max_tokens=5))
    s.add_request(make_request("c", 10, max_tokens=5))
    out1 = step(s).out
    assert out1.num_scheduled_tokens == {"a": 60}  # c would fit, but b is ahead of it
    assert s.requests["b"].status == RequestStatus.WAITING
    out2 = step(s).out
    assert out2.num_scheduled_tokens == {"a": 1, "b": 50, "c": 10}


def test_chunking_cuts_to_remaining_budget():
    s = make_scheduler(max_num_batched_tokens=100, max_model_len=100)
    s.add_request(make_request("a", 60, max_tokens=5))
    s.add_request(make_request("b", 50, max_tokens=5))
    s.add_request(make_request("c", 10, max_tokens=5))
    out1 = step(s).out
    assert out1.num_scheduled_tokens == {"a": 60, "b": 40}
    out2 = step(s).out
    assert out2.num_scheduled_tokens == {"a": 1, "b": 10, "c": 10}


def test_running_request_with_nothing_to_schedule_is_skipped():
    # schedule twice without an update in between (as an async engine does): a has all its
    # tokens computed and nothing new, b behind it is still mid-prefill and must go on.
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 12))
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"a": 4, "b": 6}
    mro1 = fake_model_output(s, out1)
    s.add_request(make_request("c", 3))
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {"b": 6, "c": 3}
    mro2 = fake_model_output(s, out2)
    s.update_from_output(out1, mro1)
    s.update_from_output(out2, mro2)
    assert [s.requests[r].num_output_tokens for r in "abc"] == [1, 1, 1]
    assert s.requests["b"].num_computed_tokens == 12


def test_fcfs_admission_ignores_priority():
    s = make_scheduler(max_num_seqs=1, policy="fcfs")
    s.add_request(make_request("a", 2, max_tokens=1, priority=5))
    s.add_request(make_request("b", 2, max_tokens=1, priority=0))
    assert list(step(s).scheduled) == ["a"]
    assert list(step(s).scheduled) == ["b"]


def test_priority_admission_order():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_request("a", 2, max_tokens=1, priority=2, arrival_time=1.0))
    s.add_request(make_request("b", 2, max_tokens=1, priority=0, arrival_time=3.0))
    s.add_request(make_request("c", 2, max_tokens=1, priority=0, arrival_time=2.0))
    s.add_request(make_request("d", 2, max_tokens=1, priority=-1, arrival_time=9.0))
    order = [list(step(s).scheduled) for _ in range(4)]
    assert order == [["d"], ["c"], ["b"], ["a"]]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunked", [True, False])
def test_prefix_hit_in_same_step_changes_what_is_scheduled(policy, chunked):
    for prefix_caching, expected_b in ((True, 1), (False, 9)):
        s = make_scheduler(block_size=4, policy=policy, enable_chunked_prefill=chunked,
                           enable_prefix_caching=prefix_caching)
        s.add_request(make_request("a", list(range(9)), max_tokens=2))
        s.add_request(make_request("b", list(range(9)), max_tokens=2))
        out = step(s).out
        assert out.num_scheduled_tokens == {"a": 9, "b": expected_b}
        assert s.requests["b"].num_cached_tokens == 9 - expected_b


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_reserve_full_isl_admits_only_a_whole_sequence_that_fits(policy, reserve_full_isl):
    # 4 usable blocks of 4; a holds 1. b (16 tokens) needs 4 blocks in all, but its first chunk
    # (7 tokens, the budget left) needs only 2 of the 3 free.
    s = make_scheduler(block_size=4, num_blocks=5, max_num_batched_tokens=8, max_model_len=32,
                       policy=policy, scheduler_reserve_full_isl=reserve_full_isl)
    a = make_request("a", 2, max_tokens=3)  # at most 4 computed tokens: 1 block throughout
    s.add_request(a)
    assert step(s).scheduled == {"a": 2}
    b = make_request("b", 16, max_tokens=1)
    s.add_request(b)
    st = step(s)
    if reserve_full_isl:
        assert st.scheduled == {"a": 1}  # b's whole prompt does not fit: waits
        assert b.status == RequestStatus.WAITING and num_free(s) == 3
        st = step(s)  # a's last token: a finishes
        assert st.scheduled == {"a": 1} and a.is_finished()
        assert step(s).scheduled == {"b": 8}  # 4 free blocks: b fits whole now
    else:
        assert st.scheduled == {"a": 1, "b": 7}
        assert st.new == ["b"] and num_free(s) == 1
    assert b.status == RequestStatus.RUNNING


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_reserve_full_isl_counts_prefix_hits_taken_from_the_free_queue(reserve_full_isl):
    # p leaves its 2 full blocks cached in the free queue. q holds 1 block. r (20 tokens: 5
    # blocks) hits those 2: it needs 3 more, and only 2 of the 4 free blocks are not its own hits.
    # Its first chunk (7 tokens after the 8 hit: 2 new blocks) would fit.
    s = make_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=8, max_model_len=32,
                       scheduler_reserve_full_isl=reserve_full_isl)
    doc = list(range(500, 508))
    s.add_request(make_request("p", doc, max_tokens=1))
    run_until_finished(s)
    q = make_request("q", 2, max_tokens=3)
    s.add_request(q)
    assert step(s).scheduled == {"q": 2}
    assert num_free(s) == 4
    r = make_request("r", doc + list(range(600, 612)), max_tokens=1)
    s.add_request(r)
    out = step(s).out
    if reserve_full_isl:
        assert out.num_scheduled_tokens == {"q": 1}
        assert r.status == RequestStatus.WAITING and r.num_cached_tokens == -1
        assert num_free(s) == 4  # the hit blocks were not taken
        step(s)  # q finishes: 5 free, 3 of them not r's hits
        out = step(s).out
        assert out.num_scheduled_tokens == {"r": 8} and r.num_cached_tokens == 8
    else:
        assert out.num_scheduled_tokens == {"q": 1, "r": 7}
        assert r.num_cached_tokens == 8 and num_free(s) == 0


def test_reserve_full_isl_does_not_apply_to_running_requests():
    # 6 usable blocks of 4, chunks of 4 (two requests: the threshold applies). a (20 tokens) is
    # admitted while its 5 blocks fit; b's decode then takes a block, and a's remaining 12 tokens
    # (3 blocks) no longer fit the 2 free blocks: a running request only needs its chunk.
    s = make_scheduler(block_size=4, num_blocks=7, max_num_batched_tokens=16,
                       long_prefill_token_threshold=4)
    a = make_request("a", 20)
    s.add_request(a)
    s.add_request(make_request("b", 4))
    assert step(s).scheduled == {"a": 4, "b": 4}
    assert step(s).scheduled == {"a": 4, "b": 1}  # b's 5th token: a 2nd block
    assert num_free(s) == 2 and a.num_tokens - a.num_computed_tokens == 12
    out = step(s).out
    assert out.num_scheduled_tokens == {"a": 4, "b": 1} and not out.preempted_req_ids
    assert num_free(s) == 1


# ---------------------------------------------------------------- preemption


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_fcfs_preempts_last_running_and_resumes_by_recompute(prefix_caching):
    s = make_scheduler(block_size=4, num_blocks=4, max_num_seqs=3,
                       enable_prefix_caching=prefix_caching)
    a, b, c, d = (make_request("a", 4), make_request("b", 3), make_request("c", 4),
                  make_request("d", 2))
    for r in (a, b, c, d):
        s.add_request(r)
    out1 = step(s).out
    assert out1.num_scheduled_tokens == {"a": 4, "b": 3, "c": 4}
    assert num_free(s) == 0
    # a needs a 2nd block, none is free: the victim is the LAST running request (c), not b
    st2 = step(s)
    assert st2.scheduled == {"a": 1, "b": 1}
    assert st2.preempted == {"c"}
    assert "c" not in outputs_by_id(st2.outputs)
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert list(c.output_token_ids) == [FAKE_TOKEN_BASE]  # output kept
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert s.kv_cache_manager.get_block_ids("c") == []
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c", "d"]  # front of the waiting queue
    assert s.get_request_counts() == (2, 2)
    # free everything else: c is resumed first and recomputes prompt + output (5 tokens)
    s.finish_requests(["a", "b"], ABORT)
    st3 = step(s)
    assert st3.scheduled == {"c": 5, "d": 2}
    assert st3.new == ["c", "d"]
    assert set(st3.out.finished_req_ids) == {"a", "b"}
    assert list(st3.preempted) == []
    assert c.status == RequestStatus.RUNNING
    assert c.num_computed_tokens == 5
    assert outputs_by_id(st3.outputs)["c"].new_token_ids == [FAKE_TOKEN_BASE + 1]
    assert c.num_preemptions == 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_priority_victim_already_scheduled_returns_its_budget(prefix_caching):
    # reserve_full_isl off: z (100 tokens, 25 blocks) must be admitted with a first chunk only.
    s = make_scheduler(block_size=4, num_blocks=10, max_num_batched_tokens=16, max_model_len=128,
                       policy="priority", enable_prefix_caching=prefix_caching,
                       scheduler_reserve_full_isl=False)
    unscheduled = spy_unscheduled_victims(s)
    x = make_request("x", 16, priority=1, arrival_time=0.0)
    s.add_request(x)
    assert step(s).scheduled == {"x": 16}  # 4 blocks
    s.add_request(make_request("y", 4, priority=0, arrival_time=1.0))
    s.add_request(make_request("z", 100, priority=0, arrival_time=2.0))
    out2 = step(s).out
    assert out2.num_scheduled_tokens == {"x": 1, "y": 4, "z": 11}  # 5 + 1 + 3 blocks
    assert num_free(s) == 0
    # x (scheduled first) is fine; y needs a block -> the worst request, x, is preempted and the
    # token it was given returns to the budget, so z gets 15 instead of 14.
    st3 = step(s)
    assert unscheduled == ["x"]  # x was unscheduled after being scheduled this step
    assert st3.preempted == {"x"}
    assert st3.scheduled == {"y": 1, "z": 15}
    assert st3.out.total_num_scheduled_tokens == 16
    assert "x" not in st3.cached
    assert x.status == RequestStatus.PREEMPTED
    assert x.num_computed_tokens == 0
    assert x.num_output_tokens == 2
    assert [r.request_id for r in s.running] == ["y", "z"]
    assert [r.request_id for r in s.waiting] == ["x"]


def test_two_priority_victims_already_scheduled_for_one_request():
    # running is [b, a, c, d]; b and a decode within their blocks, then c's next chunk needs two
    # blocks from an empty pool: a, then b (both scheduled before c) are unscheduled and
    # preempted. c moves from index 2 to 0, and d after it is still scheduled, not skipped.
    # reserve_full_isl off: c (16 tokens, 4 blocks) must be admitted with 3 blocks free.
    s = make_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=16, max_model_len=64,
                       long_prefill_token_threshold=8, policy="priority",
                       scheduler_reserve_full_isl=False)
    unscheduled = spy_unscheduled_victims(s)
    s.add_request(make_request("a", 2, priority=2, arrival_time=0.0))
    s.add_request(make_request("b", 2, priority=1, arrival_time=1.0))
    step(s)
    s.add_request(make_request("c", 16, priority=0, arrival_time=2.0))
    s.add_request(make_request("d", 2, priority=0, arrival_time=3.0))
    assert step(s).scheduled == {"b": 1, "a": 1, "c": 8, "d": 2}
    assert num_free(s) == 0
    st = step(s)
    assert unscheduled == ["a", "b"]
    assert st.preempted == {"a", "b"}
    assert st.scheduled == {"c": 8, "d": 1}
    assert st.cached == ["c", "d"]
    assert st.out.total_num_scheduled_tokens == 9
    assert [r.request_id for r in s.running] == ["c", "d"]
    assert [r.request_id for r in s.waiting] == ["b", "a"]


@pytest.mark.parametrize("policy", POLICIES)
def test_victim_choice_and_self_preemption_stops_running_pass(policy):
    s = make_scheduler(block_size=4, num_blocks=3, policy=policy)
    x = make_request("x", 3, priority=1, arrival_time=0.0)
    s.add_request(x)
    step(s)
    y = make_request("y", 2, priority=0, arrival_time=1.0)
    s.add_request(y)
    assert step(s).scheduled == {"x": 1, "y": 2}
    assert num_free(s) == 0
    out3 = step(s).out  # x needs a second block
    if policy == "fcfs":
        # victim = last of running = y
        assert out3.num_scheduled_tokens == {"x": 1}
        assert set(out3.preempted_req_ids) == {"y"}
        assert y.status == RequestStatus.PREEMPTED
    else:
        # victim = worst (priority, arrival) = x itself: the running pass stops, so y is not
        # scheduled although it needs no new block
        assert out3.num_scheduled_tokens == {}
        assert out3.total_num_scheduled_tokens == 0
        assert set(out3.preempted_req_ids) == {"x"}
        assert x.status == RequestStatus.PREEMPTED
        assert y.status == RequestStatus.RUNNING
        assert y.num_computed_tokens == 2
        assert num_free(s) == 1
        out4 = step(s).out
        assert out4.num_scheduled_tokens == {"y": 1}  # x (5 tokens, 2 blocks) does not fit yet


def test_priority_victim_by_arrival_when_same_priority():
    s = make_scheduler(block_size=4, num_blocks=4, policy="priority")
    new = make_request("new", 2, priority=0, arrival_time=5.0)
    s.add_request(new)
    step(s)  # "new" is admitted first, so it is first in running
    s.add_request(make_request("old", 4, priority=0, arrival_time=1.0))
    s.add_request(make_request("pad", 3, priority=0, arrival_time=3.0))
    out2 = step(s).out
    assert out2.num_scheduled_tokens == {"new": 1, "old": 4, "pad": 3}
    assert [r.request_id for r in s.running] == ["new", "old", "pad"]
    assert num_free(s) == 0
    # old needs a block: victim = max (priority, arrival) = "new" (arrival 5.0), although it is
    # first in running and was already scheduled this step -> unscheduled
    out3 = step(s).out
    assert set(out3.preempted_req_ids) == {"new"}
    assert out3.num_scheduled_tokens == {"old": 1, "pad": 1}
    assert new.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in s.running] == ["old", "pad"]


def test_no_admission_in_a_step_that_preempted():
    s = make_scheduler(block_size=4, num_blocks=4, policy="priority")
    y = make_request("y", 4, priority=0, arrival_time=1.0)
    x = make_request("x", 4, priority=1, arrival_time=0.0)
    s.add_request(x)
    s.add_request(y)
    out1 = step(s).out
    assert list(out1.num_scheduled_tokens) == ["y", "x"]
    w = make_request("w", 2, priority=-1, arrival_time=2.0)
    s.add_request(w)
    out2 = step(s).out
    assert out2.num_scheduled_tokens == {"y": 1}
    assert set(out2.preempted_req_ids) == {"x"}
    # w would fit (a free block, budget, a seat), but nothing is admitted in a preempting step
    assert num_free(s) == 1
    assert w.status == RequestStatus.WAITING
    out3 = step(s).out
    assert out3.num_scheduled_tokens == {"y": 1, "w": 2}
    assert x.status == RequestStatus.PREEMPTED


def test_late_output_of_preempted_request_is_appended():
    # reserve_full_isl off: b (12 tokens, 3 blocks) must be admitted with 2 blocks free.
    s = make_scheduler(block_size=4, num_blocks=4, long_prefill_token_threshold=4,
                       scheduler_reserve_full_isl=False)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 12))
    c = make_request("c", 4)
    s.add_request(c)
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"a": 4, "b": 4, "c": 4}
    mro1 = fake_model_output(s, out1)
    out2 = s.schedule()  # before out1's results: b needs a block -> c (last) preempted
    assert out2.num_scheduled_tokens == {"b": 4}
    assert set(out2.preempted_req_ids) == {"c"}
    mro2 = fake_model_output(s, out2)
    eco1 = outputs_by_id(s.update_from_output(out1, mro1))
    assert eco1["c"].new_token_ids == [FAKE_TOKEN_BASE]
    assert list(c.output_token_ids) == [FAKE_TOKEN_BASE]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.update_from_output(out2, mro2) == []  # b is mid-prefill: no new tokens


def test_num_cached_tokens_recorded_once_and_stats():
    s = make_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=16)
    a = make_request("a", 8, max_tokens=3)
    b = make_request("b", 7)
    s.add_request(a)
    s.add_request(b)
    st1 = step(s)
    assert st1.scheduled == {"a": 8, "b": 7}
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    assert outputs_by_id(st1.outputs)["b"].num_cached_tokens == 0
    step(s)
    out3 = step(s).out  # b needs a 3rd block; b is the last running request -> preempts itself
    assert set(out3.preempted_req_ids) == {"b"}
    assert out3.num_scheduled_tokens == {"a": 1}
    assert a.is_finished()
    # b resumes: its own freed blocks are still cached -> 8 of its 9 tokens hit
    st4 = step(s)
    assert st4.scheduled == {"b": 1}
    assert st4.new == ["b"]
    assert b.num_cached_tokens == 0  # recorded at first admission only
    stats = s.kv_cache_manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (8 + 7 + 9, 8)


def test_prefix_cache_stats_counted_on_admission():
    s = make_scheduler(block_size=16, num_blocks=20)
    s.add_request(make_request("a", list(range(32)), max_tokens=1))
    step(s)
    stats = s.kv_cache_manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (32, 0)
    b = make_request("b", list(range(32)), max_tokens=1)
    s.add_request(b)
    eco = step(s).outputs
    assert (stats.queries, stats.hits) == (64, 16)
    assert b.num_cached_tokens == 16
    assert outputs_by_id(eco)["b"].num_cached_tokens == 16


# ---------------------------------------------------------------- stop conditions

EOS = 2


@pytest.mark.parametrize(
    "sp, eos, tokens, expected, status, stop_reason",
    [
        pytest.param({}, EOS, [5, 2, 9], [5, 2], "stopped", None, id="eos-kept"),
        # min_tokens is the sampler's job (it masks EOS and the stop ids until min_tokens outputs
        # exist), as in vLLM: an EOS or stop id that does arrive early stops the request here.
        pytest.param({"min_tokens": 3}, EOS, [2, 2, 2, 9], [2], "stopped", None,
                     id="eos-within-min_tokens-stops"),
        pytest.param({"min_tokens": 2, "stop_token_ids": [7]}, EOS, [7, 7, 9], [7],
                     "stopped", 7, id="stop-token-within-min_tokens-stops"),
        pytest.param({"ignore_eos": True, "max_tokens": 3}, EOS, [2, 2, 2, 2], [2, 2, 2],
                     "length", None, id="ignore_eos"),
        pytest.param({"ignore_eos": True, "stop_token_ids": [2]}, EOS, [5, 2, 9], [5, 2],
                     "stopped", 2, id="ignore_eos-still-honours-stop-ids"),
        pytest.param({"stop_token_ids": [7, 8]}, EOS, [5, 8, 7], [5, 8], "stopped", 8,
                     id="stop-token"),
        pytest.param({"max_tokens": 3}, EOS, [5, 6, 7, 8], [5, 6, 7], "length", None,
                     id="max_tokens"),
        pytest.param({"max_tokens": 2}, EOS, [5, 2, 9], [5, 2], "stopped", None,
                     id="eos-on-last-allowed-token"),
        pytest.param({"max_tokens": 2, "stop_token_ids": [7]}, EOS, [5, 7, 9], [5, 7],
                     "stopped", 7, id="stop-token-on-last-allowed-token"),
        pytest.param({"max_tokens": 3}, None, [2, 2, 2, 2], [2, 2, 2], "length", None,
                     id="no-eos-id"),
        pytest.param({"max_tokens": 1}, EOS, [9], [9], "length", None, id="max_tokens-1"),
    ],
)
def test_stop_conditions(sp, eos, tokens, expected, status, stop_reason):
    s = make_scheduler(block_size=4, num_blocks=20, max_model_len=64)
    r = make_request("r", 4, eos_token_id=eos, **{"max_tokens": 16, **sp})
    s.add_request(r)
    got, last = [], None
    for _ in range(len(tokens)):
        if not s.has_unfinished_requests():
            break
        eco = step(s, {"r": tokens}).outputs
        for o in eco:
            got += list(o.new_token_ids)
            last = o
    assert got == expected
    assert list(r.output_token_ids) == expected
    want_status = {"stopped": RequestStatus.FINISHED_STOPPED,
                   "length": RequestStatus.FINISHED_LENGTH_CAPPED}[status]
    want_reason = {"stopped": FinishReason.STOP, "length": FinishReason.LENGTH}[status]
    assert r.status == want_status
    assert r.is_finished()
    assert r.get_finished_reason() == want_reason
    assert r.stop_reason == stop_reason
    assert last.finish_reason == want_reason
    assert last.stop_reason == stop_reason
    assert "r" not in s.requests
    assert s.running == []
    assert num_free(s) == 19
    assert set(s.schedule().finished_req_ids) == {"r"}


def test_not_finished_output_has_no_finish_reason():
    s = make_scheduler()
    s.add_request(make_request("r", 4, max_tokens=3))
    eco = step(s).outputs
    assert len(eco) == 1
    assert eco[0].request_id == "r" and eco[0].finish_reason is None


@pytest.mark.parametrize("tokens, expected, status", [([5, 6, 7], [5, 6], "length"),
                                                       ([5, 2, 9], [5, 2], "stopped")])
def test_stop_at_max_model_len(tokens, expected, status):
    s = make_scheduler(block_size=4, num_blocks=20, max_model_len=8)
    r = make_request("r", 6, max_tokens=None, eos_token_id=EOS)
    s.add_request(r)
    run_until_finished(s, {"r": tokens}, max_steps=5)
    assert list(r.output_token_ids) == expected
    assert r.num_tokens == 8
    assert r.status == {"length": RequestStatus.FINISHED_LENGTH_CAPPED,
                        "stopped": RequestStatus.FINISHED_STOPPED}[status]


@pytest.mark.parametrize(
    "sp, sampled, expected, reason, stop_reason",
    [
        ({}, [5, 2, 9, 9], [5, 2], FinishReason.STOP, None),
        ({"stop_token_ids": [7]}, [5, 7, 8], [5, 7], FinishReason.STOP, 7),
        ({"max_tokens": 2}, [5, 6, 7], [5, 6], FinishReason.LENGTH, None),
        # min_tokens is not checked here (the sampler masks EOS until then): the first EOS stops
        pytest.param({"min_tokens": 2}, [2, 2, 9], [2], FinishReason.STOP, None,
                     id="eos-within-min_tokens-stops"),
        ({}, [5, 6, 7], [5, 6, 7], None, None),
    ],
)
def test_multiple_tokens_in_one_step_truncated_at_stop(sp, sampled, expected, reason,
                                                       stop_reason):
    s = make_scheduler()
    r = make_request("r", 4, eos_token_id=EOS, **{"max_tokens": 16, **sp})
    s.add_request(r)
    out = s.schedule()
    (o,) = s.update_from_output(out, _mro({"r": sampled}))
    assert list(o.new_token_ids) == expected
    assert list(r.output_token_ids) == expected
    assert o.finish_reason == reason
    assert o.stop_reason == stop_reason
    assert r.is_finished() == (reason is not None)


# ---------------------------------------------------------------- aborts and finished ids


def test_abort_running_request_frees_blocks():
    s = make_scheduler(num_blocks=20)
    a = make_request("a", 10)
    s.add_request(a)
    step(s)
    assert num_free(s) == 16
    s.finish_requests(["a"], ABORT)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.get_finished_reason() == FinishReason.ABORT
    assert num_free(s) == 19
    assert s.running == [] and "a" not in s.requests
    assert not s.has_unfinished_requests()
    out = s.schedule()
    assert set(out.finished_req_ids) == {"a"}
    assert out.num_scheduled_tokens == {}
    assert list(s.schedule().finished_req_ids) == []  # only since the previous schedule()


def test_abort_waiting_and_preempted_requests():
    s = make_scheduler(block_size=4, num_blocks=4, max_num_seqs=3)
    for rid, n in (("a", 4), ("b", 3), ("c", 4), ("d", 2)):
        s.add_request(make_request(rid, n))
    step(s)
    step(s)  # c preempted (see test_fcfs_preempts_last_running...)
    assert s.requests["c"].status == RequestStatus.PREEMPTED
    assert s.get_request_counts() == (2, 2)
    free0 = num_free(s)
    s.finish_requests(["c", "d"], ABORT)
    assert s.get_request_counts() == (2, 0)
    assert len(s.waiting) == 0
    assert "c" not in s.requests and "d" not in s.requests
    assert num_free(s) == free0
    assert set(s.schedule().finished_req_ids) == {"c", "d"}


def test_finish_requests_ignores_unknown_and_finished_ids():
    s = make_scheduler()
    a = make_request("a", 4, max_tokens=1)
    s.add_request(a)
    step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    s.finish_requests(["a", "nope"], ABORT)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.get_num_unfinished_requests() == 0


def test_output_for_request_aborted_during_forward_is_dropped():
    s = make_scheduler(num_blocks=20)
    a = make_request("a", 4)
    s.add_request(a)
    s.add_request(make_request("b", 4))
    out = s.schedule()
    mro = fake_model_output(s, out)
    s.finish_requests(["a"], ABORT)
    eco = outputs_by_id(s.update_from_output(out, mro))
    assert list(eco) == ["b"]
    assert list(a.output_token_ids) == []
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert s.get_request_counts() == (1, 0)
    assert num_free(s) == 18


# ---------------------------------------------------------------- add_request and counts


def test_add_request_too_long_prompt():
    s = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError) as ei:
        s.add_request(make_request("a", 17))
    assert "17" in str(ei.value) and "16" in str(ei.value)
    assert s.requests == {} and len(s.waiting) == 0
    assert s.get_request_counts() == (0, 0)
    assert not s.has_unfinished_requests()
    s.add_request(make_request("b", 16, max_tokens=1))  # exactly max_model_len is accepted
    assert s.get_request_counts() == (0, 1)


def test_add_request_duplicate_id():
    s = make_scheduler()
    a = make_request("a", 4)
    s.add_request(a)
    with pytest.raises(ValueError):
        s.add_request(make_request("a", 6))
    assert s.requests["a"] is a and len(s.waiting) == 1
    step(s)
    with pytest.raises(ValueError):
        s.add_request(make_request("a", 6))
    assert s.requests["a"] is a
    assert s.get_request_counts() == (1, 0)
    assert a.num_prompt_tokens == 4


def test_request_counts():
    s = make_scheduler(max_num_seqs=2)
    assert (s.get_request_counts(), s.get_num_unfinished_requests(),
            s.has_unfinished_requests()) == ((0, 0), 0, False)
    s.add_request(make_request("a", 4, max_tokens=1))
    s.add_request(make_request("b", 4, max_tokens=2))
    s.add_request(make_request("c", 4, max_tokens=2))
    assert s.get_request_counts() == (0, 3)
    assert s.get_num_unfinished_requests() == 3 and s.has_unfinished_requests()
    out = s.schedule()
    assert s.get_request_counts() == (2, 1)
    s.update_from_output(out, fake_model_output(s, out))
    assert s.get_request_counts() == (1, 1)  # a finished
    assert s.get_num_unfinished_requests() == 2
    run_until_finished(s)
    assert s.get_request_counts() == (0, 0) and not s.has_unfinished_requests()
    assert num_free(s) == 63


def test_finish_requests_with_a_repeated_id():
    # the second "a" is already finished when it is reached: ignored, like an unknown id
    s = make_scheduler(num_blocks=20)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("w", 4))
    step(s)
    s.add_request(make_request("b", 4))
    s.finish_requests(["a", "a", "b", "b"], ABORT)
    assert s.get_request_counts() == (1, 0)
    assert set(s.requests) == {"w"}
    assert num_free(s) == 18


def test_late_output_can_finish_a_preempted_request():
    # reserve_full_isl off: b (12 tokens, 3 blocks) must be admitted with 2 blocks free.
    s = make_scheduler(block_size=4, num_blocks=4, long_prefill_token_threshold=4,
                       scheduler_reserve_full_isl=False)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 12))
    c = make_request("c", 4, eos_token_id=EOS)
    s.add_request(c)
    out1 = s.schedule()
    mro1 = fake_model_output(s, out1, {"c": [EOS]})
    out2 = s.schedule()
    assert set(out2.preempted_req_ids) == {"c"}
    eco = outputs_by_id(s.update_from_output(out1, mro1))
    assert eco["c"].finish_reason == FinishReason.STOP
    assert c.status == RequestStatus.FINISHED_STOPPED
    assert "c" not in s.requests
    assert [r.request_id for r in s.waiting] == []
    assert s.get_request_counts() == (2, 0)
    assert "c" in s.schedule().finished_req_ids


def test_priority_victim_tie_broken_by_latest_arrival():
    s = make_scheduler(block_size=4, num_blocks=3, policy="priority")
    p = make_request("p", 4, priority=0, arrival_time=1.0)
    q = make_request("q", 3, priority=0, arrival_time=5.0)
    s.add_request(p)
    s.add_request(q)
    assert step(s).scheduled == {"p": 4, "q": 3}
    assert num_free(s) == 0
    # p needs a 2nd block; same priority -> the later arrival, q, is the victim (not p itself)
    out2 = step(s).out
    assert set(out2.preempted_req_ids) == {"q"}
    assert out2.num_scheduled_tokens == {"p": 1}
    assert q.status == RequestStatus.PREEMPTED


def test_priority_victim_scheduled_this_step_leaves_no_uncomputed_block_cached():
    # x decodes alone until its 8th token completes its second block, which is hashed when that
    # step allocates it. In that very step y (better priority, mid-prefill) cannot get its blocks:
    # x is preempted after all, then y itself. x's second block never had its KV computed, so it
    # must not stay in the prefix cache (a later prefix hit would read garbage); the first stays.
    # reserve_full_isl off: y (40 tokens, 10 blocks) must be admitted into a 6-block pool.
    s = make_scheduler(block_size=4, num_blocks=7, max_num_batched_tokens=16, max_model_len=128,
                       policy="priority", scheduler_reserve_full_isl=False)
    unscheduled = spy_unscheduled_victims(s)
    x = make_request("x", 4, priority=1, arrival_time=0.0, max_tokens=40)
    s.add_request(x)
    for _ in range(3):
        step(s)
    s.add_request(make_request("y", 40, priority=0, arrival_time=1.0, max_tokens=40))
    step(s)
    assert x.num_computed_tokens == 7
    out = step(s).out
    assert unscheduled == ["x"]  # x was scheduled this step, then unscheduled as a victim
    assert out.preempted_req_ids == {"x", "y"} and out.num_scheduled_tokens == {}
    cached = {b.block_hash for b in s.kv_cache_manager.block_pool.blocks if b.block_hash}
    assert x.block_hashes[0] in cached
    assert x.block_hashes[1] not in cached, "a block whose KV was never computed is cached"
    probe = make_request("probe", x.all_token_ids[:9])
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 4
