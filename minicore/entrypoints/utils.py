"""HTTP helpers the API server and the proxy share: JSON and OpenAI error responses, SSE responses
that always close their generator, cancelling a handler when its client goes away, exiting with
status 0 after uvicorn's graceful shutdown on SIGTERM/SIGINT, and the limits on what one client
may hold or send (HttpLimits: time, header and body bounds; the open-file limit).

Mirrors vllm/entrypoints/utils.py (with_cancellation, listen_for_disconnect), the h11 limits of
vllm/entrypoints/launcher.py (--h11-max-incomplete-event-size, --h11-max-header-count) and
set_ulimit (vllm/utils/system_utils.py). Left out: the CLI and logging helpers there.
"""

import asyncio
import functools
import resource
import signal
from dataclasses import dataclass

import h11
import uvicorn
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from minicore.entrypoints.openai_protocol import OpenAIError, to_json

# The open-file limit the server raises its soft limit to (vLLM's set_ulimit): each connection
# holds a file descriptor, and the usual soft default of 1,024 is a few idle clients away.
TARGET_OPEN_FILES = 65535


def json_response(record, status: int = 200) -> Response:
    return Response(to_json(record), status_code=status, media_type="application/json")


def error_response(e: OpenAIError) -> Response:
    return json_response(e.to_response(), e.status)


class SSEResponse(StreamingResponse):
    """Server-sent events that always close their generator, even when the client left while
    the generator was waiting to hand over a chunk, so what feeds it stops at once (the engine
    request is aborted, the proxy's upstream stream closed), not when the garbage collector
    gets to it."""
    media_type = "text/event-stream"

    def __init__(self, content, *args, on_close=None, **kwargs):
        super().__init__(content, *args, **kwargs)
        self.on_close = on_close  # called once the stream has ended, however it ended

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


async def _until_disconnected(raw_request: Request) -> None:
    # The body has been read, so the next message is the disconnect.
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def with_cancellation(coro, raw_request: Request):
    """Run a handler, cancelling it if the client goes away first (then the engine request is
    aborted, or the proxy's upstream request closed): a non-streamed response has no send to
    fail on, so nothing else would notice."""
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnected(raw_request))
    try:
        await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
    if not handler.done() or handler.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return handler.result()


def _exit_zero(signum, frame) -> None:
    raise SystemExit(0)


def exit_zero_after_shutdown_signals() -> None:
    """uvicorn.Server.serve shuts down gracefully on SIGTERM/SIGINT, then raises the signal again
    under the handler it found, which by default kills the process (-15) or raises
    KeyboardInterrupt: install this before serve() so that a signal ends the process with exit
    status 0 (a signal before serve() takes its handlers over exits 0 at once)."""
    for sig in uvicorn.server.HANDLED_SIGNALS:
        signal.signal(sig, _exit_zero)


# ------------------------------------------------------------------------------------------------
# Limits on what one client may hold or send


@dataclass(frozen=True)
class HttpLimits:
    """What one client may hold or send; the `serve` flags of the same names set them."""
    # A request body past this is refused (413) before it is parsed or tokenized.
    max_request_body_bytes: int = 1 << 20
    # A request head (request line and headers) past this is refused by h11 (vLLM's default).
    h11_max_incomplete_event_size: int = 4 << 20
    # More headers than this are refused (431), vLLM's default.
    h11_max_header_count: int = 256
    # A connection with no request under way is closed after this many seconds (vLLM's 5).
    timeout_keep_alive: float = 5.0
    # A request must arrive whole, head and body, within this many seconds of its first byte.
    timeout_request_read: float = 60.0

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config's keywords for the connection limits."""
        return {"http": functools.partial(BoundedH11Protocol,
                                          timeout_request_read=self.timeout_request_read),
                "timeout_keep_alive": self.timeout_keep_alive,
                "h11_max_incomplete_event_size": self.h11_max_incomplete_event_size}


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the two deadlines it lacks, so that no client holds a
    connection (a file descriptor) without using it: a new connection is closed after
    timeout_keep_alive unless a request starts (uvicorn arms that timer only after a response, so
    a connection that never sent a byte stayed open for ever), and a request, once its first byte
    is in, must be read whole, head and body, within timeout_request_read (a slow sender)."""

    def __init__(self, *args, timeout_request_read: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeout_request_read = timeout_request_read
        self.read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # which stops the keep-alive timer
        reading = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
        if reading and self.read_deadline is None:
            self.read_deadline = self.loop.call_later(self.timeout_request_read,
                                                      self.transport.close)
        elif not reading and self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
        super().connection_lost(exc)


class RequestLimitsMiddleware:
    """Refuses a request with more than max_headers headers (431) or a body over max_body_bytes
    (413), as OpenAI error bodies, before the app parses anything. The body is read here, whole
    (every route reads it whole anyway), and handed on in one message. A refused body is still
    read to its end, dropped as it comes (as nginx's lingering close; the request read deadline
    bounds it): closing a connection with unread data resets it, and the client would lose the
    answer. A client that waits for a go-ahead (`Expect: 100-continue`) is answered at once."""

    def __init__(self, app, max_body_bytes: int, max_headers: int):
        self.app, self.max_body_bytes, self.max_headers = app, max_body_bytes, max_headers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        error = self._head_error(len(scope["headers"]), headers.get(b"content-length", b""))
        if error is not None and headers.get(b"expect", b"").lower() == b"100-continue":
            return await _closing_error_response(error)(scope, receive, send)
        body, size, whole = bytearray(), 0, False
        while not whole:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunk = message.get("body", b"")
            size += len(chunk)
            whole = not message.get("more_body", False)
            if size <= self.max_body_bytes:
                body += chunk
        if error is None and size > self.max_body_bytes:
            error = self._too_large(str(size))
        if error is not None:
            return await error_response(error)(scope, receive, send)
        await self.app(scope, _replay(bytes(body), receive), send)

    def _head_error(self, num_headers: int, content_length: bytes) -> OpenAIError | None:
        """The error for a request its head shows to be over a limit, if any."""
        if num_headers > self.max_headers:
            return OpenAIError(f"the request has {num_headers} headers, more than the server's "
                               f"limit of {self.max_headers} (--h11-max-header-count)", 431)
        if content_length.isdigit() and int(content_length) > self.max_body_bytes:
            return self._too_large(content_length.decode())
        return None

    def _too_large(self, size: str) -> OpenAIError:
        return OpenAIError(f"the request body has {size} bytes, more than the server's limit of "
                           f"{self.max_body_bytes} (--max-request-body-bytes)", 413)


def _closing_error_response(e: OpenAIError) -> Response:
    """An error that closes the connection after it: the request's body is left unread."""
    response = error_response(e)
    response.headers["connection"] = "close"
    return response


def _replay(body: bytes, receive):
    """An ASGI receive that gives body as the whole request, then the client's next messages
    (its disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to TARGET_OPEN_FILES (the hard limit if lower), as
    vLLM's set_ulimit: every client connection holds a file descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = TARGET_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, TARGET_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
