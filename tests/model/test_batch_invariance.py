"""Batch invariance (the CPU's default; --batch-invariant, vLLM's VLLM_BATCH_INVARIANT=1): a
greedy request's token ids and logprobs are a function of the request alone, bit for bit, in
float32 and in bfloat16 (emulated where the CPU has no bfloat16 instructions): alone, beside 6 and
63 other requests of other lengths (by default), with its prompt chunked at 16, 64 and 512
tokens, with ngram drafts, with async scheduling, and from the prefix cache; on the default model
and on a tiny mixture-of-experts model. With --no-batch-invariant the same comparisons differ
(the first test shows it, so that the others cannot pass vacuously)."""

import random

import pytest
import torch
from moe_models import build_served_moe

from minicore.llm import LLM
from minicore.model.config import BATCH_INVARIANT_ENV, ModelConfig
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

DTYPES = ["float32", "bfloat16"]
rng = random.Random(7)
WORDS = "alpha beta gamma delta the of and to in a is that for it as with was on be by".split()
# The request under test: long enough that chunks of 16 and 64 tokens cut its prompt.
TARGET = ("The history of the Roman Empire begins with the founding of the city, which according "
          "to legend took place in 753 BC, when Romulus, " + " ".join(rng.choice(WORDS)
                                                                      for _ in range(150)))
OTHERS = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(63)]
# Tiny MoE models with the widths of real ones: multiples of 64, heads of 64 (rotary's cos and
# sin run over each token's head_dim).
WIDTHS = {"mixtral": {"hidden_size": 256, "intermediate_size": 64},
          "qwen2_moe": {"hidden_size": 256, "intermediate_size": 64, "moe_intermediate_size": 64,
                        "shared_expert_intermediate_size": 64}}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
ENGINE = dict(max_model_len=512, kv_cache_memory=1 << 27, batch_invariant=True)
# Each case: engine arguments beside ENGINE, and how many of OTHERS run beside the target.
CASES = {
    "beside 6": ({}, 6),
    "chunked at 16": ({"max_num_batched_tokens": 16}, 3),
    "chunked at 64": ({"max_num_batched_tokens": 64}, 6),
    "chunked at 512": ({"max_num_batched_tokens": 512}, 63),
    "ngram drafts": ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
                     6),
    "async scheduling": ({"async_scheduling": True}, 6),
}


def target_output(llm: LLM, prompts, cached: bool = False) -> tuple[list[int], list[float]]:
    """The first prompt's tokens and their logprobs, run in one batch with the rest; cached: its
    prompt must come from the prefix cache, else it must not."""
    result = llm.generate(prompts, GREEDY, use_tqdm=False)[0]
    assert (result.num_cached_tokens > 0) == cached, result.num_cached_tokens
    out = result.outputs[0]
    return list(out.token_ids), [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]


@pytest.fixture(scope="module", params=DTYPES)
def alone(request):
    """(dtype, the target run alone on an engine of its own)."""
    return request.param, target_output(LLM(dtype=request.param, **ENGINE), [TARGET])


def test_without_the_flag_the_batch_changes_the_logprobs(alone):
    """Beside 63 others, or chunked at 16 (SDPA over each chunk instead of the whole prompt), some
    logprob moves on every machine."""
    dtype, _ = alone
    plain = {**ENGINE, "batch_invariant": False}
    reference = target_output(LLM(dtype=dtype, **plain), [TARGET])
    beside = target_output(LLM(dtype=dtype, **plain), [TARGET, *OTHERS])
    chunked = target_output(LLM(dtype=dtype, **plain, max_num_batched_tokens=16), [TARGET])
    assert beside != reference or chunked != reference


def test_beside_63_others_and_from_the_prefix_cache_by_default(alone):
    _, reference = alone
    default = {k: v for k, v in ENGINE.items() if k != "batch_invariant"}  # on CPU: on
    llm = LLM(dtype=alone[0], **default)
    assert target_output(llm, [TARGET, *OTHERS]) == reference
    assert target_output(llm, [TARGET, *OTHERS[:6]], cached=True) == reference


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_tokens_and_logprobs(alone, case):
    dtype, reference = alone
    engine_args, num_others = CASES[case]
    llm = LLM(dtype=dtype, **{**ENGINE, **engine_args})
    assert target_output(llm, [TARGET, *OTHERS[:num_others]]) == reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_model_too(tmp_path_factory, family, dtype):
    """An MoE block's router and experts call F.linear on their own weights: the kernel takes
    those calls too, and the experts run one by one, summed in expert order; Qwen2-MoE adds a
    shared expert gated by a sigmoid over one column per token, and a dense layer. Their widths
    are multiples of 64, as real models' are: over the tiny models' default widths (48; heads of
    8) an element-wise op has a vector remainder (docs/ARCHITECTURE.md, Batch invariance)."""
    model = str(build_served_moe(family, tmp_path_factory.mktemp(family), **WIDTHS[family]))
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (40, 7, 90, 23, 61)]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    engine = dict(ENGINE, model=model, dtype=dtype, max_model_len=256)
    reference = target_output(LLM(**engine), prompts[:1])
    for extra in ({}, {"max_num_batched_tokens": 16},
                  {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        assert target_output(LLM(**engine, **extra), prompts) == reference, extra


def test_vllms_switch_sets_the_default_and_the_flag_wins(monkeypatch):
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    assert ModelConfig().batch_invariant is None  # auto: the runner's device decides
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert ModelConfig().batch_invariant is True
    assert ModelConfig(batch_invariant=False).batch_invariant is False
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "0")
    assert ModelConfig().batch_invariant is False


def test_refused_where_it_cannot_hold_and_the_default_follows_the_device(monkeypatch):
    from minicore.model import runner
    from minicore.model.native import resolve_batch_invariant

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_batch_invariant(ModelConfig(batch_invariant=True), cuda, object())
    for device, kernels, default in ((cpu, object(), True), (cuda, object(), False),
                                     (cpu, None, False)):  # no C compiler: off, not refused
        config = ModelConfig()
        assert resolve_batch_invariant(config, device, kernels) is default
        assert config.batch_invariant is default
    monkeypatch.setattr(runner, "native_kernels", lambda: None)
    with pytest.raises(ValueError, match="kernels, which could not be built"):
        LLM(dtype="float32", **ENGINE)


def test_the_engines_config_line_says_which(caplog):
    with caplog.at_level("INFO", logger="minicore"):
        LLM(dtype="float32", max_model_len=512, kv_cache_memory=1 << 27)
    assert "batch_invariant=True" in caplog.text  # the default on CPU
    caplog.clear()
    with caplog.at_level("INFO", logger="minicore"):
        LLM(dtype="float32", max_model_len=512, kv_cache_memory=1 << 27, batch_invariant=False)
    assert "batch_invariant=False" in caplog.text
