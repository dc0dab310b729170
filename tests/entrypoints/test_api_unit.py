"""The server without an engine: request validation and translation, OpenAI error bodies, and
the app's routes on a scripted engine client (streaming format, n > 1, auth, early close and
shutdown abort their engine requests). The metrics are tested in test_metrics.py."""

import asyncio
import json
from dataclasses import dataclass

import httpx
import pydantic
import pytest

from minicore.config import create_engine_config
from minicore.engine.input_processor import InputProcessor
from minicore.entrypoints.api_server import build_app
from minicore.entrypoints.metrics import ServerMetrics
from minicore.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    make_error,
    to_json,
    validation_error,
)
from minicore.entrypoints.serving import OpenAIServing
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.outputs import CompletionOutput, Logprob, RequestOutput
from minicore.protocol import SchedulerStats
from minicore.sampling_params import SamplingParams

MODEL = "test-model"


# ------------------------------------------------------------------ requests and errors


def test_defaults_become_sampling_params():
    params = CompletionRequest(prompt="x").to_sampling_params(16)
    assert params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)
    # Clients send explicit nulls for "the default".
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": None, "top_p": None,
                                            "top_k": None, "stop": "END"})
    assert req.to_sampling_params(4) == SamplingParams(max_tokens=4, stop=["END"])
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens == 16


def test_chat_max_completion_tokens_wins_over_max_tokens():
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=msgs, max_tokens=7).requested_max_tokens == 7
    assert ChatCompletionRequest(messages=msgs, max_tokens=7,
                                 max_completion_tokens=3).requested_max_tokens == 3
    assert ChatCompletionRequest(messages=msgs).requested_max_tokens is None


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"n": 0}, "n"),
])
def test_invalid_sampling_values_are_400_naming_the_parameter(fields, param):
    req = CompletionRequest(prompt="x", **fields)
    with pytest.raises(OpenAIError) as e:
        req.to_sampling_params(req.max_tokens)
    assert (e.value.status, e.value.param) == (400, param)
    assert param in e.value.message


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3, "n": 2}, "best_of"),
    ({"guided_json": {}}, "guided_json"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"guided_choice": ["a"]}, "guided_choice"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"truncation_side": "right", "truncate_prompt_tokens": 2}, "truncation_side"),
])
def test_unsupported_parameters_are_refused_unless_unused(fields, param):
    for request_type, body in ((CompletionRequest, {"prompt": "x"}),
                               (ChatCompletionRequest, {"messages": [{"role": "user",
                                                                      "content": "x"}]})):
        with pytest.raises(OpenAIError) as e:
            request_type(**body, **fields).check_unsupported()
        assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_tools_are_refused_on_completions_and_taken_by_chat(fields, param):
    with pytest.raises(OpenAIError) as e:
        CompletionRequest(prompt="x", **fields).check_unsupported()
    assert (e.value.status, e.value.param) == (400, param)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    chat.check_unsupported()  # the chat endpoint checks them
    assert getattr(chat, param) == fields[param]


def test_unused_values_of_unsupported_parameters_pass():
    CompletionRequest(prompt="x", best_of=2, n=2, suffix=None, tools=[], tool_choice="none",
                      response_format={"type": "text"}, guided_json=None).check_unsupported()
    ChatCompletionRequest(messages=[], tool_choice="auto").check_unsupported()
    assert CompletionRequest(prompt="x", vendor_x=1).ignored_fields() == ["vendor_x"]


def test_pydantic_and_json_errors_become_one_400():
    with pytest.raises(pydantic.ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"content": "hi"}], "max_tokens": "x"})
    err = validation_error(e.value.errors(include_url=False))
    assert err.status == 400 and err.param == "messages"
    assert "messages.0.role: Field required" in err.message
    assert "max_tokens: Input should be a valid integer" in err.message
    bad_json = validation_error([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode "
                                  "error", "ctx": {"error": "Expecting value"}}])
    assert (bad_json.message, bad_json.param) == ("invalid JSON: Expecting value", None)


