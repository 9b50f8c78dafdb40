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


class AbortOnDisconnectStream(StreamingResponse):
    """A streaming response that stops as soon as the client disconnects and then calls ``on_close``
    (which the body iterator's own ``finally`` may not get to run promptly after an ``OSError``)."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
