"""HTTP helpers the API server and the proxy share: JSON and OpenAI error responses, SSE responses
that always close their generator, cancelling a handler when its client goes away, and exiting
with status 0 after uvicorn's graceful shutdown on SIGTERM/SIGINT.

Mirrors vllm/entrypoints/utils.py (with_cancellation, listen_for_disconnect). Left out: the CLI
and logging helpers there.
"""

import asyncio
import signal

import uvicorn
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from minicore.entrypoints.openai_protocol import OpenAIError, to_json


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
