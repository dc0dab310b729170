"""Chat messages to prompts (chat_utils) and logprobs to the OpenAI shapes (logprobs_format),
without a server: content parts, history tool calls reaching the template, vLLM's
chat_template_kwargs filtering and refusals, -inf clamping and top-N selection."""

import math
from types import SimpleNamespace

import pytest

from minicore.config import create_engine_config
from minicore.engine.input_processor import InvalidRequestError
from minicore.entrypoints.chat_utils import apply_hf_chat_template, parse_chat_messages
from minicore.entrypoints.logprobs_format import LogprobsFormatter, prompt_logprobs_json
from minicore.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    TokenizeRequest,
)
from minicore.entrypoints.serving import OpenAIServing
from minicore.entrypoints.serving_tokenization import tokenize
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.outputs import Logprob

# Shows what a template receives: each message's role, content, tool calls and ids, and a kwarg.
ECHO_TEMPLATE = ("{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ m.name }}|"
                 "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.x "
                 "}}){% endfor %}|{{ m.tool_call_id }}]{% endfor %}{{ flavour }}"
                 "{% if add_generation_prompt %}<gen>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir(None), vocab_size=False)


HISTORY = [
    {"role": "system",
     "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
    {"role": "user", "content": "add", "name": "ann"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 3}'}}]},
    {"role": "tool", "content": "4", "tool_call_id": "c1"},
]


def test_history_fields_reach_the_template(tokenizer):
    conversation = parse_chat_messages(HISTORY)
    text = apply_hf_chat_template(tokenizer, conversation, chat_template=ECHO_TEMPLATE,
                                  add_generation_prompt=True,
                                  chat_template_kwargs={"flavour": "!", "unused": 1})
    # Text parts joined with newlines (vLLM); tool call arguments parsed from JSON.
    assert text == "[system|be\nbrief|||][user|add|ann||][assistant|||f(3)|][tool|4|||c1]!<gen>"


def test_a_request_chat_template_needs_the_trust_flag(tokenizer):
    client = SimpleNamespace(tokenizer=tokenizer, vocab_size=10, config=create_engine_config())
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                    chat_template="{{ messages[0].content }}!")
    with pytest.raises(OpenAIError) as e:
        OpenAIServing(client, ["m"]).render_chat(request)
    assert (e.value.status, e.value.param) == (400, "chat_template")
    trusted = OpenAIServing(client, ["m"], trust_request_chat_template=True)
    assert trusted.render_chat(request)[1] == "hi!"


class BosTokenizer:
    """A tokenizer that adds a BOS (id 1) with special tokens, as Llama's does."""
    chat_template = "{% for m in messages %}<s>{{ m.content }}{% endfor %}"
    eos_token_id = 2

    def encode(self, text, add_special_tokens=True):
        return [1] * add_special_tokens + [ord(c) for c in text]

    def apply_chat_template(self, conversation, chat_template, tokenize, **kwargs):
        return "".join(m["content"] for m in conversation)


def test_add_special_tokens_defaults_as_vllm():
    client = SimpleNamespace(tokenizer=BosTokenizer(), vocab_size=300,
                             config=create_engine_config())
    serving = OpenAIServing(client, ["m"])
    messages = [{"role": "user", "content": "a"}]
    assert tokenize(serving, TokenizeRequest(prompt="a")).tokens == [1, 97]  # BOS, as vLLM
    assert tokenize(serving, TokenizeRequest(prompt="a", add_special_tokens=False)).tokens == [97]
    assert tokenize(serving, TokenizeRequest(messages=messages)).tokens == [97]
    assert CompletionRequest(prompt="a").add_special_tokens
    assert not ChatCompletionRequest(messages=messages).add_special_tokens


def test_return_tokens_as_token_ids_server_default_and_request_override(tokenizer):
    client = SimpleNamespace(tokenizer=tokenizer, vocab_size=10, config=create_engine_config())
    serving = OpenAIServing(client, ["m"], return_tokens_as_token_ids=True)
    request = CompletionRequest(prompt="x")
    assert serving._formatter(request).as_token_ids
    request.return_tokens_as_token_ids = False
    assert not serving._formatter(request).as_token_ids


def test_continue_final_message_leaves_the_last_message_open(tokenizer):
    partial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    text = apply_hf_chat_template(tokenizer, parse_chat_messages(partial), chat_template=None,
                                  add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHel")
    with pytest.raises(InvalidRequestError) as e:
        apply_hf_chat_template(tokenizer, parse_chat_messages(partial), chat_template=None,
                               add_generation_prompt=True, continue_final_message=True)
    assert e.value.param == "continue_final_message"


@pytest.mark.parametrize("messages, kwargs, param", [
    ([], None, "messages"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None,
     "messages"),
    ([{"content": "no role"}], None, "messages"),
    ([{"role": "assistant", "tool_calls": [{"type": "web"}]}], None, "messages"),
    ([{"role": "user", "content": "hi"}], {"tokenize": True}, "chat_template_kwargs"),
    ([{"role": "user", "content": "hi"}], {"chat_template": "x"}, "chat_template_kwargs"),
])
def test_bad_messages_and_kwargs_are_refused_naming_the_field(tokenizer, messages, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        apply_hf_chat_template(tokenizer, parse_chat_messages(messages), chat_template=None,
                               add_generation_prompt=True, chat_template_kwargs=kwargs)
    assert e.value.param == param


def test_completion_and_chat_logprobs_shapes(tokenizer):
    fmt = LogprobsFormatter(tokenizer)
    step = {5: Logprob(-3.0, 4), 7: Logprob(-0.1, 1), 9: Logprob(-math.inf, 2)}
    out = fmt.completion([11, 5], [None, step], num_top=1, initial_text_offset=10)
    assert out.token_logprobs == [None, -3.0] and out.top_logprobs[0] is None
    # The token itself and the top 1: N + 1 entries, in the dict's order.
    assert list(out.top_logprobs[1].values()) == [-3.0, -0.1]
    assert out.text_offset == [10, 10 + len(tokenizer.decode(11))]
    chat = fmt.chat([5], [step], top_logprobs=2).content[0]
    assert (chat.token, chat.logprob) == (tokenizer.decode(5), -3.0)
    # vLLM's chat top_logprobs: the dict's first N entries, -inf clamped to -9999.0.
    assert [t.logprob for t in chat.top_logprobs] == [-3.0, -0.1]
    assert [t.logprob for t in fmt.chat([5], [step], -1).content[0].top_logprobs] == [
        -3.0, -0.1, -9999.0]
    as_ids = LogprobsFormatter(tokenizer, return_tokens_as_token_ids=True)
    assert as_ids.chat([5], [step], 0).content[0].token == "token_id:5"
    assert prompt_logprobs_json([None, {9: Logprob(-math.inf, 2, "x")}])[1]["9"].logprob == -9999.0
