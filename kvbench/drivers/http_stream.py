"""One streamed ``/v1/completions`` request on a bare asyncio connection: the driver's hot path.

Why not httpx here: a token costs the driver one SSE event, and through httpx's stream (httpcore, its
decoders, ``aiter_lines``) an event cost as much client CPU as the reference server spent computing the
token, so the driver would have been the bottleneck it must never be. This protocol reads the response
as it arrives (``data_received``), un-chunks HTTP/1.1 chunked encoding, splits SSE lines and hands each
``data:`` payload on with the time its bytes arrived, at a small fraction of that cost (the figures:
docs/journal/measurements.md#the-http-drivers-stream-parser).

Scope, on purpose: plain HTTP/1.1 to a loopback or LAN server (no TLS, no proxies, no redirects),
one connection per request (``Connection: close``), as the driver opens one per in-flight request.
Cancelling the awaiting task closes the socket, which is how a client aborts a request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

#: (arrival time of the bytes, parsed SSE data payload) for each ``data:`` line
OnEvent = Callable[[float, Any], None]
_DECODER = json.JSONDecoder()


class StreamError(RuntimeError):
    """The server answered with an HTTP error; ``status`` and the body's text are kept."""

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}")


class _SSEProtocol(asyncio.Protocol):
    def __init__(self, on_event: OnEvent, clock: Callable[[], float], done: asyncio.Future[None],
                 started: asyncio.Event | None):
        self.on_event, self.clock, self.done, self.started = on_event, clock, done, started
        self.buf = b""  # raw bytes not yet parsed
        self.lines = b""  # un-chunked body bytes not yet split into lines
        self.status: int | None = None
        self.chunked = False
        self.chunk_left = -1  # bytes left in the current chunk (+2 for its CRLF); -1 = expecting a size line
        self.error_body = b""
        self.ended = False  # the last chunk has arrived
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.done.done():  # after [DONE] or the last chunk only the framing's tail can follow
            return
        t = self.clock()
        self.buf += data
        if self.status is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buf = self.buf[:end].decode("latin-1"), self.buf[end + 4:]
            lines = head.split("\r\n")
            self.status = int(lines[0].split(" ", 2)[1])
            headers = {k.strip().lower(): v.strip().lower() for k, _, v in (h.partition(":") for h in lines[1:])}
            self.chunked = "chunked" in headers.get("transfer-encoding", "")
            if self.started is not None:
                self.started.set()
        body = self._unchunk() if self.chunked else self._take_all()
        if self.status != 200:
            self.error_body += body
            if self.ended:
                self._finish()
            return
        self.lines += body
        cut = self.lines.rfind(b"\n")
        if cut >= 0:
            # complete lines only: a UTF-8 character never holds a newline byte, so this cut never splits one
            complete, self.lines = self.lines[:cut], self.lines[cut + 1:]
            try:
                for line in complete.decode().split("\n"):
                    if line.startswith("data:"):
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            self._finish()
                            return
                        # cheaper than json.loads on bytes (docs/journal/measurements.md#the-http-drivers-stream-parser)
                        data, end = _DECODER.raw_decode(payload)
                        if end != len(payload):
                            raise ValueError(f"data after the event's JSON: {payload[end:end + 40]!r}")
                        self.on_event(t, data)
            except Exception as e:  # a bad event ends this request, never the driver
                self._finish(e)
                return
        if self.ended:
            self._finish()

    def _take_all(self) -> bytes:
        out, self.buf = self.buf, b""
        return out

    def _unchunk(self) -> bytes:
        """The chunk data in ``buf`` (framing dropped), read by position: one slice per chunk, and
        ``buf`` is cut once, to what a later read must complete."""
        buf, pos, n = self.buf, 0, len(self.buf)
        out = []
        while pos < n:
            if self.chunk_left < 0:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                size_line = buf[pos:end]
                try:
                    size = int(size_line, 16)
                except ValueError:  # a chunk extension (";name=value") follows the size
                    size = int(size_line.split(b";")[0], 16)
                pos = end + 2
                if size == 0:  # the last chunk: what follows is an empty trailer
                    pos, self.ended = n, True
                    break
                self.chunk_left = size + 2  # data bytes, then the chunk's closing CRLF
            left = self.chunk_left
            take = left if left <= n - pos else n - pos  # conditionals, not min/max: this runs per token
            data = left - 2 if left - 2 < take else take
            if data > 0:
                out.append(buf[pos:pos + data])
            pos += take
            left -= take
            self.chunk_left = left if left else -1
        self.buf = buf[pos:]
        return b"".join(out)

    def _finish(self, error: BaseException | None = None) -> None:
        if not self.done.done():
            if error is None and self.status not in (None, 200):
                error = StreamError(self.status, self.error_body)
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.status is None and exc is None:
            exc = ConnectionError("the server closed the connection before answering")
        self._finish(exc)


def request_bytes(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, int, bytes]:
    """(host, port, the request's bytes) for a JSON POST."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"the streaming driver speaks plain http, not {parts.scheme!r} ({url})")
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    head = [f"POST {parts.path.rstrip('/')}{path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    return host, port, ("\r\n".join(head) + "\r\n\r\n").encode() + payload


async def stream_events(url: str, body: dict[str, Any], headers: dict[str, str], on_event: OnEvent,
                        clock: Callable[[], float], started: asyncio.Event | None = None) -> None:
    """POST ``body`` to ``url``/v1/completions and call ``on_event`` per SSE event until ``[DONE]`` or the
    end of the body; ``started`` is set when the response's head arrives (the server took the request).
    Raises :class:`StreamError` for an HTTP error status, OSError if it cannot connect."""
    host, port, raw = request_bytes(url, "/v1/completions", body, headers)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _SSEProtocol(on_event, clock, done, started), host, port)
    try:
        transport.write(raw)
        await done
    finally:
        transport.close()
