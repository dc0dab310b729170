"""The OpenAI-compatible HTTP server behind `python -m minicore serve`: FastAPI on uvicorn, uvloop.

Mirrors vllm/entrypoints/openai/api_server.py (the routes, the API-key middleware, the exception
handlers that turn every failure into an OpenAI error body, build_app, run_server; with_cancellation
and the response helpers are in utils.py) and vllm/entrypoints/launcher.py (serve_http: uvicorn on
our own event loop, on a socket bound before the engine starts; on SIGTERM stop accepting, abort
the requests in flight, stop the engine, and exit 0). What a client may hold or send is bounded
(utils.HttpLimits). The endpoints' logic is in serving.py. Left out: the other OpenAI endpoints
(embeddings, audio, responses), CORS and SSL options. Several API servers: multi_api_server.py.
vLLM's development and RL endpoints (/sleep, /pause, /collective_rpc, the weight update, ...) are
dev_endpoints.py's, mounted with VLLM_SERVER_DEV_MODE=1.
"""

import asyncio
import logging
import os
import secrets
import socket
from contextlib import asynccontextmanager, suppress

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import minicore
from minicore.config import EngineConfig
from minicore.engine.async_llm import AsyncLLM
from minicore.engine.core_client import EngineDeadError
from minicore.engine.output_processor import RequestFailedError
from minicore.entrypoints.dev_endpoints import attach_dev_routes, dev_mode
from minicore.entrypoints.elastic_ep import attach_elastic_ep_routes
from minicore.entrypoints.metrics import ServerMetrics
from minicore.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    make_error,
    validation_error,
)
from minicore.entrypoints.serving import OpenAIServing
from minicore.entrypoints.serving_tokenization import detokenize, tokenize
from minicore.entrypoints.stats_logger import StatsLogger
from minicore.entrypoints.utils import (
    HttpLimits,
    RequestLimitsMiddleware,
    SSEResponse,
    error_response,
    exit_zero_after_shutdown_signals,
    json_response,
    raise_open_file_limit,
    with_cancellation,
)
from minicore.logger import uvicorn_log_config
from minicore.tracing.otel import get_trace_headers
from minicore.utils import listen_on

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0
# uvicorn's backstop: connections still open this long after SIGTERM are cancelled. Aborted
# requests end their streams at once, so it only matters if something hangs.
GRACEFUL_SHUTDOWN_S = 3
# The default request body limit. A prompt's text takes about 4 bytes a token in JSON, escaped
# CJK text about 12, token ids at most 8: a request holding a whole context's worth of prompt
# fits several times over. The floor leaves room for batches of short prompts, and is about a
# second of tokenizing at most.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20


