"""The rejection sampler (minicore/model/rejection_sampler.py) on hand-made logits: greedy rows
accept drafts while they are the argmax, then emit the argmax (or the bonus); random rows emit
exactly the target distribution at each position (chi-square on a 5-token vocabulary, a test that
a sampler accepting every draft fails), also after temperature and top-k; seeded rows repeat;
penalties, min_tokens, bad words and logit_bias see the drafts before a position as outputs; and
logprobs are one row per emitted token, from the raw logits at its position."""

import pytest
import torch

from minicore.model.rejection_sampler import position_states, rejection_sample
from minicore.model.runner_base import CachedRequestState
from minicore.model.sampler import SamplingMetadata, gather_logprobs, sample
from minicore.sampling_params import SamplingParams

V = 5
# The 0.999 quantile of chi-square with V - 1 = 4 degrees of freedom.
CHI2_CRITICAL = 18.47
EOS = 0


def greedy_meta(num_positions: int) -> SamplingMetadata:
    return SamplingMetadata(torch.zeros(num_positions), None, None, {}, True)


def one_hot_logits(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[range(len(argmaxes)), argmaxes] = 1.0
    return logits


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    drafts = [[1, 2, 3], [3, 3], [], [0]]
    # Per request, the argmax at each of its k + 1 positions.
    argmaxes = [[1, 2, 4, 5], [3, 3, 0], [5], [1, 0]]
    logits = one_hot_logits([t for row in argmaxes for t in row])
    out = rejection_sample(logits, greedy_meta(len(logits)), drafts, {})
    # 1, 2 accepted, 3 rejected: the argmax 4 instead; all accepted: the bonus 0; no drafts: the
    # argmax; 0 rejected at once: 1.
    assert out.token_ids == [[1, 2, 4], [3, 3, 0], [5], [1]]
    assert out.logprobs is None


def chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of samples (token ids) against probs, over the tokens probs allows."""
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    assert counts[expected == 0].sum() == 0, "a token the target excludes was emitted"
    allowed = expected > 0
    return float(((counts[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum())


def random_batch(position_logits: torch.Tensor, drafts: list[int], num_requests: int,
                 **params) -> tuple[list[list[int]], SamplingMetadata, torch.Tensor]:
    """num_requests identical requests with these drafts and per-position logits (k + 1 rows)."""
    params = SamplingParams(**params)
    state = CachedRequestState([1, 2] + drafts, [1], 0, params, 2, spec_token_ids=drafts)
    meta = SamplingMetadata.from_states(position_states(state) * num_requests, V, "cpu")
    return [drafts] * num_requests, meta, position_logits.repeat(num_requests, 1)


POSITION_LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0],
                                [0.0, 1.5, 0.2, 0.7, -0.5],
                                [-1.0, 0.0, 1.0, 2.0, 0.3]])


@pytest.mark.parametrize("draft", [0, 4], ids=["likely-draft", "unlikely-draft"])
def test_random_rows_emit_exactly_the_target_distribution(draft):
    """Position 0's token follows p0; given d0 accepted, position 1's follows p1; given both
    accepted, the bonus follows p2; d0 is accepted with probability p0(d0)."""
    torch.manual_seed(0)
    n = 40_000
    p = POSITION_LOGITS.softmax(-1)
    drafts, meta, logits = random_batch(POSITION_LOGITS, [draft, 1], n)
    out = rejection_sample(logits, meta, drafts, {}).token_ids
    assert all(1 <= len(o) <= 3 and o[:-1] == [draft, 1][:len(o) - 1] for o in out)
    first = torch.tensor([o[0] for o in out])
    assert chi2(first, p[0]) < CHI2_CRITICAL
    accepted = first == draft
    assert abs(accepted.double().mean() - p[0, draft]) < 4 * (p[0, draft] / n) ** 0.5
    second = torch.tensor([o[1] for o in out if len(o) >= 2])
    assert chi2(second, p[1]) < CHI2_CRITICAL
    bonus = torch.tensor([o[2] for o in out if len(o) == 3])
    assert len(bonus) > 300 and chi2(bonus, p[2]) < CHI2_CRITICAL
    # The same statistic rejects a sampler that accepts every draft.
    assert chi2(torch.full((n,), draft), p[0] + 1e-12) > 100 * CHI2_CRITICAL


def test_random_rows_verify_against_the_processed_distribution():
    """Temperature 0.5 and top-k 3: a draft outside the top 3 is never accepted, and what is
    emitted follows the softmax of logits / 0.5 over the top 3."""
    torch.manual_seed(1)
    n = 20_000
    drafts, meta, logits = random_batch(POSITION_LOGITS, [3, 1], n, temperature=0.5, top_k=3)
    out = rejection_sample(logits, meta, drafts, {}).token_ids
    first = torch.tensor([o[0] for o in out])
    assert not (first == 3).any()
    top3 = POSITION_LOGITS[0].clone()
    top3[3:] = float("-inf")
    assert chi2(first, (top3 / 0.5).softmax(-1)) < CHI2_CRITICAL


def test_seeded_rows_repeat_and_without_drafts_sample_as_the_plain_sampler():
    logits = POSITION_LOGITS.repeat(2, 1)
    params = SamplingParams(seed=7)
    state = CachedRequestState([1, 2, 0, 1], [1], 0, params, 2, spec_token_ids=[0, 1])

    def run(neighbour_seed: int):
        torch.manual_seed(neighbour_seed)  # the unseeded neighbour's draws differ
        meta = SamplingMetadata.from_states(position_states(state) * 2, V, "cpu")
        return rejection_sample(logits.clone(), meta, [[0, 1], [0, 1]],
                                {0: torch.Generator().manual_seed(7)}).token_ids[0]

    outputs = {tuple(run(seed)) for seed in range(5)}
    assert len(outputs) == 1
    # Different seeds give different outputs over a few tries (the seed is really used).
    many = set()
    for seed in range(20):
        meta = SamplingMetadata.from_states(position_states(state), V, "cpu")
        many.add(tuple(rejection_sample(POSITION_LOGITS.clone(), meta, [[0, 1]],
                                        {0: torch.Generator().manual_seed(seed)}).token_ids[0]))
    assert len(many) > 1
    # No drafts: the same draws as the plain sampler's, so the same token.
    plain_state = CachedRequestState([1, 2], [1], 0, params, 2)
    plain_state.generator = torch.Generator()
    for seed in range(10):
        plain_state.generator.manual_seed(seed)
        plain = sample(POSITION_LOGITS[:1].clone(),
                       SamplingMetadata.from_states([plain_state], V, "cpu"))
        plain_state.generator.manual_seed(seed)
        meta = SamplingMetadata.from_states(position_states(plain_state), V, "cpu")
        spec = rejection_sample(POSITION_LOGITS[:1].clone(), meta, [[]],
                                {0: plain_state.generator})
        assert spec.token_ids == [plain.sampled.tolist()]


def greedy_states(params: SamplingParams, outputs: list[int],
                  drafts: list[int]) -> list[CachedRequestState]:
    prompt = [6, 7]
    state = CachedRequestState(prompt + outputs + drafts, [1], 0, params, len(prompt),
                               eos_token_id=EOS, spec_token_ids=drafts)
    return position_states(state)


def run_greedy(logits: torch.Tensor, params: SamplingParams, drafts: list[int],
               outputs: list[int] = ()) -> list[int]:
    states = greedy_states(params, list(outputs), drafts)
    meta = SamplingMetadata.from_states(states, 8, "cpu")
    return rejection_sample(logits[:len(drafts) + 1].clone(), meta, [drafts], {}).token_ids[0]


# EOS first everywhere, then 5, then 4.
EOS_FIRST = torch.tensor([[3.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0]] * 3)


def test_min_tokens_counts_the_drafts_before_a_position_as_outputs():
    params = SamplingParams(temperature=0, min_tokens=2)
    states = greedy_states(params, [], [5, 5])
    assert [s.min_tokens_blocked_ids() for s in states] == [[EOS], [EOS], []]
    # EOS is blocked at positions 0 and 1 (0 and 1 outputs), allowed at 2: the bonus.
    assert run_greedy(EOS_FIRST, params, [5, 5]) == [5, 5, EOS]
    # With one output already, position 1 has two: EOS beats the draft there.
    assert run_greedy(EOS_FIRST, params, [5, 5], outputs=[4]) == [5, EOS]


def test_penalties_bad_words_and_logit_bias_see_the_drafts_before_a_position():
    params = SamplingParams(temperature=0, presence_penalty=1.5)
    # 5 leads 4 by 1: once a draft 5 counts as an output, each penalty makes 4 the argmax.
    no_eos = EOS_FIRST.clone()
    no_eos[:, EOS] = -5.0
    assert run_greedy(no_eos, SamplingParams(temperature=0), [5, 5]) == [5, 5, 5]
    assert run_greedy(no_eos, params, [5, 5]) == [5, 4]
    assert run_greedy(no_eos, SamplingParams(temperature=0, repetition_penalty=4.0),
                      [5, 5]) == [5, 4]
    banned = SamplingParams(temperature=0)
    banned.bad_words_token_ids = [[5, 5]]  # 5 may not follow 5
    assert run_greedy(no_eos, banned, [5, 5]) == [5, 4]
    biased = SamplingParams(temperature=0, logit_bias={1: 10.0})
    assert run_greedy(no_eos, biased, [1, 1]) == [1, 1, 1]
    assert run_greedy(no_eos, biased, [5]) == [1]


def test_logprobs_are_one_row_per_emitted_token_from_the_raw_logits():
    torch.manual_seed(2)
    logits = torch.randn(6, 6)
    argmaxes = logits.argmax(-1).tolist()
    # Request 0: its first draft right, its second wrong; request 1: its one draft right.
    drafts = [[argmaxes[0], (argmaxes[1] + 1) % 6, 0], [argmaxes[4]]]
    meta = greedy_meta(6)
    meta.max_num_logprobs = 2
    out = rejection_sample(logits.clone(), meta, drafts, {})
    assert out.token_ids == [[argmaxes[0], argmaxes[1]], [argmaxes[4], argmaxes[5]]]
    positions = [0, 1, 4, 5]
    expected = gather_logprobs(logits[positions].log_softmax(-1), 2,
                               torch.tensor([argmaxes[p] for p in positions]))
    assert out.logprobs.tolists(range(4), 2) == expected.tolists(range(4), 2)
