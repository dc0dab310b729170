"""The sampler's min_tokens mask, on hand-made logits: until a request has min_tokens outputs its
EOS and stop ids cannot be sampled, greedy or not (vLLM's MinTokensLogitsProcessor), and the
per-request state says which ids are blocked when."""

import torch

from minicore.model.runner_base import CachedRequestState
from minicore.model.sampler import SamplingMetadata, sample
from minicore.sampling_params import SamplingParams

EOS, STOP = 2, 5


def test_blocked_ids_are_never_sampled():
    logits = torch.zeros(2, 8)
    logits[:, EOS], logits[:, STOP], logits[:, 7] = 9.0, 8.0, 1.0
    greedy = SamplingMetadata(torch.zeros(2), None, None, {}, True, {0: [EOS, STOP]})
    assert sample(logits.clone(), greedy).tolist() == [7, EOS]
    random = SamplingMetadata(torch.ones(2), None, None, {}, False, {0: [EOS, STOP], 1: [EOS]})
    for _ in range(20):
        row0, row1 = sample(logits.clone(), random).tolist()
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
