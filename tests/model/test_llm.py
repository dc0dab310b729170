"""The offline LLM API on the real model: sampling (seeds, top-k=1), chat, stop strings, errors that
leave nothing behind, and the `python -m minicore generate` command."""

import subprocess
import sys

import pytest

from minicore.llm import LLM
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["Once upon a time", "The best way to learn a language is", "My favourite food is"]


@pytest.fixture(scope="module")
def llm(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, max_model_len=256, max_num_seqs=8)


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _assert_idle(llm):
    scheduler = llm.llm_engine.scheduler
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    def run(seed):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        return _token_ids(llm.generate(PROMPTS, params, use_tqdm=False))

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_seeded_request_does_not_depend_on_its_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True)
    alone = _token_ids(llm.generate(PROMPTS[:1], params, use_tqdm=False))[0]
    unseeded = SamplingParams(max_tokens=16, temperature=0.9, ignore_eos=True)
    batched = llm.generate(PROMPTS, [params, unseeded, unseeded], use_tqdm=False)
    assert batched[0].outputs[0].token_ids == alone


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.3, top_k=1, seed=0),
                        use_tqdm=False)
    assert _token_ids(top1) == _token_ids(greedy)


def test_tiny_top_p_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    nucleus = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6),
                           use_tqdm=False)
    assert _token_ids(nucleus) == _token_ids(greedy)


def test_text_matches_tokens_and_chat_answers(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert completion.token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids,
                                                         skip_special_tokens=True)
    assert out.prompt.startswith("<|im_start|>")
    _assert_idle(llm)


def test_stop_string_cuts_text_and_frees_the_request(llm):
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    text = llm.generate(PROMPTS[:1], free, use_tqdm=False)[0].outputs[0].text
    word = text.split()[3]
    stopped = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0,
                                                       ignore_eos=True, stop=[word]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.text == text[:text.index(word)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert len(stopped.token_ids) < 40
    _assert_idle(llm)


def test_length_and_stop_token_finish_reasons(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason, out.stop_reason) == (5, "length", None)
    first = out.token_ids[2]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[first]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == first and out.finish_reason == "stop" and out.stop_reason == first


@pytest.mark.parametrize("bad", [
    dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0),
    dict(top_k=-2), dict(min_tokens=9, max_tokens=3), dict(stop_token_ids=["x"]),
])
def test_invalid_sampling_params_raise_before_anything_is_scheduled(llm, bad):
    with pytest.raises(ValueError):
        llm.generate(PROMPTS, SamplingParams(**bad), use_tqdm=False)
    _assert_idle(llm)


def test_prompt_longer_than_max_model_len_is_rejected_and_nothing_leaks(llm):
    long_prompt = list(range(100, 100 + 257))
    with pytest.raises(ValueError, match=r"257 tokens.*max_model_len \(256\)"):
        llm.generate(["fine", long_prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    _assert_idle(llm)
    assert llm.llm_engine.scheduler.requests == {}
    # The engine still serves the next request.
    assert len(llm.generate(["fine"], SamplingParams(max_tokens=4), use_tqdm=False)[0]
               .outputs[0].token_ids) == 4


def test_prompt_of_exactly_max_model_len_is_rejected_as_vllm_does(llm):
    # No room for one output token: vLLM's input processor refuses it too.
    with pytest.raises(ValueError, match=r"256 tokens, as many as max_model_len \(256\)"):
        llm.generate([list(range(100, 100 + 256))], SamplingParams(max_tokens=4), use_tqdm=False)
    _assert_idle(llm)
    assert len(llm.generate([list(range(100, 100 + 255))], SamplingParams(max_tokens=4),
                            use_tqdm=False)[0].outputs[0].token_ids) == 1


@pytest.mark.parametrize("prompt", ["", [], [10**9]])
def test_empty_or_out_of_vocabulary_prompt_is_rejected(llm, prompt):
    with pytest.raises(ValueError):
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    _assert_idle(llm)


def test_generate_command_prints_a_completion():
    result = subprocess.run(
        [sys.executable, "-m", "minicore", "generate", "The capital of France is",
         "--max-tokens", "8", "--max-model-len", "128"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "--- 'The capital of France is' (length)" in result.stdout
    assert len(result.stdout.splitlines()) >= 2


def test_generate_command_reports_a_bad_argument():
    result = subprocess.run(
        [sys.executable, "-m", "minicore", "generate", "hi", "--temperature", "-1"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "temperature" in result.stderr


def test_data_parallelism_is_refused_before_any_model_loads():
    with pytest.raises(ValueError, match="data_parallel_size must be 1"):
        LLM(data_parallel_size=2)


def test_min_tokens_holds_back_eos_on_the_real_model(llm):
    """EOS cannot be sampled before min_tokens outputs (the sampler masks it, as vLLM's
    MinTokensLogitsProcessor does; the scheduler's stop check no longer looks at min_tokens)."""
    chat = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    eos = llm.get_tokenizer().eos_token_id
    short = llm.chat(chat, SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)[0]
    natural = len(short.outputs[0].token_ids)
    assert short.outputs[0].finish_reason == "stop" and natural < 32  # it does stop early
    held = llm.chat(chat, SamplingParams(max_tokens=64, temperature=0, min_tokens=natural + 8),
                    use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= natural + 8
    assert eos not in held.token_ids[:natural + 8 - 1]
    _assert_idle(llm)


def test_engine_seed_makes_unseeded_sampling_repeat_on_a_fresh_engine(hf_model_and_tokenizer):
    """vLLM's --seed: requests with no seed of their own draw from the engine's seeded state."""
    model, tokenizer = hf_model_and_tokenizer
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)

    def run(seed):
        llm = LLM(model, tokenizer=tokenizer, max_model_len=128, seed=seed,
                  kv_cache_memory=1 << 24)
        return _token_ids(llm.generate(PROMPTS, params, use_tqdm=False))

    first = run(3)
    assert run(3) == first
    assert run(4) != first


def test_chat_template_flag_replaces_the_tokenizers(hf_model_and_tokenizer, tmp_path):
    model, tokenizer = hf_model_and_tokenizer
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")
    llm = LLM(model, tokenizer=tokenizer, max_model_len=128, chat_template=str(path),
              kv_cache_memory=1 << 24)
    out = llm.chat([{"role": "user", "content": "hi"}],
                   SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].prompt == "Q: hi\nA:"


def test_tokenizer_directory_is_used_instead_of_the_models(tmp_path):
    """--tokenizer: a local directory; a special token added to a saved copy shows which
    tokenizer was read, while the vocabulary size stays the model's."""
    from minicore.model.loader import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(None)
    own, vocab_size = load_tokenizer(model_dir)
    own.add_special_tokens({"additional_special_tokens": ["<minicore-test>"]})
    own.save_pretrained(tmp_path)
    tokenizer, same_vocab = load_tokenizer(model_dir, tmp_path)
    assert "<minicore-test>" in tokenizer.get_vocab() and same_vocab == vocab_size
