"""The OpenAI layer's sampling fields end to end: the openai SDK against one real `serve` process
on the default model (fp32 on the CPU), each field checked against transformers on the same
model in fp32. Logprobs, top logprobs, prompt logprobs and echo equal a log-softmax of the
model's logits (to 1e-4); penalties and logit_bias change the greedy choice exactly as the same
arithmetic done by hand on the logits; min_tokens never ends early nor emits EOS before it;
streamed logprobs equal the whole response's; every refused field is a 400 naming it."""

import httpx
import openai
import pytest
import torch
from server_helpers import ServerProcess, check_openai_error

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
COUNTING = "1, 2, 1, 2, 1, 2, 1, 2, 1, 2,"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
AS_IDS = {"return_tokens_as_token_ids": True}
TOL = 1e-4


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
                       "--max-num-seqs", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(hf_model_and_tokenizer):
    """The session's model with transformers' own attention (an LLM test may have switched it to
    minicore's paged attention, which a plain forward cannot run)."""
    from minicore.model.attention import attn_implementation

    model = hf_model_and_tokenizer[0]
    with attn_implementation(model, "sdpa"):
        yield model


@pytest.fixture(scope="module")
def tokenizer(hf_model_and_tokenizer):
    return hf_model_and_tokenizer[1]


@torch.no_grad()
def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """Row i: the log-softmax of the logits after ids[:i + 1] (fp32, as the server computes)."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _prompt_ids(http, prompt=None, messages=None) -> list[int]:
    body = {"prompt": prompt} if messages is None else {"messages": messages}
    return http.post("/tokenize", json=body).json()["tokens"]


def test_completion_logprobs_and_top_logprobs_equal_transformers(client, model, tokenizer, http):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=3, extra_body=AS_IDS)
    lp = out.choices[0].logprobs
    prompt_ids, generated = _prompt_ids(http, PROMPT), _ids(lp.tokens)
    assert prompt_ids == tokenizer.encode(PROMPT)  # completions add special tokens, as vLLM
    rows = _logprobs(model, prompt_ids + generated)[len(prompt_ids) - 1:]
    for i, token_id in enumerate(generated):
        row = rows[i]
        assert token_id == int(row.argmax())  # greedy
        assert abs(lp.token_logprobs[i] - float(row[token_id])) < TOL
        top = row.topk(3)
        want = {f"token_id:{t}": float(v) for t, v in zip(top.indices.tolist(), top.values)}
        want[f"token_id:{token_id}"] = float(row[token_id])  # the token itself: N + 1 entries
        assert lp.top_logprobs[i].keys() == want.keys()
        assert all(abs(lp.top_logprobs[i][k] - v) < TOL for k, v in want.items())
    # Spelled as text, the tokens make the completion and the offsets count their characters.
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     logprobs=0)
    tlp = text.choices[0].logprobs
    assert tlp.tokens == [tokenizer.decode(t) for t in generated]
    assert "".join(tlp.tokens) == text.choices[0].text
    assert tlp.text_offset == [sum(map(len, tlp.tokens[:i])) for i in range(len(tlp.tokens))]
    assert all(len(top) == 1 for top in tlp.top_logprobs)  # logprobs=0: the token alone


def test_echo_puts_the_prompt_and_its_logprobs_first(client, model, http):
    prompts = [PROMPT, "Water boils at"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0.8,
                                    seed=1, n=2, echo=True, logprobs=1, extra_body=AS_IDS)
    assert len(out.choices) == 4
    for choice in out.choices:
        prompt = prompts[choice.index // 2]
        prompt_ids = _prompt_ids(http, prompt)
        ids = _ids(choice.logprobs.tokens)
        assert ids[:-1] == prompt_ids and choice.text.startswith(prompt)
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        rows = _logprobs(model, ids)
        for k in range(1, len(ids)):  # the prompt's tokens, then the sampled one (raw logprobs)
            assert abs(choice.logprobs.token_logprobs[k] - float(rows[k - 1, ids[k]])) < TOL
    # max_tokens 0: the prompt alone (vLLM's echo without generation).
    only = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                     logprobs=0, extra_body=AS_IDS).choices[0]
    assert only.text == PROMPT and _ids(only.logprobs.tokens) == _prompt_ids(http, PROMPT)


def test_prompt_logprobs_with_ranks(http, model):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    prompt_ids = _prompt_ids(http, PROMPT)
    rows = _logprobs(model, prompt_ids)
    assert len(choice["prompt_logprobs"]) == len(prompt_ids)
    assert choice["prompt_logprobs"][0] is None
    for k in range(1, len(prompt_ids)):
        entry, row, token_id = choice["prompt_logprobs"][k], rows[k - 1], prompt_ids[k]
        assert abs(entry[str(token_id)]["logprob"] - float(row[token_id])) < TOL
        assert entry[str(token_id)]["rank"] == int((row > row[token_id]).sum()) + 1
        assert {str(t) for t in row.topk(2).indices.tolist()} <= entry.keys()
    check_openai_error(http.post("/v1/completions", json={**body, "stream": True}), 400)


def test_chat_logprobs_equal_transformers(client, model, tokenizer, http):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    prompt_ids = _prompt_ids(http, messages=QUESTION)
    generated = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c.token))[0]
                 for c in content]
    rows = _logprobs(model, prompt_ids + generated)[len(prompt_ids) - 1:]
    for c, token_id, row in zip(content, generated, rows):
        assert c.token == tokenizer.decode(token_id) and c.bytes == list(c.token.encode())
        assert abs(c.logprob - float(row[token_id])) < TOL
        top = row.topk(2)
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode(t) for t in top.indices]
        assert all(abs(t.logprob - float(v)) < TOL for t, v in zip(c.top_logprobs, top.values))
    assert "".join(c.token for c in content) == out.choices[0].message.content


def test_streamed_logprobs_equal_the_whole_response(client):
    kwargs = dict(model=MODEL, prompt=COUNTING, max_tokens=8, temperature=0, logprobs=2,
                  stop=[" 2, 1"], echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    tokens, logprobs, offsets, text = [], [], [], ""
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert (tokens, offsets) == (whole.logprobs.tokens, whole.logprobs.text_offset)
    assert logprobs[0] is None and whole.logprobs.token_logprobs[0] is None
    assert all(abs(a - b) < TOL for a, b in zip(logprobs[1:], whole.logprobs.token_logprobs[1:]))
    chat = dict(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                top_logprobs=1)
    want = client.chat.completions.create(**chat).choices[0].logprobs.content
    got = [c for chunk in client.chat.completions.create(**chat, stream=True)
           for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in got] == [c.token for c in want]


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 4 == chunks[-1].usage.completion_tokens
    chat = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chat)
    assert chat[0].usage.completion_tokens == 0 and chat[-1].usage.completion_tokens == 3


@torch.no_grad()
def _hand_greedy(model, ids, n, *, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Greedy decoding with vLLM's penalties done by hand on the logits: repetition on tokens
    of prompt and output (divide positive logits, multiply negative ones), frequency and presence
    on the output's counts, logit_bias added."""
    out = []
    for _ in range(n):
        logits = model(torch.tensor([ids + out])).logits[0, -1].double()
        seen = torch.tensor(sorted(set(ids + out)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition,
                                   logits[seen] * repetition)
        counts = torch.zeros_like(logits)
        for token_id in out:
            counts[token_id] += 1
        logits -= frequency * counts + presence * (counts > 0).double()
        for token_id, value in (bias or {}).items():
            logits[token_id] += value
        out.append(int(logits.argmax()))
    return out


COLORS = "List of colors: red, green, blue,"


@pytest.mark.parametrize("prompt, fields, hand", [
    (COLORS, {"presence_penalty": 2.0}, {"presence": 2.0}),
    (COLORS, {"frequency_penalty": 1.0}, {"frequency": 1.0}),
    (COUNTING, {"repetition_penalty": 1.8}, {"repetition": 1.8}),
])
def test_penalties_change_the_greedy_choice_as_by_hand(client, model, http, prompt, fields, hand):
    ids = _prompt_ids(http, prompt)
    common = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    extra = {**AS_IDS, "ignore_eos": True}
    out = _ids(client.completions.create(**common, extra_body={**extra, **fields})
               .choices[0].logprobs.tokens)
    plain = _ids(client.completions.create(**common, extra_body=extra).choices[0].logprobs.tokens)
    assert out == _hand_greedy(model, ids, 8, **hand)
    assert plain == _hand_greedy(model, ids, 8)
    assert out != plain  # the penalty mattered


def test_logit_bias_changes_the_greedy_choice_as_by_hand(client, model, tokenizer, http):
    ids = _prompt_ids(http, PROMPT)
    first = _hand_greedy(model, ids, 1)[0]
    for bias in ({first: -100.0}, {tokenizer.encode(" banana")[0]: 100.0}):
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
            logit_bias={str(k): v for k, v in bias.items()}, extra_body=AS_IDS).choices[0]
        assert _ids(out.logprobs.tokens) == _hand_greedy(model, ids, 3, bias=bias)
        assert _ids(out.logprobs.tokens)[0] != first


