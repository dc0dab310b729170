"""`python -m minicore proxy` against fake prefill and decode instances (small uvicorn servers in
this process, on free ports): what each instance is asked (the prefill's max_tokens=1 and
do_remote_decode; the decode's original request with the prefill's kv_transfer_params, and never
the client's own kv_transfer_params, whatever the prefill returned), streams
passed through, round-robin over two prefill and two decode instances, an instance's error passed
through, an unreachable instance as a 503 OpenAI error, a client that leaves closing the decode
instance's stream or prefill request (the command line: test_proxy_cli.py)."""

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from server_helpers import free_port

from minicore.entrypoints.proxy import PREFILL_KV_TRANSFER_PARAMS, Proxy, build_proxy_app

pytestmark = pytest.mark.asyncio(loop_scope="session")

ERROR_BODY = {"error": {"message": "bad prompt", "type": "BadRequestError", "param": "prompt",
                        "code": 400}}


class FakeInstance:
    """A prefill or decode instance: records each request's body; a prefill answers with
    kv_transfer_params naming itself, a decode with three text chunks (streamed or whole)."""

    def __init__(self, name: str):
        self.name = name
        self.received: list[tuple[str, dict]] = []
        self.fail: tuple[int, str] | None = None  # (status, "json" or "text")
        # A prefill without a KV connector answers kv_transfer_params null.
        self.returns_params = True
        # A prefill waits for its client to leave; a decode stream sends one chunk, then waits
        # until it is closed. Either then sets closed.
        self.hang = False
        self.closed = asyncio.Event()
        self.app = FastAPI()
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.post(path)(self.handle)
        self.app.get("/v1/models")(self.models)

    def kv_params(self) -> dict:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.name, "remote_block_ids": [3, 4],
                "remote_host": "127.0.0.1", "remote_port": 5600}

    async def models(self):
        return {"object": "list", "data": [{"id": self.name}]}

    async def handle(self, request: Request):
        body = await request.json()
        self.received.append((request.url.path, body))
        if self.fail is not None:
            status, kind = self.fail
            if kind == "json":
                return JSONResponse(ERROR_BODY, status)
            return PlainTextResponse("boom", status)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            while self.hang and not await request.is_disconnected():
                await asyncio.sleep(0.05)
            if self.hang:
                self.closed.set()
            return {"choices": [{"text": "p"}],
                    "kv_transfer_params": self.kv_params() if self.returns_params else None}
        if body.get("stream"):
            return StreamingResponse(self._chunks(), media_type="text/event-stream")
        return {"choices": [{"text": f"{self.name}: a b c"}], "kv_transfer_params": None}

    async def _chunks(self):
        try:
            for word in ("a", "b", "c"):
                yield f"data: {json.dumps({'text': word, 'by': self.name})}\n\n"
                while self.hang:
                    await asyncio.sleep(0.05)
            yield "data: [DONE]\n\n"
        finally:
            self.closed.set()


