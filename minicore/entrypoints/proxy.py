"""`python -m minicore proxy`: one OpenAI endpoint in front of prefill and decode instances.

Mirrors vLLM's toy proxy for disaggregated prefill (tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py; examples/online_serving/disaggregated_serving/ has its relatives). For
/v1/completions and /v1/chat/completions, streamed or not: the request goes to a prefill instance
with max_tokens=1 (and max_completion_tokens=1 if given), stream=False, no min_tokens or
stream_options, and kv_transfer_params={"do_remote_decode": true}; the kv_transfer_params of
its answer (where the KV blocks are and how to read them) go with the client's original request to
a decode instance, whose answer (a whole body or the SSE stream, as it comes) is the client's.
Prefill and decode instances are each taken round-robin. A client's own kv_transfer_params reach
neither instance: they would tell the decode instance to read blocks from wherever the client
says (the toy forwards them when the prefill instance returns none).

Beyond the toy: an instance's HTTP error reaches the client with its status and body (wrapped in
an OpenAI error body if it was not JSON); an instance that cannot be reached is a 503, one whose
answer breaks off or is not JSON a 502 (an error event, for a stream already under way); a client
that goes away closes the upstream request, so the instance aborts it; SIGTERM/SIGINT end the
proxy cleanly with exit status 0; a connection that sends nothing is closed after the server's
deadlines (HttpLimits). /health answers while the proxy runs; /v1/models is the first
decode instance's. Left out: the toy's OPENAI_API_KEY (the client's Authorization header is
forwarded instead), load-aware routing, retries on another instance.
"""

import argparse
import itertools
import json
import logging
import uuid
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from minicore.entrypoints.openai_protocol import SSE_DONE, OpenAIError, make_error, sse
from minicore.entrypoints.utils import (
    HttpLimits,
    SSEResponse,
    error_response,
    exit_zero_after_shutdown_signals,
    json_response,
    with_cancellation,
)
from minicore.logger import configure_logging, uvicorn_log_config

logger = logging.getLogger(__name__)

# What the proxy asks a prefill instance for: run the prompt, keep its KV blocks for a remote
# decode, and say where they are (vLLM's toy adds the remote_* keys as null, which say nothing).
PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True}
# A generation has no time limit (as in the toy, which waits forever); a host that never answers
# a connect should not hold the request that long.
CONNECT_TIMEOUT_S = 10.0
# uvicorn's backstop after SIGTERM: streams still open this long are cut.
GRACEFUL_SHUTDOWN_S = 3


class UpstreamError(Exception):
    """What the client gets instead of an answer: an instance's error, passed through."""

    def __init__(self, response: Response):
        super().__init__(response.status_code)
        self.response = response


def prefill_body(body: dict) -> dict:
    """The client's request as a prefill instance gets it: one token, whole, KV kept (the
    client's own kv_transfer_params replaced by ours)."""
    prefill = dict(body, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS), stream=False,
                   max_tokens=1)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    # min_tokens above max_tokens=1 would be refused; usage options need a stream.
    for name in ("min_tokens", "stream_options"):
        prefill.pop(name, None)
    return prefill