class AuthenticationMiddleware:
    """With --api-key, every /v1 route and the paths in `also` need `Authorization: Bearer <key>`
    (vLLM's rule for /v1: /health, /metrics, /version and the tokenizer routes stay open). Plain
    ASGI, so streams are untouched."""

    def __init__(self, app, api_key: str, also: frozenset[str] = frozenset()):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.also = also

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and (scope["path"].startswith("/v1") or scope["path"] in self.also)):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(OpenAIError("Incorrect API key provided.", 401))
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(client: AsyncLLM, serving: OpenAIServing, metrics: ServerMetrics,
              api_key: str | None = None, log_stats: bool = True,
              enable_server_load_tracking: bool = False,
              limits: HttpLimits | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stats_task = asyncio.ensure_future(_log_stats(metrics, client)) if log_stats else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            if not serving.shutting_down:
                serving.begin_shutdown()
            await client.shutdown()

    # FastAPI's OpenTelemetry hooks look up the tracer provider on every request: off.
    app = FastAPI(title="minicore", version=minicore.__version__, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    # The dev routes (VLLM_SERVER_DEV_MODE=1) need the key too: they can stop generation,
    # free the engines' memory and load weights (vLLM leaves them open).
    dev_paths = attach_dev_routes(app, client, metrics) if dev_mode() else frozenset()
    dev_paths |= attach_elastic_ep_routes(app, client, metrics)
    if api_key:
        app.add_middleware(AuthenticationMiddleware, api_key=api_key, also=dev_paths)
    limits = limits or HttpLimits()
    # Added last, so it runs first: an oversized request costs nothing more.
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=limits.max_request_body_bytes,
                       max_headers=limits.h11_max_header_count)
    _add_exception_handlers(app)
    # vLLM's /load: generation requests in flight, counted only with --enable-server-load-tracking.
    app.state.enable_server_load_tracking = enable_server_load_tracking
    app.state.server_load_metrics = 0
    _add_routes(app, client, serving, metrics)
    _add_admin_routes(app, client)
    return app


def _add_exception_handlers(app: FastAPI) -> None:
    """Every failure becomes an OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_, e: RequestValidationError):
        return error_response(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return error_response(OpenAIError(str(e.detail), e.status_code))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):
        return error_response(OpenAIError(str(e), 503))

    @app.exception_handler(RequestFailedError)
    async def request_failed(_, e: RequestFailedError):
        return error_response(OpenAIError(str(e), 500))

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        logger.exception("unhandled error")
        return json_response(make_error(f"internal error: {e!r}", 500), 500)


def _add_routes(app: FastAPI, client: AsyncLLM, serving: OpenAIServing,
                metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health():
        if client.is_healthy:
            return Response(status_code=200)
        return error_response(OpenAIError("an engine core process is dead", 503))

    @app.get("/version")
    async def version():
        return {"version": minicore.__version__}

    @app.get("/metrics")
    async def show_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def show_models():
        return json_response(serving.show_models())

    @app.post("/tokenize")
    async def tokenize_route(request: TokenizeRequest):
        return json_response(await serving.on_tokenizer_thread(tokenize, serving, request))

    @app.post("/detokenize")
    async def detokenize_route(request: DetokenizeRequest):
        return json_response(await serving.on_tokenizer_thread(detokenize, serving, request))

    async def run(handler, raw_request: Request, stream: bool):
        # A stream returns at once (SSEResponse notices a disconnect); a whole response needs
        # watching while it is generated.
        done = _LoadTracker(raw_request.app.state)
        try:
            result = await (handler if stream else with_cancellation(handler, raw_request))
        except BaseException:
            done()
            raise
        if stream and not isinstance(result, Response):
            return SSEResponse(result, on_close=done)  # in flight until the stream ends
        done()
        return result if isinstance(result, Response) else json_response(result)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await run(serving.create_completion(request, rank_header(raw_request),
                                                   get_trace_headers(raw_request.headers)),
                         raw_request, request.stream)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await run(serving.create_chat_completion(request, rank_header(raw_request),
                                                        get_trace_headers(raw_request.headers)),
                         raw_request, request.stream)


class _LoadTracker:
    """One generation request in /load's count (when tracking is on); calling it takes the
    request off, once, however its response ended."""

    def __init__(self, state):
        self.state, self.pending = state, state.enable_server_load_tracking
        if self.pending:
            state.server_load_metrics += 1

    def __call__(self) -> None:
        if self.pending:
            self.pending = False
            self.state.server_load_metrics -= 1


def _add_admin_routes(app: FastAPI, client: AsyncLLM) -> None:
    """vLLM's operational endpoints beside the API: /ping (SageMaker's health check), /load and
    /reset_prefix_cache (vLLM mounts it in dev mode only; always here: aiperf's --reset-kv-cache
    calls it between runs, and it changes no output)."""

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        if client.is_healthy:
            return Response(status_code=200)
        return error_response(OpenAIError("an engine core process is dead", 503))

    @app.get("/load")
    async def load(raw_request: Request):
        return json_response({"server_load": raw_request.app.state.server_load_metrics})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False,
                                 reset_external: bool = False):
        # Every engine's cache; vLLM's answer: success is False while some block is in use, and
        # reset_running_requests preempts the running requests first (recomputed later).
        # reset_external (a connector's own cache): minicore's connectors keep none.
        num_engines = client.num_engines
        results = [await client.call_utility("reset_prefix_cache", reset_running_requests,
                                             engine_index=i) for i in range(num_engines)]
        logger.info("reset the prefix cache of %d engine(s) (running requests too: %s): %s",
                    num_engines, reset_running_requests, results)
        return json_response({"success": all(results)})


def rank_header(raw_request: Request) -> str | None:
    """vLLM's header for running a request on a given DP engine."""
    return raw_request.headers.get("X-data-parallel-rank")


async def _log_stats(metrics: ServerMetrics, client: AsyncLLM) -> None:
    stats_logger = StatsLogger(metrics, lambda: client.latest_stats)
    while True:
        await asyncio.sleep(STATS_LOG_INTERVAL_S)
        stats_logger.log()


class ApiServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM/SIGINT also aborts the requests in flight at once, so
    that their streams end and shutdown does not wait for generation to finish."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing,
                 loop: asyncio.AbstractEventLoop):
        super().__init__(config)
        self.serving, self.loop = serving, loop

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # uvicorn says where it listens only on sockets it bound itself
            self._log_started_message(sockets)

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            # Ctrl+C reaches the engines too (the terminal signals the process group).
            self.serving.client.engine_core.expect_engine_exit()
            self.loop.call_soon_threadsafe(self.serving.begin_shutdown)


