"""The sampler on hand-made logits: each stage (penalties, min_p, logit_bias, allowed ids, bad
words, min_tokens) against a hand computation, rows independent of each other, and logprobs
against torch.log_softmax. The min_tokens mask: until a request has min_tokens outputs its
EOS and stop ids cannot be sampled, greedy or not (vLLM's MinTokensLogitsProcessor), and the
per-request state says which ids are blocked when."""

import pytest
import torch

from minicore.model.runner_base import CachedRequestState
from minicore.model.sampler import (
    Penalties,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    sample,
)
from minicore.sampling_params import SamplingParams

EOS, STOP = 2, 5


def test_blocked_ids_are_never_sampled():
    logits = torch.zeros(2, 8)
    logits[:, EOS], logits[:, STOP], logits[:, 7] = 9.0, 8.0, 1.0
    greedy = SamplingMetadata(torch.zeros(2), None, None, {}, True, {0: [EOS, STOP]})
    assert sample(logits.clone(), greedy).sampled.tolist() == [7, EOS]
    random = SamplingMetadata(torch.ones(2), None, None, {}, False, {0: [EOS, STOP], 1: [EOS]})
    for _ in range(20):
        row0, row1 = sample(logits.clone(), random).sampled.tolist()
        assert row0 not in (EOS, STOP) and row1 != EOS


def test_blocked_ids_follow_the_output_count():
    params = SamplingParams(min_tokens=2, stop_token_ids=[STOP])
    state = CachedRequestState([10, 11, 12], [1], 3, params, num_prompt_tokens=3, eos_token_id=EOS)
    assert state.min_tokens_blocked_ids() == [EOS, STOP]
    state.token_ids.append(20)
    assert state.min_tokens_blocked_ids() == [EOS, STOP]
    state.token_ids.append(21)
    assert state.min_tokens_blocked_ids() == []
    ignoring = CachedRequestState([10], [1], 1, SamplingParams(min_tokens=1, ignore_eos=True),
                                  num_prompt_tokens=1, eos_token_id=EOS)
    assert ignoring.min_tokens_blocked_ids() == []


def _meta(batch: int, greedy: bool = True, **extras) -> SamplingMetadata:
    temperature = torch.zeros(batch) if greedy else torch.ones(batch)
    return SamplingMetadata(temperature, None, None, {}, greedy, **extras)


