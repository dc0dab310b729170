"""--reasoning-parser deepseek_r1 / qwen3 (minicore/entrypoints/reasoning.py): a thinking model's
output split at </think> into message.reasoning and the content, whole and streamed in pieces of
any size (the deltas joined give the same split), include_reasoning false leaving the reasoning
out; and served, on the default model thinking by itself: the same split in the response and in
the stream, a regex constraining only the answer."""

import json
import re

import httpx
import pytest
from server_helpers import ServerProcess

from minicore.entrypoints.reasoning import REASONING_PARSERS, WithReasoning
from minicore.entrypoints.tool_calls import ChatTools, ToolCallParser

CASES = [
    ("deepseek_r1", "<think>Paris is the capital.</think>The answer is Paris.",
     "Paris is the capital.", "The answer is Paris."),
    # DeepSeek-R1's template opens the tag in the prompt: the output only closes it.
    ("deepseek_r1", "Let me think.</think>Paris.", "Let me think.", "Paris."),
    ("deepseek_r1", "Still thinking about it", "Still thinking about it", None),
    ("qwen3", "<think>\nShort.\n</think>\n\nParis.", "\nShort.\n", "\n\nParis."),
    ("qwen3", "Paris, without thinking.", None, "Paris, without thinking."),
    ("qwen3", "<think>never closed", None, "<think>never closed"),
]


def chat_parser(name: str, include: bool = True) -> WithReasoning:
    no_tools = ChatTools(None, "none", None, None)
    return WithReasoning(REASONING_PARSERS[name](), ToolCallParser(no_tools), include)


@pytest.mark.parametrize("name, output, reasoning, content", CASES)
def test_a_whole_output(name, output, reasoning, content):
    message, finish_reason = chat_parser(name).parse(output, "stop")
    assert (message.reasoning, message.content, finish_reason) == (reasoning, content, "stop")
    assert chat_parser(name, include=False).parse(output, "stop")[0].reasoning is None


@pytest.mark.parametrize("name, output, reasoning, content", CASES[:5])
@pytest.mark.parametrize("piece", [1, 2, 3, 5, 8])
def test_streamed_in_pieces(name, output, reasoning, content, piece):
    parser, joined = chat_parser(name), {"reasoning": "", "content": ""}
    pieces = [output[i:i + piece] for i in range(0, len(output), piece)]
    for i, delta in enumerate(pieces):
        message = parser.parse_delta(delta, "stop" if i == len(pieces) - 1 else None)
        for key in joined:
            joined[key] += getattr(message, key, None) or "" if message else ""
    assert joined == {"reasoning": reasoning or "", "content": content or ""}


def test_served_the_reasoning_comes_apart_from_the_content():
    # The default model, continuing a pattern it was shown twice, thinks and closes the tag by
    # itself; the regex constrains only the answer after it (structured outputs after the
    # reasoning, as vLLM's), which without the gate would have been all of it.
    answer = r'\{"colour": "(red|blue)"\}'
    shown = ('Q: colour? <think>Let me think.</think>{"colour": "red"}\nQ: colour? <think>Let '
             'me think.</think>{"colour": "blue"}\nQ: colour? <think>Let me')
    with ServerProcess("--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
                       "--reasoning-parser", "deepseek_r1") as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        body = {"messages": [{"role": "user", "content": "Pick a colour."},
                             {"role": "assistant", "content": shown}],
                "add_generation_prompt": False, "continue_final_message": True,
                "max_tokens": 64, "temperature": 0, "structured_outputs": {"regex": answer}}
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["reasoning"] == " think." and re.fullmatch(answer, message["content"])
        joined = {"reasoning": "", "content": ""}
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    for key in joined:
                        joined[key] += delta.get(key) or ""
        assert joined == {"reasoning": message["reasoning"], "content": message["content"]}
        hidden = http.post("/v1/chat/completions", json={**body, "include_reasoning": False})
        assert "reasoning" not in hidden.json()["choices"][0]["message"]