async def run_server(config: EngineConfig, args) -> None:
    """Bind the HTTP port, start the engine, then serve HTTP until SIGTERM/SIGINT. args: the
    `serve` command's namespace (host, port, api_key, served_model_name, the HTTP limits,
    logging switches)."""
    raise_open_file_limit()
    # The port first, as vLLM's setup_server: one in use is a one-line error at once, not after
    # the engine has loaded the model (and no engine process is started for nothing).
    try:
        sock = listen_on(args.host, args.port, "the API server", "--port")
    except RuntimeError as e:
        raise SystemExit(f"minicore: {e}") from None
    # An engine forked from here must not hold the port: the server could not restart on it
    # while an orphaned engine lives on.
    os.register_at_fork(after_in_child=sock.close)
    with sock:
        await serve_http(config, args, sock, await _start_engine(config))


async def serve_http(config: EngineConfig, args, sock: socket.socket, client: AsyncLLM) -> None:
    """Serve HTTP on sock until SIGTERM/SIGINT; the engine client is shut down at the end (an
    API server of several: minicore/entrypoints/multi_api_server.py)."""
    try:
        model_names = args.served_model_name or [client.model_name]
        so_config = config.structured_outputs_config
        metrics = ServerMetrics(model_names[0], client.num_engines, lambda: client.latest_stats,
                                prefix=args.metrics_prefix, config=config,
                                num_blocks=client.num_blocks)
        client.output_processor.on_new_tokens = metrics.on_new_tokens
        client.output_processor.on_request_finished = metrics.on_request_finished
        client.output_processor.on_iteration_end = metrics.on_iteration_end
        client.on_sleep_state = metrics.set_sleep_levels
        serving = OpenAIServing(client, model_names, args.enable_prompt_tokens_details,
                                args.trust_request_chat_template,
                                args.return_tokens_as_token_ids,
                                enable_auto_tools=args.enable_auto_tool_choice,
                                tool_parser=args.tool_call_parser,
                                reasoning_parser=so_config.reasoning_parser or None)
        limits = http_limits(args, serving.max_model_len)
        app = build_app(client, serving, metrics, args.api_key, not args.disable_log_stats,
                        args.enable_server_load_tracking, limits)
        server = ApiServer(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
            log_config=uvicorn_log_config(args.uvicorn_log_level),
            access_log=not args.disable_uvicorn_access_log,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **limits.uvicorn_kwargs()),
            serving, asyncio.get_running_loop())
        logger.info("serving %s on http://%s:%d", ", ".join(model_names), args.host, args.port)
        logger.info("HTTP limits: %s", limits)
        await server.serve(sockets=[sock])
    finally:
        # The lifespan has normally done this already; not when startup failed or on a forced exit.
        with suppress(Exception):
            await client.shutdown()


async def _start_engine(config: EngineConfig) -> AsyncLLM:
    """The engine, started; SIGTERM/SIGINT meanwhile exits 0 at once."""
    loop = asyncio.get_running_loop()
    # Until uvicorn installs its handlers, a signal cancels the (long) engine start, which then
    # stops the engine process instead of leaving it behind.
    main = asyncio.current_task()
    for sig in uvicorn.server.HANDLED_SIGNALS:
        loop.add_signal_handler(sig, main.cancel)
    try:
        return await AsyncLLM.from_engine_config(config)
    except (RuntimeError, TimeoutError) as e:  # the engine died or hung while starting
        raise SystemExit(f"minicore: the engine did not start: {e}") from None
    except asyncio.CancelledError:
        # The engines started so far are stopped (make_async_mp_client); a thread may still be
        # converting the model or loading the tokenizer, which nothing interrupts: exit now
        # rather than wait for it, with status 0 as after serving.
        logger.info("stopped before the server started")
        logging.shutdown()
        os._exit(0)
    finally:
        for sig in uvicorn.server.HANDLED_SIGNALS:
            loop.remove_signal_handler(sig)
        exit_zero_after_shutdown_signals()


def http_limits(args, max_model_len: int) -> HttpLimits:
    """The serve flags' HTTP limits; without --max-request-body-bytes, BODY_BYTES_PER_TOKEN
    bytes a token of the context, at least MIN_BODY_BYTES."""
    body = args.max_request_body_bytes or max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)
    return HttpLimits(body, args.h11_max_incomplete_event_size, args.h11_max_header_count,
                      args.timeout_keep_alive, args.timeout_request_read)
