"""kv_transfer_params (disaggregated prefill) through the frontend, without an engine: checked in
SamplingParams; carried by the InputProcessor's EngineCoreRequest across msgpack; an
EngineCoreOutput's params reaching RequestOutput through the OutputProcessor; and over HTTP, taken
in completion and chat bodies (400 for a non-object, or with n > 1 or several prompts; with a KV
connector, 400 for what it could not act on, naming the key) and returned at the top level of whole
responses (null without them, as vLLM), never on stream chunks."""

import json
import types

import httpx
import msgspec
import pytest

from minicore.config import create_engine_config
from minicore.engine.input_processor import InputProcessor
from minicore.engine.output_processor import OutputProcessor, RequestOutputCollector
from minicore.entrypoints.api_server import build_app
from minicore.entrypoints.metrics import ServerMetrics
from minicore.entrypoints.serving import OpenAIServing
from minicore.kv_transfer.config import KVTransferConfig
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from minicore.request import FinishReason
from minicore.sampling_params import SamplingParams

MODEL = "test-model"
ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
       "remote_block_ids": None, "remote_host": None, "remote_port": None}


def returned_params(asked: dict) -> dict:
    """What the stub engine's connector answers: where the blocks are, and what it was asked."""
    return {"do_remote_prefill": True, "remote_engine_id": "engine-0", "remote_block_ids": [0, 1],
            "remote_host": "127.0.0.1", "remote_port": 5600, "asked": asked}


@pytest.mark.parametrize("value", [None, {}, ASK, {"a": [1, 2.5, "x", {"b": None}]}])
def test_sampling_params_take_a_json_object(value):
    assert SamplingParams(kv_transfer_params=value).kv_transfer_params == value


@pytest.mark.parametrize("value", [[1], "x", 3, {1: "a"}, {"a": float("nan")}, {"a": object()},
                                   {"a": 2**64}])
def test_sampling_params_refuse_anything_else(value):
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params=value)


@pytest.mark.parametrize("value", [None, ASK])
def test_the_engine_request_carries_them_over_msgpack(value):
    tokenizer = types.SimpleNamespace(eos_token_id=2)
    processor = InputProcessor(create_engine_config(max_model_len=64), tokenizer, 1000)
    request = processor.process_inputs("r", [5, 6, 7],
                                       SamplingParams(max_tokens=3, kv_transfer_params=value))
    # What the engine process decodes, __post_init__'s checks included.
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert received.sampling_params.kv_transfer_params == value
    assert received == request


@pytest.fixture(scope="module")
def tokenizer_and_vocab():
    return load_tokenizer(resolve_model_dir(None))


def test_the_output_processor_hands_the_final_params_to_the_request_output(tokenizer_and_vocab):
    processor = OutputProcessor(tokenizer_and_vocab[0])
    processor.add_request(EngineCoreRequest("r", [5, 6], SamplingParams(kv_transfer_params=ASK),
                                            None, 0.0), None)
    first = processor.process_outputs([EngineCoreOutput("r", [100])])
    assert first.request_outputs == []
    final = processor.process_outputs([EngineCoreOutput(
        "r", [101], FinishReason.LENGTH, kv_transfer_params=returned_params(ASK))])
    [output] = final.request_outputs
    assert output.finished and output.kv_transfer_params == returned_params(ASK)