def test_error_body_is_openai_shaped():
    assert json.loads(to_json(make_error("The model `x` does not exist.", 404, "model"))) == {
        "error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                  "param": "model", "code": 404}}
    assert json.loads(to_json(make_error("no", 401)))["error"]["type"] == "AuthenticationError"
    assert json.loads(to_json(make_error("no", 405)))["error"]["type"] == "MethodNotAllowedError"


# ------------------------------------------------------- the app on a scripted client


@dataclass
class _Script:
    num_tokens: int = 4
    hang: bool = False  # never finish: only an abort ends it


class ScriptedClient:
    """AsyncLLM's interface (as the server uses it) with no engine: each request yields one token
    per output (" w<i>"), then finishes with "length"; a stream closed early, or abort(), aborts
    it."""

    def __init__(self, tokenizer, vocab_size, **engine_args):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.config = create_engine_config(max_model_len=64, **engine_args)
        self.input_processor = InputProcessor(self.config, tokenizer, vocab_size)
        self.model_name = MODEL
        self.errored, self.is_healthy = False, True
        self.latest_stats = {0: SchedulerStats()}
        self.script = _Script()
        self.started: list[str] = []
        self.params: list[SamplingParams] = []
        self.aborted: list[str] = []
        self._abort_events: dict[str, asyncio.Event] = {}

    @property
    def num_engines(self) -> int:
        return len(self.config.parallel_config.engine_ranks)

    async def generate(self, request, *, prompt_text=None, trace_headers=None):
        request_id, params = request.request_id, request.sampling_params
        prompt, prompt_token_ids = prompt_text, request.prompt_token_ids
        self.started.append(request_id)
        self.params.append(params)
        aborted = self._abort_events[request_id] = asyncio.Event()
        text, ids, finished = "", [], False
        try:
            for i in range(params.max_tokens or 10**9):
                if self.script.hang:
                    await aborted.wait()
                await asyncio.sleep(0)
                if aborted.is_set():
                    finished = True
                    yield self._output(request_id, prompt, prompt_token_ids, text, ids, "abort")
                    return
                text, ids = text + f" w{i}", ids + [100 + i]
                finished = i + 1 == (params.max_tokens or 10**9) or i + 1 == self.script.num_tokens
                output = self._output(request_id, prompt, prompt_token_ids, text, ids,
                                      "length" if finished else None)
                self._add_logprobs(output, params)
                yield output
                if finished:
                    return
        finally:
            if not finished:
                self.aborted.append(request_id)

    @staticmethod
    def _add_logprobs(output, params):
        """Made-up logprobs: token 100 + i gets -i, rank 1; prompt tokens -1 each."""
        if params.logprobs is not None:
            output.outputs[0].logprobs = [{t: Logprob(-float(t - 100), 1, f" w{t - 100}")}
                                          for t in output.outputs[0].token_ids]
        if params.prompt_logprobs is not None:
            output.prompt_logprobs = [None] + [{t: Logprob(-1.0, 1)}
                                               for t in output.prompt_token_ids[1:]]

    @staticmethod
    def _output(request_id, prompt, prompt_ids, text, ids, reason):
        return RequestOutput(request_id, prompt, prompt_ids,
                             [CompletionOutput(0, text, list(ids), reason)], reason is not None)

    async def abort(self, request_id):
        self._abort_events[request_id].set()

    async def shutdown(self):
        pass


@pytest.fixture(scope="module")
def tokenizer_and_vocab():
    return load_tokenizer(resolve_model_dir(None))


@pytest.fixture
def client(tokenizer_and_vocab):
    return ScriptedClient(*tokenizer_and_vocab)


@pytest.fixture
def serving(client):
    return OpenAIServing(client, [MODEL])


def _http(client, serving, api_key=None):
    metrics = ServerMetrics(MODEL, 1, lambda: client.latest_stats)
    app = build_app(client, serving, metrics, api_key=api_key, log_stats=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")


def _events(body: str) -> list:
    lines = [line for line in body.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


async def test_completion_stream_format_and_usage(client, serving):
    async with _http(client, serving) as http:
        r = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" w0", " w1", " w2"]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "length"]
    assert all("usage" not in e for e in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    assert {e["object"] for e in events} == {"text_completion"}


async def test_chat_stream_opens_with_the_role_and_ends_with_finish_reason(client, serving):
    async with _http(client, serving) as http:
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 2, "stream": True})
    events = _events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"] for e in events[1:]] == [{"content": " w0"},
                                                              {"content": " w1"}]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert {e["object"] for e in events} == {"chat.completion.chunk"}


async def test_n_and_prompt_lists_make_one_choice_each(client, serving):
    async with _http(client, serving) as http:
        r = await http.post("/v1/completions", json={
            "prompt": [[1, 2, 3], [4]], "n": 2, "max_tokens": 2, "seed": 5})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == " w0 w1" and c["finish_reason"] == "length" for c in body["choices"])
    # Each prompt counts once however many samples it has.
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    assert len(client.started) == 4 and not client.aborted


async def test_refused_requests_start_nothing(client, serving):
    async with _http(client, serving) as http:
        cases = [
            ({"prompt": ["ok", ""]}, 400, "prompt"),  # one bad prompt refuses them all
            ({"prompt": "x", "max_tokens": 65}, 400, "max_tokens"),  # > max_model_len 64 alone
            ({"prompt": [client.vocab_size]}, 400, "prompt"),
            ({"prompt": "x", "model": "other"}, 404, "model"),
            ({"prompt": "x", "priority": 1}, 400, "priority"),
        ]
        for body, status, param in cases:
            r = await http.post("/v1/completions", json=body)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), body
        r = await http.post("/v1/chat/completions", json={"messages": []})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
        r = await http.post("/v1/completions", content=b'{"prompt": ', headers={
            "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid JSON")
    assert client.started == []


async def test_api_key_guards_v1_only(client, serving):
    async with _http(client, serving, api_key="sesame") as http:
        r = await http.get("/v1/models")
        assert r.status_code == 401
        assert r.json() == {"error": {"message": "Incorrect API key provided.",
                                      "type": "AuthenticationError", "param": None, "code": 401}}
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
                ).status_code == 401
        r = await http.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200


