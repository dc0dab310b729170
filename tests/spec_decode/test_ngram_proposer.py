"""NgramProposer in small exact numbers: the longest suffix match within [prompt_lookup_min,
prompt_lookup_max] wins, its most recent earlier occurrence proposes up to k tokens (fewer at the
end of the sequence, none at max_model_len - 1), matches off a token boundary of the packed bytes
are skipped; and propose() on a real scheduler: only running requests that now decode get drafts,
none at disable_by_batch_size, the packing follows new tokens, finished ids and reused ids."""

import pytest

from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.spec_decode.config import SpeculativeConfig
from minicore.spec_decode.ngram_proposer import NgramProposer
from minicore.testing import make_request, make_scheduler, step


def proposer(k=3, max_n=3, min_n=2, max_model_len=1000, disable_by_batch_size=None):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                               prompt_lookup_max=max_n, prompt_lookup_min=min_n,
                               disable_by_batch_size=disable_by_batch_size)
    return NgramProposer(config, max_model_len)


def draft(tokens, **kwargs) -> list[int]:
    return proposer(**kwargs).propose_for(Request("r", tokens, SamplingParams()))


@pytest.mark.parametrize("tokens, kwargs, expected", [
    # [1, 2, 3] occurred at 0: the three tokens after it.
    ([1, 2, 3, 4, 1, 2, 3], {}, [4, 1, 2]),
    # The most recent occurrence of [1, 2] (at 3), not the first (at 0).
    ([1, 2, 5, 1, 2, 6, 1, 2], {}, [6, 1, 2]),
    # The longest match wins over a more recent shorter one: [7, 1, 2] at 0, not [1, 2] at 5.
    ([7, 1, 2, 9, 8, 1, 2, 5, 7, 1, 2], {}, [9, 8, 1]),
    # Only [3, 1] and [2, 3, 1] are tried with min_n 2: no match; with min_n 1, [1] at 0.
    ([1, 2, 3, 1], {}, []),
    ([1, 2, 3, 1], {"min_n": 1}, [2, 3, 1]),
    # Fewer than k tokens follow the match: the draft runs to the end of the sequence.
    ([1, 2, 1, 2], {}, [1, 2]),
    # An occurrence may overlap the suffix, but not be it.
    ([5, 5, 5, 5], {}, [5]),
    ([5, 5, 5], {}, [5]),
    ([5, 5], {}, []),
    # k bounds the draft.
    ([1, 2, 3, 4, 5, 6, 1, 2], {"k": 2}, [3, 4]),
    ([1, 2, 3, 4, 5, 6, 1, 2], {"k": 5}, [3, 4, 5, 6, 1]),
])
def test_the_longest_most_recent_match_proposes_what_followed(tokens, kwargs, expected):
    assert draft(tokens, **kwargs) == expected


@pytest.mark.parametrize("max_model_len, expected", [
    (8 + 4, [3, 4, 5]), (8 + 3, [3, 4]), (8 + 2, [3]), (8 + 1, []), (8, [])])
def test_no_draft_position_reaches_max_model_len(max_model_len, expected):
    # 8 tokens; the verifying step writes 1 + len(draft) more, the last at most max_model_len - 1.
    assert draft([1, 2, 3, 4, 5, 6, 1, 2], k=3, max_model_len=max_model_len) == expected


def test_a_match_off_a_token_boundary_is_skipped():
    # Packed as little-endian int32, 256 is 00 01 00 00 and 512 is 00 02 00 00. The bytes of
    # 65543 (07 00 01 00), 131072 (00 00 02 00) and 0 (00 ...) spell [256, 512] one byte in.
    unaligned = [65543, 131072, 0]
    assert draft(unaligned + [256, 512]) == []
    # The aligned occurrence before it is found past the false one.
    assert draft([256, 512, 9] + unaligned + [256, 512]) == [9, 65543, 131072]