def test_min_tokens_never_ends_early_nor_emits_eos_before(client, tokenizer):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                  temperature=0, max_tokens=64)
    natural = client.chat.completions.create(**kwargs)
    assert natural.choices[0].finish_reason == "stop"
    min_tokens = natural.usage.completion_tokens + 8
    out = client.chat.completions.create(**kwargs, logprobs=True, extra_body={
        **AS_IDS, "min_tokens": min_tokens})
    ids = _ids([c.token for c in out.choices[0].logprobs.content])
    assert out.usage.completion_tokens >= min_tokens
    assert tokenizer.eos_token_id not in ids[:min_tokens]


def test_skip_special_tokens_false_shows_them(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                  temperature=0, max_tokens=40)
    natural = client.chat.completions.create(**kwargs)
    assert natural.choices[0].finish_reason == "stop"  # its EOS is <|im_end|>, a special token
    # Greedy, so ignoring EOS repeats the natural answer up to it: one token more shows it.
    past_eos = natural.usage.completion_tokens + 1
    texts = [client.chat.completions.create(**{**kwargs, "max_tokens": past_eos}, extra_body={
        "ignore_eos": True, "skip_special_tokens": skip}).choices[0].message.content
        for skip in (True, False)]
    assert "<|im_end|>" not in texts[0] and "<|im_end|>" in texts[1]