async def test_dead_engine_is_503_everywhere(client, serving):
    client.errored, client.is_healthy = True, False
    async with _http(client, serving) as http:
        assert (await http.get("/health")).status_code == 503
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


async def test_tokenize_and_detokenize_round_trip(client, serving):
    async with _http(client, serving) as http:
        r = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
        assert r["tokens"] == client.tokenizer.encode("Hello world", add_special_tokens=False)
        assert (r["count"], r["max_model_len"]) == (len(r["tokens"]), 64)
        back = (await http.post("/detokenize", json={"tokens": r["tokens"]})).json()
        assert back == {"prompt": "Hello world"}
        chat = (await http.post("/tokenize", json={"messages": [{"role": "user",
                                                                 "content": "Hi"}]})).json()
        assert chat["tokens"][0] == client.tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert (await http.post("/detokenize", json={"tokens": [-1]})).status_code == 400


async def test_closing_a_stream_early_aborts_its_requests(client, serving):
    client.script.num_tokens = 1000
    for n in (1, 3):  # the single-stream path and the merge of several
        client.started.clear()
        client.aborted.clear()
        stream = await serving.create_completion(
            CompletionRequest(prompt="Hi", max_tokens=50, stream=True, n=n))
        assert (await anext(stream)).startswith(b"data: ")
        await stream.aclose()
        await asyncio.sleep(0.01)  # the merge's cleanup task
        assert sorted(client.aborted) == sorted(client.started) and len(client.started) == n
        assert serving.running == {}


async def test_shutdown_aborts_requests_in_flight(client, serving):
    client.script.hang = True
    task = asyncio.ensure_future(serving.create_completion(
        CompletionRequest(prompt="Hi", max_tokens=5, n=2)))
    while len(serving.running) < 2:
        await asyncio.sleep(0)
    serving.begin_shutdown()
    response = await asyncio.wait_for(task, 5)
    assert [c.finish_reason for c in response.choices] == ["abort", "abort"]
    with pytest.raises(OpenAIError) as e:
        await serving.create_completion(CompletionRequest(prompt="Hi"))
    assert e.value.status == 503


async def test_echo_and_logprobs_whole_and_streamed(client, serving):
    body = {"prompt": "Hello world", "max_tokens": 2, "echo": True, "logprobs": 0}
    prompt_ids = client.tokenizer.encode("Hello world")
    async with _http(client, serving) as http:
        whole = (await http.post("/v1/completions", json=body)).json()["choices"][0]
        events = _events((await http.post("/v1/completions", json={**body, "stream": True})).text)
        only = (await http.post("/v1/completions", json={**body, "max_tokens": 0})).json()
        by_ids = (await http.post("/v1/completions", json={**body, "prompt": prompt_ids})).json()
    assert by_ids["choices"][0]["text"] == "Hello world w0 w1"  # token ids echo as their text
    lp = whole["logprobs"]
    assert whole["text"] == "Hello world w0 w1"
    assert lp["tokens"] == [client.tokenizer.decode(t) for t in prompt_ids] + [" w0", " w1"]
    assert lp["token_logprobs"] == [None] + [-1.0] * (len(prompt_ids) - 1) + [0.0, -1.0]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert events[0]["choices"][0]["text"].startswith("Hello world")
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert sum((x["tokens"] for x in streamed), []) == lp["tokens"]
    assert sum((x["text_offset"] for x in streamed), []) == lp["text_offset"]
    assert only["choices"][0]["text"] == "Hello world"
    assert len(only["choices"][0]["logprobs"]["tokens"]) == len(prompt_ids)
    assert only["usage"]["completion_tokens"] == 1  # one token is run, as vLLM


async def test_generation_config_fills_unset_fields(tokenizer_and_vocab, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.3, "top_k": 7, "repetition_penalty": 1.2, "max_new_tokens": 3,
        "eos_token_id": [tokenizer_and_vocab[0].eos_token_id, 7]}))
    client = ScriptedClient(*tokenizer_and_vocab, generation_config=str(tmp_path))
    serving = OpenAIServing(client, [MODEL])
    assert serving.default_sampling_params == {"temperature": 0.3, "top_k": 7,
                                               "repetition_penalty": 1.2, "max_tokens": 3}
    async with _http(client, serving) as http:
        await http.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                    "content": "hi"}]})
        await http.post("/v1/completions", json={"prompt": "hi", "temperature": 1.0})
    chat, completion = client.params
    assert (chat.temperature, chat.top_k, chat.repetition_penalty, chat.max_tokens) == (
        0.3, 7, 1.2, 3)
    assert chat.stop_token_ids == [7]  # the generation config's other EOS id stops too
    assert (completion.temperature, completion.top_k, completion.max_tokens) == (1.0, 7, 16)
    vllm_mode = ScriptedClient(*tokenizer_and_vocab, generation_config="vllm")
    assert OpenAIServing(vllm_mode, [MODEL]).default_sampling_params == {}
