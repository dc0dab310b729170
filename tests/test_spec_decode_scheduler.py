"""The scheduler's side of speculative decoding, in small exact numbers: drafts scheduled as part
of a running request's tokens (scheduled_spec_decode_tokens), cut by the token budget and by
max_model_len, rejected drafts taken back from num_computed_tokens, stops and max_tokens inside an
accepted run, drafts dropped on preemption, no draft ever cached, and the acceptance counters.
The fake model of minicore.testing verifies drafts as a greedy runner does: it accepts a draft
while it equals the token it samples there (FAKE_TOKEN_BASE + the output's index by default)."""

import pytest

from minicore.request import RequestStatus
from minicore.scheduler.interfaces import DraftTokenIds
from minicore.spec_decode.config import SpeculativeConfig
from minicore.testing import (
    FAKE_TOKEN_BASE,
    block,
    make_request,
    make_scheduler,
    num_free,
    propose,
    step,
)

T = FAKE_TOKEN_BASE


def spec_scheduler(k: int = 3, **kwargs):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    return make_scheduler(speculative_config=config, **kwargs)


def prefilled(s, request_id="a", prompt=6, **kwargs):
    """A request admitted and through its prefill: num_tokens = prompt + 1, one uncomputed."""
    s.add_request(make_request(request_id, prompt, **kwargs))
    assert step(s).tokens[request_id] == [T]
    return s.requests[request_id]


def test_drafts_are_scheduled_after_the_newest_token_and_all_accepted():
    s = spec_scheduler()
    a = prefilled(s)
    propose(s, {"a": [T + 1, T + 2, T + 3]})
    assert a.num_tokens_with_spec == 10
    st = step(s)
    assert st.scheduled == {"a": 4}
    assert st.out.scheduled_spec_decode_tokens == {"a": [T + 1, T + 2, T + 3]}
    assert st.tokens["a"] == [T + 1, T + 2, T + 3, T + 4]  # three accepted and the bonus token
    assert (a.num_computed_tokens, a.num_tokens) == (10, 11)
    assert a.spec_token_ids == []
    stats = s.make_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 3)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 1]


def test_rejected_drafts_leave_num_computed_tokens_and_their_slots_are_reused():
    s = spec_scheduler()
    a = prefilled(s)  # 7 tokens: 6 computed, in 2 blocks of 4
    propose(s, {"a": [T + 1, 5, T + 3]})
    st = step(s)
    # Positions 6..9 run: a third block holds positions 8 and 9.
    assert len(st.block_ids["a"]) == 3
    assert st.tokens["a"] == [T + 1, T + 2]  # the first draft accepted, the second replaced
    assert (a.num_computed_tokens, a.num_tokens) == (8, 9)
    # The next step runs the newest token alone, at position 8, in the block already held.
    st = step(s)
    assert st.scheduled == {"a": 1} and st.out.scheduled_spec_decode_tokens == {}
    assert st.out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert len(st.block_ids["a"]) == 3
    stats = s.make_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_all_drafts_rejected_gives_one_token():
    s = spec_scheduler()
    a = prefilled(s)
    propose(s, {"a": [1, 2, 3]})
    assert step(s).tokens["a"] == [T + 1]
    assert (a.num_computed_tokens, a.num_tokens) == (7, 8)


def test_the_token_budget_cuts_the_drafts_and_uses_them_up():
    s = spec_scheduler(max_num_batched_tokens=6)
    a = prefilled(s, "a", 2)
    b = prefilled(s, "b", 2)  # a decodes its second token in b's prefill step
    propose(s, {"a": [T + 2, 9, T + 4], "b": [T + 1, T + 2, T + 3]})
    st = step(s)
    # a: its newest token and 3 drafts (4); b: its newest token and 1 draft (the 2 left).
    assert st.scheduled == {"a": 4, "b": 2}
    assert st.out.scheduled_spec_decode_tokens == {"a": [T + 2, 9, T + 4], "b": [T + 1]}
    assert a.spec_token_ids == [] and b.spec_token_ids == []
    assert st.tokens == {"a": [T + 2, T + 3], "b": [T + 1, T + 2]}


def test_a_request_left_out_by_the_budget_keeps_its_drafts():
    s = spec_scheduler(max_num_batched_tokens=4)
    prefilled(s, "a", 2)
    b = prefilled(s, "b", 2)
    propose(s, {"a": [T + 1, T + 2, T + 3], "b": [T + 1]})
    st = step(s)
    assert st.scheduled == {"a": 4}
    assert b.spec_token_ids == [T + 1]
    st = step(s)
    assert st.out.scheduled_spec_decode_tokens == {"b": [T + 1]}
    assert st.tokens["b"] == [T + 1, T + 2]