def spec_scheduler(**kwargs):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3,
                               prompt_lookup_min=2)
    return make_scheduler(speculative_config=config, **kwargs)


def propose(s, p, out):
    """What EngineCore does after an update: the drafter's drafts, to the scheduler."""
    drafts = p.propose(s.requests, len(s.running), out)
    s.update_draft_token_ids(drafts)
    return drafts


def test_a_decoding_request_gets_drafts_and_a_prefilling_one_none():
    # 4-token chunks: "b" (10 tokens) is still mid-prefill after the first step.
    s = spec_scheduler(max_num_batched_tokens=9, enable_chunked_prefill=True)
    s.add_request(make_request("a", [1, 2, 3, 1, 2]))
    s.add_request(make_request("b", list(range(10, 20))))
    st = step(s, {"a": 3})  # a: 5 prompt tokens + 3; b: 4 of 10 computed
    assert st.scheduled == {"a": 5, "b": 4}
    drafts = propose(s, proposer(), st.out)
    assert (drafts.req_ids, drafts.draft_token_ids) == (["a"], [[1, 2, 3]])
    assert s.requests["a"].spec_token_ids == [1, 2, 3]
    assert s.requests["b"].spec_token_ids == []


def test_no_drafts_at_disable_by_batch_size():
    s = spec_scheduler()
    for rid in "ab":
        s.add_request(make_request(rid, [1, 2, 1, 2]))
    st = step(s, {"a": 1, "b": 1})
    assert propose(s, proposer(disable_by_batch_size=3), st.out).draft_token_ids == [[2, 1],
                                                                                      [2, 1]]
    assert propose(s, proposer(disable_by_batch_size=2), st.out).draft_token_ids == []


def test_the_packing_follows_new_tokens_and_reused_ids():
    p = proposer()
    a = Request("a", [1, 2, 3, 9], SamplingParams())
    assert p.propose_for(a) == []
    for token in (1, 2):
        a.append_output_token_id(token)
    assert p.propose_for(a) == [3, 9, 1]  # [9, 1, 2] -> no; [1, 2] at 0 -> 3, 9, 1
    # The same id, another request: packed afresh.
    assert p.propose_for(Request("a", [4, 5, 4, 5], SamplingParams())) == [4, 5]


def test_finished_requests_leave_the_packing():
    s, p = spec_scheduler(), proposer()
    s.add_request(make_request("a", [1, 2, 1, 2], max_tokens=2))
    propose(s, p, step(s).out)
    assert list(p._packed) == ["a"]
    propose(s, p, step(s).out)  # a's second token finishes it
    assert list(p._packed) == ["a"]
    propose(s, p, step(s).out)  # the step that tells the runner (finished_req_ids)
    assert p._packed == {}


def run(s, p, script) -> tuple[list[int], int]:
    """Step to the end, the proposer after each update: (a's tokens, the number of steps)."""
    tokens, num_steps = [], 0
    while s.has_unfinished_requests():
        st = step(s, script)
        tokens += st.tokens.get("a", [])
        num_steps += 1
        if p is not None:
            propose(s, p, st.out)
    return tokens, num_steps


def test_drafts_of_a_repeating_sequence_are_accepted_and_change_no_token():
    pattern = [1, 2, 3, 4] * 4
    script = {"a": pattern}
    plain = make_scheduler()
    plain.add_request(make_request("a", [1, 2, 3, 4], max_tokens=14))
    s = spec_scheduler()
    s.add_request(make_request("a", [1, 2, 3, 4], max_tokens=14))
    expected, plain_steps = run(plain, None, script)
    assert expected == pattern[:14] and plain_steps == 14
    # Step 1 prefills and samples 1 (no earlier [4, 1]), step 2 samples 2; then [1, 2] at 0
    # drafts [3, 4, 1], and each of three steps accepts its 3 drafts and samples one more:
    # 2 + 3 * 4 = 14 tokens in 5 steps.
    assert run(s, proposer(), script) == (expected, 5)
    stats = s.make_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 9)