class StubEngineClient:
    """AsyncLLM as the server uses it, on the real InputProcessor and OutputProcessor: each
    request crosses msgpack to a stub engine that answers two tokens, the last with the
    connector's params when the request asked for any."""

    def __init__(self, tokenizer, vocab_size, **config_args):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.config = create_engine_config(max_model_len=64, **config_args)
        self.input_processor = InputProcessor(self.config, tokenizer, vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        self.model_name = MODEL
        self.errored, self.is_healthy = False, True
        self.latest_stats = {0: SchedulerStats()}
        self.received: list[EngineCoreRequest] = []

    async def generate(self, request, *, prompt_text=None, trace_headers=None):
        queue = RequestOutputCollector()
        self.output_processor.add_request(request, prompt_text, queue, trace_headers)
        request = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
        self.received.append(request)
        asked = request.sampling_params.kv_transfer_params
        for output in (EngineCoreOutput(request.request_id, [100]), EngineCoreOutput(
                request.request_id, [101], FinishReason.LENGTH,
                kv_transfer_params=None if asked is None else returned_params(asked))):
            self.output_processor.process_outputs([output])
            yield await queue.get()

    async def abort(self, request_id):
        self.output_processor.abort_requests([request_id])

    async def shutdown(self):
        pass


@pytest.fixture
def client(tokenizer_and_vocab):
    return StubEngineClient(*tokenizer_and_vocab)


def http_to(client) -> httpx.AsyncClient:
    serving = OpenAIServing(client, [MODEL])
    app = build_app(client, serving, ServerMetrics(MODEL, 1, lambda: client.latest_stats),
                    log_stats=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")


@pytest.fixture
def http(client):
    return http_to(client)


def _body(path: str, **fields) -> dict:
    if path == "/v1/completions":
        return {"prompt": "hello", "max_tokens": 2, **fields}
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **fields}


PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", PATHS)
async def test_params_reach_the_engine_and_come_back(http, client, path):
    async with http:
        response = await http.post(path, json=_body(path, kv_transfer_params=ASK))
    assert response.status_code == 200, response.text
    [request] = client.received
    assert request.sampling_params.kv_transfer_params == ASK
    assert response.json()["kv_transfer_params"] == returned_params(ASK)


@pytest.mark.parametrize("path", PATHS)
async def test_without_params_the_response_shows_null(http, client, path):
    async with http:
        response = await http.post(path, json=_body(path))
    assert response.status_code == 200, response.text
    assert client.received[0].sampling_params.kv_transfer_params is None
    body = response.json()
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None


@pytest.mark.parametrize("path", PATHS)
async def test_stream_chunks_carry_no_params(http, client, path):
    async with http:
        response = await http.post(path, json=_body(path, kv_transfer_params=ASK, stream=True))
    assert response.status_code == 200
    assert client.received[0].sampling_params.kv_transfer_params == ASK
    events = [e[len("data: "):] for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and len(events) > 2
    assert all("kv_transfer_params" not in json.loads(e) for e in events[:-1])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fields", [{"kv_transfer_params": [1]},
                                    {"kv_transfer_params": "do_remote_decode"},
                                    {"kv_transfer_params": {"a": 1}, "n": 2}])
async def test_refused_with_a_400(http, client, path, fields):
    async with http:
        response = await http.post(path, json=_body(path, **fields))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kv_transfer_params"
    assert client.received == []


async def test_refused_with_several_prompts(http, client):
    async with http:
        response = await http.post("/v1/completions", json=_body(
            "/v1/completions", prompt=["a", "b"], kv_transfer_params=ASK))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kv_transfer_params"
    assert client.received == []


# A decode request as the proxy sends it: where the prefill instance holds the prompt's block.
DECODE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [0],
          "remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5600,
          "remote_request_id": "cmpl-1-0", "tp_size": 1}


@pytest.fixture
def nixl_client(tokenizer_and_vocab):
    """The stub engine behind an InputProcessor configured with a NixlConnector."""
    return StubEngineClient(*tokenizer_and_vocab, kv_transfer_config=KVTransferConfig(
        "NixlConnector", "kv_both", "E", {"side_channel_port": 7200}))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fields, key", [
    ({"remote_port": "abc"}, "remote_port"), ({"remote_port": 70000}, "remote_port"),
    ({"remote_block_ids": 5}, "remote_block_ids"), ({"remote_block_ids": [-3]}, "remote_block_ids"),
    ({"remote_block_ids": [0] * 10}, "remote_block_ids"), ({"remote_host": None}, "remote_host"),
    ({"remote_request_id": 12}, "remote_request_id"), ({"do_remote_prefill": "yes"},
                                                       "do_remote_prefill")])
async def test_with_a_connector_what_it_cannot_act_on_is_a_400_naming_the_key(
        nixl_client, path, fields, key):
    async with http_to(nixl_client) as http:
        response = await http.post(path, json=_body(path, kv_transfer_params={**DECODE,
                                                                              **fields}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and error["type"] == "BadRequestError"
    assert error["message"].startswith(f"kv_transfer_params.{key} "), error
    assert nixl_client.received == []


@pytest.mark.parametrize("path", PATHS)
async def test_with_a_connector_well_formed_params_pass(nixl_client, path):
    async with http_to(nixl_client) as http:
        for params in (DECODE, ASK, {"do_remote_decode": True}):
            response = await http.post(path, json=_body(path, kv_transfer_params=params))
            assert response.status_code == 200, response.text
    assert [r.sampling_params.kv_transfer_params for r in nixl_client.received] == [
        DECODE, ASK, {"do_remote_decode": True}]
