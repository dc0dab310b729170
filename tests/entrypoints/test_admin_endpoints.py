"""vLLM's operational endpoints and usage details (issue 15): /ping (GET and POST), /load with
and without --enable-server-load-tracking, /reset_prefix_cache on every engine, and
usage.prompt_tokens_details.cached_tokens only with --enable-prompt-tokens-details, and serve's
--chat-template applied by the frontend. Unit tests on
test_api_unit's scripted client; one server on the simulated runner for the reset end to end."""

import asyncio

import httpx
import pytest
from server_helpers import ServerProcess
from test_api_unit import MODEL, ScriptedClient, _events, tokenizer_and_vocab

from minicore.config import create_engine_config
from minicore.entrypoints.api_server import build_app
from minicore.entrypoints.metrics import ServerMetrics
from minicore.entrypoints.serving import OpenAIServing
from minicore.outputs import CompletionOutput, RequestOutput

__all__ = ["tokenizer_and_vocab"]  # a fixture, used by name
CACHED = 5


class CachingClient(ScriptedClient):
    """The scripted client, on two engines, whose prompts always hit CACHED tokens, and whose
    utility calls are recorded."""

    def __init__(self, tokenizer, vocab_size):
        super().__init__(tokenizer, vocab_size)
        self.config = create_engine_config(max_model_len=64, data_parallel_size=2)
        self.utility_calls, self.utility_results = [], [True, True]

    @staticmethod
    def _output(request_id, prompt, prompt_ids, text, ids, reason):
        return RequestOutput(request_id, prompt, prompt_ids,
                             [CompletionOutput(0, text, list(ids), reason)], reason is not None,
                             num_cached_tokens=CACHED)

    async def call_utility(self, method, *args, engine_index=0):
        self.utility_calls.append((method, engine_index))
        return self.utility_results[engine_index]


@pytest.fixture
def client(tokenizer_and_vocab):
    return CachingClient(*tokenizer_and_vocab)


def _http(client, details=False, tracking=False):
    serving = OpenAIServing(client, [MODEL], enable_prompt_tokens_details=details)
    app = build_app(client, serving, ServerMetrics(MODEL, 1, lambda: client.latest_stats),
                    log_stats=False, enable_server_load_tracking=tracking)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")


async def test_ping_answers_get_and_post_like_health(client):
    async with _http(client) as http:
        assert (await http.get("/ping")).status_code == 200
        assert (await http.post("/ping")).status_code == 200
        client.is_healthy = False
        assert (await http.get("/ping")).status_code == 503


async def _wait_load(http, expected):
    for _ in range(200):
        if (await http.get("/load")).json() == {"server_load": expected}:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"/load never reached {expected}: {(await http.get('/load')).json()}")


@pytest.mark.parametrize("tracking", [False, True])
async def test_load_counts_requests_in_flight_only_when_tracking(client, tracking):
    client.script.hang = True
    async with _http(client, tracking=tracking) as http:
        pending = asyncio.ensure_future(http.post("/v1/completions", json={
            "prompt": "Hello", "max_tokens": 3}))
        while not client.started:
            await asyncio.sleep(0.01)
        await _wait_load(http, 1 if tracking else 0)
        await client.abort(client.started[0])
        assert (await pending).json()["choices"][0]["finish_reason"] == "abort"
        await _wait_load(http, 0)
        client.script.hang = False
        # A stream counts until it has ended; a refused request leaves no count behind.
        r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                     "stream": True})
        assert len(_events(r.text)) == 2
        assert (await http.post("/v1/completions", json={"prompt": "Hi", "top_p": 7})) \
            .status_code == 400
        assert (await http.get("/load")).json() == {"server_load": 0}


async def test_reset_prefix_cache_resets_every_engine(client):
    async with _http(client) as http:
        r = await http.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"success": True}
        assert client.utility_calls == [("reset_prefix_cache", 0), ("reset_prefix_cache", 1)]
        client.utility_results[1] = False  # a block still in use on engine 1
        assert (await http.post("/reset_prefix_cache")).json() == {"success": False}
        assert (await http.get("/reset_prefix_cache")).status_code == 405


async def test_cached_tokens_in_usage_only_with_prompt_tokens_details(client):
    body = {"prompt": ["Hello", "Hi"], "max_tokens": 2, "n": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with _http(client) as http:
        assert "prompt_tokens_details" not in (await http.post("/v1/completions", json=body)) \
            .json()["usage"]
    async with _http(client, details=True) as http:
        usage = (await http.post("/v1/completions", json=body)).json()["usage"]
        # Two prompts, each counted once whatever n is.
        assert usage["prompt_tokens_details"] == {"cached_tokens": 2 * CACHED}
        usage = (await http.post("/v1/chat/completions", json=chat)).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED}
        r = await http.post("/v1/chat/completions", json=chat | {
            "stream": True, "stream_options": {"include_usage": True}})
        assert _events(r.text)[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}


async def test_chat_template_flag_formats_the_prompt(client):
    client.config = create_engine_config(
        max_model_len=64, chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}")
    async with _http(client) as http:
        r = await http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert client.tokenizer.decode(r.json()["tokens"]) == "<Hi>"


def test_reset_prefix_cache_end_to_end_on_the_simulated_runner():
    """A repeated prompt hits the prefix cache; after POST /reset_prefix_cache it does not."""
    prompt = {"prompt": list(range(100, 164)), "max_tokens": 1}
    with ServerProcess("--runner", "simulated", "--enable-prompt-tokens-details") as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        def cached():
            r = http.post("/v1/completions", json=prompt)
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached() == 0
        assert cached() == 48  # three full blocks of 16; the last block is recomputed
        assert http.post("/reset_prefix_cache").json() == {"success": True}
        assert cached() == 0
        assert http.get("/ping").status_code == 200