@asynccontextmanager
async def serving(app):
    """app on a free port of 127.0.0.1 for the duration; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def deployment():
    """Two prefill and two decode instances behind a proxy: (proxy URL, prefills, decodes)."""
    prefills = [FakeInstance("p0"), FakeInstance("p1")]
    decodes = [FakeInstance("d0"), FakeInstance("d1")]
    async with serving(prefills[0].app) as p0, serving(prefills[1].app) as p1, \
            serving(decodes[0].app) as d0, serving(decodes[1].app) as d1, \
            serving(build_proxy_app(Proxy([p0, p1 + "/"], [d0, d1]))) as url:
        yield url, prefills, decodes


@pytest.fixture
def proxy(deployment):
    """The deployment with every instance reset."""
    url, prefills, decodes = deployment
    for instance in prefills + decodes:
        instance.received.clear()
        instance.fail, instance.hang, instance.returns_params = None, False, True
        instance.closed.clear()
    return deployment


def _only(instances) -> tuple[FakeInstance, str, dict]:
    hits = [(i, path, body) for i in instances for path, body in i.received]
    assert len(hits) == 1, hits
    return hits[0]


async def test_completion_goes_to_prefill_with_one_token_then_to_decode(proxy):
    url, prefills, decodes = proxy
    request = {"prompt": "hello", "max_tokens": 7, "min_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(url + "/v1/completions", json=request)
    assert response.status_code == 200
    prefill, path, body = _only(prefills)
    assert path == "/v1/completions"
    assert body == {"prompt": "hello", "max_tokens": 1, "temperature": 0, "stream": False,
                    "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    decode, path, body = _only(decodes)
    assert path == "/v1/completions"
    assert body == dict(request, kv_transfer_params=prefill.kv_params())
    assert response.json() == {"choices": [{"text": f"{decode.name}: a b c"}],
                               "kv_transfer_params": None}


# What a client might send to make the decode instance read (or connect) wherever it says.
CLIENT_PARAMS = {"do_remote_prefill": True, "do_remote_decode": True, "remote_block_ids": [0, 1],
                 "remote_engine_id": "elsewhere", "remote_host": "10.0.0.1", "remote_port": 22,
                 "remote_request_id": "x"}


@pytest.mark.parametrize("prefill_returns_params", [True, False], ids=["params", "null"])
async def test_a_clients_own_kv_transfer_params_reach_neither_instance(proxy,
                                                                       prefill_returns_params):
    url, prefills, decodes = proxy
    for instance in prefills:
        instance.returns_params = prefill_returns_params
    request = {"prompt": "hello", "max_tokens": 3, "kv_transfer_params": CLIENT_PARAMS}
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(url + "/v1/completions", json=request)
    assert response.status_code == 200
    prefill, _, prefill_body = _only(prefills)
    _, _, body = _only(decodes)
    expected = {"prompt": "hello", "max_tokens": 3}
    if prefill_returns_params:
        expected["kv_transfer_params"] = prefill.kv_params()
    assert body == expected
    assert prefill_body["kv_transfer_params"] == {"do_remote_decode": True}


async def test_chat_stream_passes_the_decode_chunks_through(proxy):
    url, prefills, decodes = proxy
    request = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
               "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(url + "/v1/chat/completions", json=request)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    prefill, path, body = _only(prefills)
    assert path == "/v1/chat/completions"
    assert body["max_tokens"] == body["max_completion_tokens"] == 1
    assert body["stream"] is False and "stream_options" not in body
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    decode, _, body = _only(decodes)
    assert body == dict(request, kv_transfer_params=prefill.kv_params())
    events = [e[len("data: "):] for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert [json.loads(e) for e in events[:-1]] == [{"text": w, "by": decode.name}
                                                    for w in "abc"]


async def test_round_robin_over_two_prefill_and_two_decode_instances(proxy):
    url, prefills, decodes = proxy
    async with httpx.AsyncClient(timeout=10) as http:
        for i in range(4):
            response = await http.post(url + "/v1/completions", json={"prompt": f"q{i}"})
            assert response.status_code == 200
    # Alternating, from wherever earlier tests left each round-robin.
    for instances in (prefills, decodes):
        assert sorted([body["prompt"] for _, body in i.received] for i in instances) == [
            ["q0", "q2"], ["q1", "q3"]]
    # Each decode request carries the params of the prefill instance that ran it.
    ran_on = {body["prompt"]: p.name for p in prefills for _, body in p.received}
    for decode in decodes:
        for _, body in decode.received:
            assert body["kv_transfer_params"]["remote_engine_id"] == ran_on[body["prompt"]]


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_an_instance_error_is_passed_through(proxy, role):
    url, prefills, decodes = proxy
    for instance in prefills if role == "prefill" else decodes:
        instance.fail = (400, "json")
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
    assert response.status_code == 400
    assert response.json() == ERROR_BODY
    if role == "prefill":
        assert not any(d.received for d in decodes)


async def test_a_non_json_error_becomes_an_openai_error_body(proxy):
    url, _, decodes = proxy
    for instance in decodes:
        instance.fail = (500, "text")
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(url + "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "boom" in error["message"]


async def test_an_unreachable_instance_is_a_503_openai_error():
    closed = f"http://127.0.0.1:{free_port()}"
    async with serving(build_proxy_app(Proxy([closed], [closed]))) as url, \
            httpx.AsyncClient(timeout=10) as http:
        for path in ("/v1/completions", "/v1/models"):
            response = await http.post(url + path, json={"prompt": "x"}) \
                if path != "/v1/models" else await http.get(url + path)
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["type"] == "ServiceUnavailableError" and closed in error["message"]
        assert (await http.get(url + "/health")).status_code == 200


async def test_a_client_that_leaves_closes_the_decode_stream(proxy):
    url, _, decodes = proxy
    for instance in decodes:
        instance.hang = True
    async with httpx.AsyncClient(timeout=10) as http, asyncio.timeout(10):
        async with http.stream("POST", url + "/v1/completions",
                               json={"prompt": "x", "stream": True}) as response:
            async for chunk in response.aiter_bytes():
                assert b'"a"' in chunk
                break
        decode, _, _ = _only(decodes)
        await decode.closed.wait()


async def test_a_client_that_leaves_closes_the_prefill_request(proxy):
    url, prefills, decodes = proxy
    for instance in prefills:
        instance.hang = True
    async with httpx.AsyncClient(timeout=0.5) as http, asyncio.timeout(10):
        with pytest.raises(httpx.ReadTimeout):
            await http.post(url + "/v1/completions", json={"prompt": "x"})
        prefill, _, _ = _only(prefills)
        await prefill.closed.wait()
    assert not any(d.received for d in decodes)


async def test_bad_bodies_health_and_models(proxy):
    url, prefills, decodes = proxy
    async with httpx.AsyncClient(timeout=10) as http:
        for content in (b"{not json", b"[1, 2]"):
            response = await http.post(url + "/v1/completions", content=content)
            assert response.status_code == 400
            assert response.json()["error"]["type"] == "BadRequestError"
        health = await http.get(url + "/health")
        assert health.json() == {"status": "ok", "prefill_instances": 2, "decode_instances": 2}
        models = await http.get(url + "/v1/models")
    assert models.json()["data"] == [{"id": "d0"}]
    assert not any(i.received for i in prefills + decodes)
