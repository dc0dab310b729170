"""The offline LLM API on the real model: sampling (seeds, top-k=1), chat, stop strings, errors that
leave nothing behind, and the `python -m minicore generate` command."""

import json
import subprocess
import sys

import pytest
from server_helpers import run_python

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
    # vLLM's rule: the stop token's text is left out, unless include_stop_str_in_output.
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode(out.token_ids[:-1])
    kept = llm.generate(PROMPTS[:1], SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, stop_token_ids=[first],
        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == tokenizer.decode(kept.token_ids) != out.text


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
    result = run_python([sys.executable, "-m", "minicore", "generate", "The capital of France is",
                         "--max-tokens", "8", "--max-model-len", "128"], timeout=300)
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


# ---- vLLM's offline API: prompt forms, n, chat options, defaults (issue 15) ---------------------

def test_every_prompt_form_of_vllm_gives_the_same_completion(llm):
    """str, list[int], {"prompt": str}, {"prompt_token_ids": [...]}, alone or mixed in a list."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    text = PROMPTS[0]
    ids = llm.get_tokenizer()(text).input_ids  # with the special tokens, as vLLM tokenizes
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    mixed = llm.generate(forms, greedy, use_tqdm=False)
    assert [o.prompt for o in mixed] == [text, None, text, None]
    assert all(o.prompt_token_ids == ids for o in mixed)
    assert len({tuple(t) for t in _token_ids(mixed)}) == 1
    for form in forms:  # a single prompt of each form
        (alone,) = llm.generate(form, greedy, use_tqdm=False)
        assert alone.outputs[0].token_ids == mixed[0].outputs[0].token_ids
    _assert_idle(llm)


@pytest.mark.parametrize("prompts, match", [
    (123, "prompts must be a string, a list of token ids, a dict.*got int"),
    ([None], "prompt 0: expected a string, a list of token ids or a dict, got NoneType"),
    (["fine", {"text": "x"}], "prompt 1: unsupported prompt key.* text"),
    ({"prompt": 5}, "prompt 0: 'prompt' must be a string, got int"),
    ({"prompt_token_ids": [1, "a"]}, "prompt 0: a token prompt must be a non-empty list"),
    ([{}], "prompt 0: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
    ({"prompt": "x", "multi_modal_data": {}}, "unsupported prompt key.*multi_modal_data"),
])
def test_a_prompt_of_no_vllm_form_is_refused_naming_it(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_idle(llm)


def test_n_samples_come_back_as_one_output_with_n_completions(llm):
    """n=3 seeded: one RequestOutput per prompt, completions indexed 0..2, the j-th the sample a
    request seeded with seed + j gives alone (vLLM's parallel sampling)."""
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert len(outputs) == 2
    for prompt, output in zip(PROMPTS[:2], outputs):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert output.prompt == prompt
        for j, completion in enumerate(output.outputs):
            alone = SamplingParams(max_tokens=10, temperature=1.0, seed=11 + j, ignore_eos=True)
            (single,) = llm.generate(prompt, alone, use_tqdm=False)
            assert completion.token_ids == single.outputs[0].token_ids
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    assert outputs[0].request_id != outputs[1].request_id
    _assert_idle(llm)


def test_logprobs_and_metrics_come_with_offline_outputs(llm):
    (out,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, logprobs=2),
                          use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 5
    for token_id, top in zip(completion.token_ids, completion.logprobs):
        assert next(iter(top)) == token_id and len(top) == 2  # greedy: the token is the top-1
        assert top[token_id].rank == 1
    assert completion.cumulative_logprob == pytest.approx(
        sum(top[t].logprob for t, top in zip(completion.token_ids, completion.logprobs)))
    (plain,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0),
                            use_tqdm=False)
    assert plain.outputs[0].logprobs is None
    assert out.metrics is not None and out.metrics.num_generation_tokens == 5


def test_chat_takes_content_parts_and_vllms_template_options(llm):
    greedy = SamplingParams(max_tokens=8, temperature=0)
    question = "What is the capital of France?"
    parts = [{"type": "text", "text": "What is the capital"},
             {"type": "text", "text": "of France?"}]
    (joined,) = llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False)
    assert "What is the capital\nof France?<|im_end|>" in joined.prompt  # vLLM joins with \n
    (plain,) = llm.chat([{"role": "user", "content": question}], greedy, use_tqdm=False)
    assert plain.prompt.endswith("<|im_start|>assistant\n")
    # The template holds the special tokens: the text is tokenized without adding any.
    assert plain.prompt_token_ids == llm.get_tokenizer().encode(plain.prompt,
                                                                add_special_tokens=False)
    start = "The capital of France is"
    (cont,) = llm.chat([{"role": "user", "content": question},
                        {"role": "assistant", "content": start}], greedy, use_tqdm=False,
                       add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith(start) and "Paris" in cont.outputs[0].text
    (inline,) = llm.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False,
                         chat_template="{{ greeting }} {{ messages[0].content }}:",
                         chat_template_kwargs={"greeting": "Q"})
    assert inline.prompt == "Q hi:"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    (with_tools,) = llm.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False,
                             chat_template="{% for t in tools %}{{ t.function.name }};{% endfor %}",
                             tools=tools)
    assert with_tools.prompt == "get_weather;"
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False,
                 continue_final_message=True)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 greedy, use_tqdm=False)
    _assert_idle(llm)


def test_text_prompts_get_the_tokenizers_special_tokens_chat_prompts_do_not(
        hf_model_and_tokenizer):
    """vLLM tokenizes a text prompt with add_special_tokens=True (a BOS-adding tokenizer puts its
    BOS first) and a chat prompt without (the template has them). SmolLM2's tokenizer adds none,
    so a copy is made to add one; max_model_len auto takes the model's context length."""
    import copy

    from tokenizers.processors import TemplateProcessing

    model, tokenizer = hf_model_and_tokenizer
    bos_tokenizer = copy.deepcopy(tokenizer)
    bos = bos_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    bos_tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    llm = LLM(model, tokenizer=bos_tokenizer, max_model_len=-1, kv_cache_memory=1 << 29)
    assert llm.config.scheduler_config.max_model_len == min(
        model.config.max_position_embeddings, tokenizer.model_max_length)
    one = SamplingParams(max_tokens=1)
    (text,) = llm.generate("Hello", one, use_tqdm=False)
    assert text.prompt_token_ids == [bos] + tokenizer.encode("Hello", add_special_tokens=False)
    (chat,) = llm.chat([{"role": "user", "content": "Hello"}], one, use_tqdm=False)
    assert chat.prompt_token_ids[0] != bos
    assert chat.prompt_token_ids == tokenizer.encode(chat.prompt, add_special_tokens=False)


def test_default_sampling_params_come_from_the_generation_config(tmp_path):
    """vLLM's get_default_sampling_params: generate() and chat() without sampling params use the
    model's generation_config.json defaults (--generation-config auto); vllm: SamplingParams()."""
    from minicore.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(None)
    for file in model_dir.iterdir():  # the default model, its generation config edited
        if file.name != "generation_config.json":
            (tmp_path / file.name).symlink_to(file)
    config = json.loads((model_dir / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=3, top_k=5)
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), max_model_len=128, kv_cache_memory=1 << 24)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 3, 5)
    (out,) = llm.generate(PROMPTS[0], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    neutral = LLM(str(tmp_path), max_model_len=128, kv_cache_memory=1 << 24,
                  generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()