def check_url(url: str) -> str:
    """An instance's base URL (http://host:port), without a trailing slash; ValueError if it has
    no http(s) scheme."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"an instance URL starts with http:// or https://, got {url!r}")
    return url.rstrip("/")


class Proxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str]):
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        self.prefill_urls = [check_url(u) for u in prefill_urls]
        self.decode_urls = [check_url(u) for u in decode_urls]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.http: httpx.AsyncClient | None = None

    def open(self) -> None:
        # No pool limit: every client request holds an upstream connection while it runs.
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def close(self) -> None:
        await self.http.aclose()

    async def _send(self, role: str, method: str, url: str, headers: dict,
                    body: dict | None = None) -> httpx.Response:
        """The instance's response, its body still to be read (the caller closes it); an
        UpstreamError for an HTTP error, an OpenAIError if the instance cannot be reached."""
        request = self.http.build_request(method, url, json=body, headers=headers)
        try:
            response = await self.http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise OpenAIError(f"the {role} instance {url} cannot be reached: {e!r}", 503) from None
        except httpx.TransportError as e:
            raise OpenAIError(f"the {role} instance {url} failed: {e!r}", 502) from None
        if response.status_code < 400:
            return response
        content = await self._read(role, url, response)
        if not response.headers.get("content-type", "").startswith("application/json"):
            text = content.decode(errors="replace") or response.reason_phrase
            raise UpstreamError(json_response(make_error(
                f"the {role} instance {url} answered {response.status_code}: {text}",
                response.status_code), response.status_code))
        raise UpstreamError(Response(content, response.status_code,
                                     media_type="application/json"))

    @staticmethod
    async def _read(role: str, url: str, response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        except httpx.TransportError as e:
            raise OpenAIError(f"the {role} instance {url} broke off its answer: {e!r}",
                              502) from None
        finally:
            await response.aclose()

    async def _prefill_params(self, endpoint: str, body: dict, headers: dict) -> dict | None:
        """Run the prompt on the next prefill instance; the kv_transfer_params it answers."""
        url = next(self._prefill) + endpoint
        response = await self._send("prefill", "POST", url, headers, prefill_body(body))
        content = await self._read("prefill", url, response)
        try:
            answer = json.loads(content)
        except ValueError:
            raise OpenAIError(f"the prefill instance {url} answered with no JSON body",
                              502) from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            # As the toy: the decode instance then computes the prompt itself.
            logger.warning("the prefill instance %s returned no kv_transfer_params (has it a "
                           "KV connector?): the decode instance will run the prefill", url)
            return None
        return params

    async def forward(self, endpoint: str, body: dict, headers: dict):
        """The client's answer: prefill, then the decode instance's response (whole, or an
        SSE stream for stream=true)."""
        params = await self._prefill_params(endpoint, body, headers)
        # Only what the prefill instance returned, never the client's own.
        decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params is not None:
            decode["kv_transfer_params"] = params
        url = next(self._decode) + endpoint
        logger.debug("%s: decode on %s with %s", endpoint, url, params)
        response = await self._send("decode", "POST", url, headers, decode)
        media_type = response.headers.get("content-type")
        if not body.get("stream"):
            content = await self._read("decode", url, response)
            return Response(content, response.status_code, media_type=media_type)
        return SSEResponse(self._relay(url, response), response.status_code,
                           media_type=media_type)

    @staticmethod
    async def _relay(url: str, response: httpx.Response):
        """The decode instance's stream, chunk by chunk; closing it closes the upstream
        request, which the instance sees as a disconnect and aborts."""
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        except httpx.TransportError as e:
            yield sse(make_error(f"the decode instance {url} broke off its stream: {e!r}", 502))
            yield SSE_DONE
        finally:
            await response.aclose()

    async def models(self, headers: dict) -> Response:
        url = self.decode_urls[0] + "/v1/models"
        response = await self._send("decode", "GET", url, headers)
        content = await self._read("decode", url, response)
        return Response(content, response.status_code, media_type="application/json")


def _upstream_headers(raw_request: Request) -> dict:
    headers = {"X-Request-Id": str(uuid.uuid4())}
    if (auth := raw_request.headers.get("authorization")) is not None:
        headers["Authorization"] = auth
    return headers


def build_proxy_app(proxy: Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        proxy.open()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="minicore proxy", lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})

    @app.exception_handler(OpenAIError)
    async def openai_error(_, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(UpstreamError)
    async def upstream_error(_, e: UpstreamError):
        return e.response

    @app.get("/health")
    async def health():
        return {"status": "ok", "prefill_instances": len(proxy.prefill_urls),
                "decode_instances": len(proxy.decode_urls)}

    @app.get("/v1/models")
    async def models(raw_request: Request):
        return await proxy.models(_upstream_headers(raw_request))

    async def handle(endpoint: str, raw_request: Request):
        # The body is read before with_cancellation starts listening for the disconnect.
        try:
            body = await raw_request.json()
        except ValueError as e:
            raise OpenAIError(f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        return await with_cancellation(
            proxy.forward(endpoint, body, _upstream_headers(raw_request)), raw_request)

    @app.post("/v1/completions")
    async def completions(raw_request: Request):
        return await handle("/v1/completions", raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request):
        return await handle("/v1/chat/completions", raw_request)

    return app


def proxy_main(args: argparse.Namespace) -> None:
    import uvloop

    configure_logging("Proxy")
    proxy = Proxy(args.prefill, args.decode)
    # The server's connection deadlines: silent sockets are closed, not held until the proxy
    # runs out of file descriptors and locks every client out.
    server = uvicorn.Server(uvicorn.Config(
        build_proxy_app(proxy), host=args.host, port=args.port,
        log_level=args.uvicorn_log_level, log_config=uvicorn_log_config(args.uvicorn_log_level),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **HttpLimits().uvicorn_kwargs()))
    exit_zero_after_shutdown_signals()
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port,
                ", ".join(proxy.prefill_urls), ", ".join(proxy.decode_urls))
    uvloop.run(server.serve())