def test_allowed_token_ids_bad_words_and_include_stop_str(client, tokenizer):
    allowed = [tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=0, extra_body={**AS_IDS, "allowed_token_ids": allowed})
    assert set(_ids(out.choices[0].logprobs.tokens)) <= set(allowed)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      logprobs=0, extra_body=AS_IDS)
    first = _ids(plain.choices[0].logprobs.tokens)[0]
    word = tokenizer.decode(first).strip()  # one token, with or without its leading space
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logprobs=0, extra_body={**AS_IDS, "bad_words": [word]})
    assert _ids(banned.choices[0].logprobs.tokens)[0] != first
    stop = plain.choices[0].text[3:6]
    for include in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                        stop=[stop], extra_body={"include_stop_str_in_output":
                                                                 include})
        assert out.choices[0].text.endswith(stop) == include


def test_continue_final_message_add_special_tokens_and_truncation(http, tokenizer):
    partial = QUESTION + [{"role": "assistant", "content": "The capital"}]
    body = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    assert tokenizer.decode(tokens).endswith("The capital")
    r = http.post("/v1/chat/completions", json={**body, "model": MODEL, "max_tokens": 2,
                                                "add_generation_prompt": True})
    assert check_openai_error(r, 400)["param"] == "continue_final_message"
    assert http.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == tokenizer.encode("hi")
    for endpoint, body in (("/v1/completions", {"prompt": COUNTING}),
                           ("/v1/chat/completions", {"messages": QUESTION})):
        r = http.post(endpoint, json={**body, "model": MODEL, "max_tokens": 1,
                                      "truncate_prompt_tokens": 3})
        assert r.json()["usage"]["prompt_tokens"] == 3  # the prompt's last 3 tokens


def test_chat_echo_heads_the_answer_with_the_last_assistant_message(client):
    partial = QUESTION + [{"role": "assistant", "content": "The capital"}]
    kwargs = dict(model=MODEL, messages=partial, max_tokens=3, temperature=0, extra_body={
        "echo": True, "add_generation_prompt": False, "continue_final_message": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kwargs, stream=True) if c.choices)
    assert whole.startswith("The capital") and len(whole) > len("The capital")
    assert streamed == whole


def test_min_p_one_keeps_only_the_most_likely_token(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    for seed in (1, 2):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0,
                                        seed=seed, extra_body={"min_p": 1.0})
        assert out.choices[0].text == greedy.choices[0].text


REFUSED = [
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"10000000": 1}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"n": 2, "temperature": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
]


@pytest.mark.parametrize("endpoint, fields, param", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused_fields_are_400_naming_them(http, endpoint, fields, param):
    body = {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": QUESTION}
    r = http.post(endpoint, json={"model": MODEL, "max_tokens": 2, **body, **fields})
    assert check_openai_error(r, 400)["param"] == param
