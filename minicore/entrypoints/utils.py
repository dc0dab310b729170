"""HTTP helpers the API server and the proxy share: JSON and OpenAI error responses, SSE responses
that always close their generator, and cancelling a handler when its client goes away.

Mirrors vllm/entrypoints/utils.py (with_cancellation, listen_for_disconnect). Left out: the CLI
and logging helpers there.
"""

import asyncio

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

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


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
