"""Noticing that a client went away, streaming or not, so its request is aborted and its blocks freed.

Starlette notices a disconnect only on the next ``send`` when the server speaks ASGI >= 2.4, so a
request that is still waiting for its first token would hold its blocks until it produced one. Both
helpers here listen for ``http.disconnect`` themselves, and both always run ``on_close`` (abort) unless
the request finished normally.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must already have been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


#: the scope key under which the outermost middleware leaves the server's own ``send`` for this request
SERVER_SEND = "reference_engine.server_send"
#: the server-sent event that ends a stream: a chunk that ends with it is the stream's last
LAST_EVENT = b"data: [DONE]\n\n"


class AbortOnDisconnectStream(StreamingResponse):
    """A streaming response that stops as soon as the client disconnects and then calls ``on_close``
    (which the body iterator's own ``finally`` may not get to run promptly after an ``OSError``).

    Each chunk is a send per token of every request, so the body takes the short way: the response's
    start goes through the middleware stack (whose layers watch for it: the error handlers, to know a
    response began; the body-size guard, to know it may no longer answer 413), its body chunks straight to
    the server's ``send`` left in the scope under :data:`SERVER_SEND` (the layers between pass body
    messages on untouched), and a chunk that ends in :data:`LAST_EVENT` ends the body in the same write
    instead of one more. Without the key, everything goes through ``send``."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.on_close = on_close
        self._body_send: Send | None = None

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._body_send or send
        async for chunk in self.body_iterator:
            last = chunk.endswith(LAST_EVENT)
            await body_send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                return
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._body_send = scope.get(SERVER_SEND)
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # ASGI 2.4: a send to a closed connection
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                async def listen() -> None:
                    await wait_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(listen)
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def race_disconnect(request: Request, work: Awaitable[Any], on_disconnect: Callable[[], None]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it, call ``on_disconnect`` and raise
    :class:`ClientGone`. If this coroutine is cancelled (server shutdown), ``on_disconnect`` runs too."""
    job = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        on_disconnect()
        raise
    finally:
        for task in (job, watch):
            if not task.done():
                task.cancel()
    if job in done:
        return job.result()
    on_disconnect()
    raise ClientGone()