def test_a_stop_token_inside_the_accepted_run_cuts_it_and_frees_the_blocks():
    s = spec_scheduler()
    free = num_free(s)
    prefilled(s, stop_token_ids=[T + 2])
    propose(s, {"a": [T + 1, T + 2, T + 3]})
    st = step(s)
    assert st.tokens["a"] == [T + 1, T + 2]
    assert st.finished == ["a"] and st.outputs[0].stop_reason == T + 2
    assert num_free(s) == free and "a" not in s.requests


def test_max_tokens_is_never_exceeded_by_accepted_drafts():
    s = spec_scheduler()
    prefilled(s, max_tokens=3)
    propose(s, {"a": [T + 1, T + 2, T + 3]})
    st = step(s)
    assert st.tokens["a"] == [T + 1, T + 2]
    assert st.outputs[0].finish_reason is not None and st.finished == ["a"]


def test_drafts_are_cut_below_max_model_len():
    s = spec_scheduler(max_model_len=12)
    a = prefilled(s, prompt=8)  # 9 tokens: positions up to 10 may be scheduled
    propose(s, {"a": [T + 1, T + 2, T + 3]})
    assert a.spec_token_ids == [T + 1, T + 2]
    st = step(s)
    assert st.scheduled == {"a": 3}
    assert st.tokens["a"] == [T + 1, T + 2, T + 3]
    assert st.finished == ["a"] and a.num_tokens == 12


def test_update_draft_token_ids_skips_unknown_and_finished_requests():
    s = spec_scheduler()
    a = prefilled(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.update_draft_token_ids(DraftTokenIds(["a", "gone"], [[1, 2], [3]]))
    assert a.spec_token_ids == []


def test_a_preempted_request_drops_its_drafts_and_resumes_without_them():
    # 7 usable blocks of 4: a and b hold 2 each after their prefills; b's drafts need a third.
    s = spec_scheduler(num_blocks=6)
    a = prefilled(s, "a", 7)
    b = prefilled(s, "b", 7)
    propose(s, {"a": [T + 2, T + 3, T + 4], "b": [T + 1, T + 2, T + 3]})
    st = step(s)
    # a (9 tokens, 8 computed) takes the last free block for its drafts; b finds none, and is the
    # FCFS victim.
    assert st.preempted == {"b"}
    assert st.out.scheduled_spec_decode_tokens == {"a": [T + 2, T + 3, T + 4]}
    assert b.spec_token_ids == [] and b.status == RequestStatus.PREEMPTED
    assert a.num_tokens == 13


def test_no_draft_position_is_ever_cached():
    s = spec_scheduler()
    a = prefilled(s, prompt=7)  # 8 tokens: blocks 0-3 and 4-7 are known
    propose(s, {"a": [1, 2, 3]})
    st = step(s)  # positions 7..10 run; 8..10 are drafts, all rejected
    blocks = st.block_ids["a"]
    assert len(blocks) == 3
    assert block(s, blocks[1]).block_hash is not None
    assert block(s, blocks[2]).block_hash is None  # would hold drafts 1, 2, 3
    assert a.all_token_ids[8:] == [T + 1]
    # A new request with a's known tokens hits its two full blocks, not the drafts' block.
    s.add_request(make_request("b", a.all_token_ids[:8] + [1, 2, 3]))
    st = step(s)
    assert st.outputs and s.requests["b"].num_cached_tokens == 8


def test_without_speculative_config_nothing_is_drafted_or_counted():
    s = make_scheduler()
    prefilled(s)
    assert step(s).out.scheduled_spec_decode_tokens == {}
    assert s.make_stats().spec_decoding_stats is None


def test_a_request_still_prefilling_gets_no_drafts():
    # A 5-token prompt in chunks of 4: after the first chunk one prompt token is left, as for a
    # decoding request, but it sampled nothing (vLLM: is_prefill_chunk).
    s = spec_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", 5))
    assert step(s).tokens == {}
    propose(s, {"a": [7]})
    assert s.requests["a"].spec_token_ids == []
    st = step(s)
    assert st.scheduled == {"a": 1} and st.tokens["a"] == [T]


def test_drafts_need_a_scheduler_built_for_them():
    s = make_scheduler()
    prefilled(s)
    with pytest.raises(ValueError, match="speculative_config"):
        propose(s, {"a": [1]})
