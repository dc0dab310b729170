"""Logprobs and the sampling extras end to end, on the real default model: sample and prompt
logprobs (with chunked prefill in play) equal transformers' log_softmax of the same text to 1e-4,
with vLLM's ranks and decoded tokens; a prompt-logprobs request reads no prefix cache; logit_bias,
allowed_token_ids and bad_words steer greedy decoding; requests the engine cannot serve are
refused with the field named."""

import pytest
import torch

from minicore.engine.input_processor import InvalidRequestError
from minicore.llm import LLM
from minicore.model.attention import attn_implementation
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is",
           "Once upon a time, in a village at the edge of a great forest, there lived an old "
           "clockmaker who had never left his workshop. One winter morning, a stranger knocked"]
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    # A 16-token budget splits every prompt here into several prefill chunks.
    return LLM(model, tokenizer=tokenizer, max_num_batched_tokens=16, max_num_seqs=4,
               max_model_len=256)


def _reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[T, V] log_softmax of transformers' own logits at every position."""
    with attn_implementation(model, "sdpa"), torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_position(entry: dict, token_id: int, reference: torch.Tensor, num: int, tokenizer):
    """entry: the token first, then the top num, as vLLM; logprobs, ranks and text checked."""
    ids = list(entry)
    top = reference.topk(num).indices.tolist()
    assert ids[0] == token_id and set(ids) == {token_id, *top}
    assert len(entry) == num + (token_id not in top)
    for t, logprob in entry.items():
        assert abs(logprob.logprob - reference[t].item()) < TOL
        if not (text := tokenizer.decode([t])).endswith("\ufffd"):  # else completed by context
            assert logprob.decoded_token == text
    assert entry[token_id].rank == int((reference >= reference[token_id]).sum())
    for rank, t in enumerate(top, start=1):
        assert entry[t].rank == rank


def test_sample_and_prompt_logprobs_match_transformers(llm, hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=0, prompt_logprobs=0,
                             repetition_penalty=1.3, logit_bias={13: 2.0})]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outputs[1].prompt_token_ids) > 2 * 16  # prefilled in chunks of 16 tokens
    for out, p in zip(outputs, params):
        prompt, completion = out.prompt_token_ids, out.outputs[0]
        reference = _reference_logprobs(model, prompt + completion.token_ids)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            _check_position(out.prompt_logprobs[i], prompt[i], reference[i - 1],
                            p.prompt_logprobs, tokenizer)
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for j, token_id in enumerate(completion.token_ids):
            _check_position(completion.logprobs[j], token_id, reference[len(prompt) + j - 1],
                            p.logprobs, tokenizer)
        expected = sum(completion.logprobs[j][t].logprob
                       for j, t in enumerate(completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-6)
    # Greedy: the sampled token is the best, rank 1.
    assert all(e[t].rank == 1 for e, t in zip(outputs[0].outputs[0].logprobs,
                                              outputs[0].outputs[0].token_ids))
    assert outputs[0].metrics is not None and outputs[0].metrics.num_generation_tokens == 6


def test_no_logprobs_unless_asked(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_prompt_logprobs_read_no_prefix_cache(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, enable_prefix_caching=True, block_size=4,
              max_model_len=256)
    plain = SamplingParams(max_tokens=1, temperature=0)
    asking = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    first = llm.generate(PROMPTS[1], plain, use_tqdm=False)[0]
    again = llm.generate(PROMPTS[1], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache is warm
    out = llm.generate(PROMPTS[1], asking, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(first.prompt_token_ids)
    assert all(entry is not None for entry in out.prompt_logprobs[1:])


def test_logit_bias_allowed_ids_and_bad_words_steer_greedy_decoding(llm, hf_model_and_tokenizer):
    _, tokenizer = hf_model_and_tokenizer
    greedy = dict(max_tokens=5, temperature=0.0)
    plain = llm.generate(PROMPTS[0], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert "Paris" in plain.text
    target = tokenizer.encode(" banana", add_special_tokens=False)[0]
    allowed = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" red", " blue")]
    outputs = llm.generate([PROMPTS[0]] * 3, [
        SamplingParams(**greedy, logit_bias={target: 100}),
        SamplingParams(**greedy, allowed_token_ids=allowed),
        SamplingParams(**greedy, bad_words=["Paris"])], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == [target] * 5
    assert set(outputs[1].outputs[0].token_ids) <= set(allowed)
    assert "Paris" not in outputs[2].outputs[0].text
    assert outputs[2].outputs[0].token_ids[0] != plain.token_ids[0]


@pytest.mark.parametrize("field, params", [
    ("logprobs", SamplingParams(logprobs=21)),
    ("prompt_logprobs", SamplingParams(prompt_logprobs=-1)),
    ("logit_bias", SamplingParams(logit_bias={10**6: 1.0})),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=[1, 10**6])),
    ("stop_token_ids", SamplingParams(stop_token_ids=[10**6])),
    ("truncate_prompt_tokens", SamplingParams(truncate_prompt_tokens=10**6)),
])
def test_requests_out_of_bounds_are_refused_naming_the_field(llm, field, params):
    with pytest.raises(InvalidRequestError) as ei:
        llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert ei.value.param == field


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, hf_model_and_tokenizer):
    _, tokenizer = hf_model_and_tokenizer
    ids = tokenizer.encode(PROMPTS[1])
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=1, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