def test_penalties_match_a_hand_computation():
    """vLLM's: repetition over prompt and output (divide a positive logit, multiply a negative
    one), frequency per output occurrence, presence once per output token."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5], [2.0, -1.0, 0.5, 3.0, -0.5]])
    pad = 5  # the vocabulary size pads the token lists
    penalties = Penalties(prompt_token_ids=torch.tensor([[0, 4], [pad, pad]]),
                          output_token_ids=torch.tensor([[2, 2, 3], [1, pad, pad]]),
                          presence=torch.tensor([0.25, 0.0]), frequency=torch.tensor([0.5, 0.0]),
                          repetition=torch.tensor([2.0, 1.0]))
    got = apply_penalties(logits.clone(), penalties)
    expected = torch.tensor([[2.0 / 2, -1.0, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0 / 2 - 0.5 - 0.25,
                              -0.5 * 2],
                             [2.0, -1.0, 0.5, 3.0, -0.5]])
    assert torch.allclose(got, expected)


def test_penalties_change_a_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    penalties = Penalties(torch.tensor([[2]]), torch.tensor([[0]]), torch.tensor([0.5]),
                          torch.tensor([0.0]), torch.tensor([1.0]))
    assert sample(logits.clone(), _meta(1)).sampled.tolist() == [0]
    assert sample(logits.clone(), _meta(1, penalties=penalties)).sampled.tolist() == [1]


def test_min_p_masks_tokens_below_a_fraction_of_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    masked = apply_min_p(probs.log(), torch.tensor([0.2, 0.0]))
    assert torch.isinf(masked[0]).tolist() == [False, False, False, True]  # 0.05 < 0.2 * 0.5
    assert not torch.isinf(masked[1]).any()
    meta = _meta(2, greedy=False, min_p=torch.tensor([0.5, 0.0]))
    seen = {sample(probs.log(), meta).sampled[0].item() for _ in range(50)}
    assert seen <= {0, 1}  # 0.15 and 0.05 are below 0.5 * 0.5


def test_logit_bias_allowed_ids_and_bad_words_on_greedy_rows():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]] * 4)
    bias = (torch.tensor([0, 0]), torch.tensor([1, 4]), torch.tensor([10.0, -10.0]))
    allowed = torch.ones(4, 5, dtype=torch.bool)
    allowed[1, [0, 2]] = False  # row 1 may sample only 0 and 2
    allowed[[0, 2, 3]] = False
    bad_words = {2: ([[4], [9, 3]], [7]),  # 4 always banned; 3 only after 9
                 3: ([[9, 3], [1, 2, 4]], [5, 1, 2])}  # 3 is fine; 4 follows 1, 2: banned
    meta = _meta(4, logit_bias=bias, allowed_token_ids_mask=allowed, bad_words=bad_words)
    assert sample(logits.clone(), meta).sampled.tolist() == [1, 2, 3, 3]
    bad_words[2] = ([[4], [9, 3]], [7, 9])
    assert sample(logits.clone(), meta).sampled[2].item() == 2


def test_a_row_is_unaffected_by_its_neighbours_processing():
    """Row 1 (plain) samples what it samples alone while row 0 has every stage on; a seeded row
    draws the same token whatever shares its batch."""
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    alone = sample(logits[1:].clone(), _meta(1)).sampled.item()
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[0, 10:] = True
    busy = _meta(2, allowed_token_ids_mask=mask, blocked_token_ids={0: [3]},
                 logit_bias=(torch.tensor([0]), torch.tensor([5]), torch.tensor([100.0])),
                 bad_words={0: ([[7]], [])},
                 penalties=Penalties(torch.tensor([[1, 2], [50, 50]]), torch.tensor([[4], [50]]),
                                     torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]),
                                     torch.tensor([1.5, 1.0])))
    assert sample(logits.clone(), busy).sampled.tolist() == [5, alone]

    def seeded(batch_logits, **extras):
        gen = torch.Generator().manual_seed(42)
        meta = SamplingMetadata(torch.ones(len(batch_logits)), None, None, {0: gen}, False,
                                **extras)
        return sample(batch_logits.clone(), meta).sampled[0].item()

    assert seeded(logits[:1]) == seeded(torch.stack([logits[0], logits[1]]),
                                        min_p=torch.tensor([0.0, 0.3]))


def test_logprobs_are_the_raw_log_softmax_with_vllm_ranks():
    """Top-N and the sampled token's logprob come from the raw logits (before bias and
    penalties); rank counts the logprobs >= the token's own (vLLM's batched_count_greater_than)."""
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    reference = torch.log_softmax(logits, dim=-1)
    bias = (torch.tensor([0]), torch.tensor([int(logits[0].argmin())]), torch.tensor([100.0]))
    out = sample(logits.clone(), _meta(3, logit_bias=bias, max_num_logprobs=4))
    assert out.sampled[0].item() == int(logits[0].argmin())
    lp = out.logprobs
    assert torch.equal(lp.token_ids[:, 0], out.sampled)
    assert torch.allclose(lp.logprobs[:, 0], reference.gather(1, out.sampled[:, None])[:, 0])
    top = reference.topk(4, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert torch.allclose(lp.logprobs[:, 1:], top.values)
    assert lp.ranks.tolist() == [30, 1, 1]  # row 0 sampled its least likely token
    lists = lp.tolists([1, 2], 2)
    assert [len(row) for row in lists.logprob_token_ids] == [3, 3]
    assert lists.sampled_token_ranks == [1, 1]
    assert sample(logits.clone(), _meta(3)).logprobs is None


def _state(params: SamplingParams, prompt: list[int], outputs: list[int] = (), generator=None):
    token_ids = list(prompt) + list(outputs)
    return CachedRequestState(token_ids, [1], len(token_ids), params, len(prompt), EOS,
                              generator)


def test_from_states_leaves_every_stage_off_for_plain_greedy_rows():
    meta = SamplingMetadata.from_states([_state(SamplingParams(temperature=0), [3]),
                                         _state(SamplingParams(top_k=1), [4])], 8, "cpu")
    assert meta.all_greedy and meta.temperature.tolist() == [0.0, 1.0]
    assert (meta.top_k, meta.top_p, meta.min_p, meta.logit_bias, meta.allowed_token_ids_mask,
            meta.penalties, meta.max_num_logprobs) == (None,) * 7
    assert (meta.generators, meta.blocked_token_ids, meta.bad_words) == ({}, {}, {})


def test_from_states_builds_each_stage_as_a_hand_built_batch():
    V = 8
    gen = torch.Generator().manual_seed(3)
    states = [
        _state(SamplingParams(temperature=0.5, top_k=100, top_p=0.9, min_p=0.1, seed=3,
                              logit_bias={1: 2.0, 6: -1.5}, logprobs=-1), [5, 6], [7],
               generator=gen),
        _state(SamplingParams(temperature=0, allowed_token_ids=[2, 4], min_tokens=3,
                              stop_token_ids=[5, 9], logprobs=2, repetition_penalty=1.5,
                              presence_penalty=0.5, frequency_penalty=0.25), [1], [3, 3]),
        _state(SamplingParams(temperature=1.0, top_k=3, bad_words_token_ids=[[4], [3, 2]]),
               [2, 2, 2]),
    ]
    meta = SamplingMetadata.from_states(states, V, "cpu")
    assert not meta.all_greedy
    assert meta.temperature.tolist() == [0.5, 0.0, 1.0]
    assert meta.top_k.tolist() == [V, 0, 3]  # 100 is past the vocabulary: every token
    assert meta.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert meta.min_p.tolist() == pytest.approx([0.1, 0.0, 0.0])
    assert meta.generators == {0: gen}
    rows, token_ids, biases = meta.logit_bias
    assert (rows.tolist(), token_ids.tolist(), biases.tolist()) == ([0, 0], [1, 6], [2.0, -1.5])
    expected_mask = torch.zeros(3, V, dtype=torch.bool)
    expected_mask[1] = True
    expected_mask[1, [2, 4]] = False
    assert torch.equal(meta.allowed_token_ids_mask, expected_mask)
    # Row 1 has 2 of its 3 min_tokens: EOS and the stop ids in the vocabulary are blocked.
    assert meta.blocked_token_ids == {1: [EOS, 5]}
    assert meta.bad_words == {2: ([[4], [3, 2]], [])}
    p = meta.penalties
    assert p.prompt_token_ids.tolist() == [[5, 6, V], [1, V, V], [2, 2, 2]]
    assert p.output_token_ids.tolist() == [[7, V], [3, 3], [V, V]]
    assert p.repetition.tolist() == [1.0, 1.5, 1.0]
    assert p.presence.tolist() == [0.0, 0.5, 0.0]
    assert p.frequency.tolist() == [0.0, 0.25, 0.0]
    assert meta.max_num_logprobs == V  # -1: the whole vocabulary
