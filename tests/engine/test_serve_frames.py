"""reference_engine.serve writes streamed chunks as bytes around a pre-encoded head, not through pydantic:
the bytes must be exactly what ``CompletionResponse(...).model_dump(exclude_none=True)`` serialised to."""

from __future__ import annotations

import asyncio
import json

import pytest

from reference_engine.outputs import RequestOutput
from reference_engine.sampling_params import TokenLogprobs
from reference_engine.serve import app
from reference_engine.serve.detokenize import load_codec
from reference_engine.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse

PROMPT = [5, 6, 7, 8, 9]
#: non-ASCII and a quote: json.dumps escapes them, and the head must have done the same
REPLY = {"id": "cmpl-\u00e9x", "created": 1234, "model": 'tiny "\u2603"'}


def _outputs(steps: list[int], logprobs: int | None) -> list[RequestOutput]:
    """Cumulative outputs of one request producing ``steps[i]`` tokens at step ``i``, then finished."""
    items, ids, lps = [], [], []
    for s, k in enumerate(steps):
        new = [(37 * (len(ids) + j) + 11) % 500 for j in range(k)]
        lps += [TokenLogprobs(t, -0.125 * (len(ids) + j), tuple((u, -0.5 - u / 1000) for u in range(logprobs or 0)))
                for j, t in enumerate(new)]
        ids = ids + new
        last = s == len(steps) - 1
        items.append(RequestOutput("r", PROMPT, list(ids), last, "length" if last else None, 2 if last else 0, 0, 0,
                                   list(lps) if logprobs is not None else None))
    return items


def _pydantic_events(body: CompletionRequest, items: list[RequestOutput], codec) -> bytes:
    """The stream as it was written before the fast path: a pydantic model per chunk."""
    render = app._Renderer(body, PROMPT, codec)
    out, sent = [], 0
    for item in items:
        new = item.token_ids[sent:]
        if new or item.finished:
            choice = CompletionChoice(**render.choice_fields(new, item, final=item.finished))
            if sent == 0 and body.return_token_ids:
                choice.prompt_token_ids = PROMPT
            chunk = CompletionResponse(**REPLY, choices=[choice]).model_dump(exclude_none=True)
            out.append(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode())
            sent = len(item.token_ids)
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


async def _streamed(body: CompletionRequest, items: list, codec, coalesce: bool = False) -> bytes:
    """The stream of ``items`` all queued before it starts (a stream that fell behind by all of them)."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    chunks = [c async for c in app._sse(queue, app._Renderer(body, PROMPT, codec), REPLY, body,
                                        app._once(lambda: None), coalesce)]
    return b"".join(chunks)


async def _kept_up(body: CompletionRequest, items: list, codec) -> bytes:
    """The stream of ``items`` each queued only after the previous one was written (a stream that keeps up)."""
    queue: asyncio.Queue = asyncio.Queue()
    stream = app._sse(queue, app._Renderer(body, PROMPT, codec), REPLY, body, app._once(lambda: None), True)
    chunks = []
    for item in items:
        queue.put_nowait(item)
        chunks.append(await stream.__anext__())
    chunks += [c async for c in stream]
    return b"".join(chunks)


def _events(stream: bytes) -> list:
    return [json.loads(e.removeprefix(b"data: ")) for e in stream.split(b"\n\n") if e and e != b"data: [DONE]"]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_stream_that_fell_behind_sends_the_queued_tokens_in_one_chunk(tiny_ckpt: str, logprobs) -> None:
    codec = load_codec(tiny_ckpt)
    body = CompletionRequest(prompt=PROMPT, max_tokens=8, stream=True, return_token_ids=True, logprobs=logprobs)
    items = _outputs([1, 3, 0, 2], logprobs)
    per_step, coalesced = (_events(asyncio.run(_streamed(body, items, codec, c))) for c in (False, True))
    assert len(per_step) == 3 and len(coalesced) == 1  # steps 1, 2 and 4 had tokens; one chunk when behind
    assert coalesced[0]["choices"][0]["token_ids"] == items[-1].token_ids
    assert coalesced[0]["choices"][0]["text"] == "".join(e["choices"][0]["text"] for e in per_step)
    assert coalesced[0]["choices"][0]["finish_reason"] == "length"
    if logprobs is not None:
        assert len(coalesced[0]["choices"][0]["logprobs"]["tokens"]) == 6


def test_a_stream_that_keeps_up_sends_a_chunk_per_step(tiny_ckpt: str) -> None:
    body = CompletionRequest(prompt=PROMPT, max_tokens=8, stream=True, return_token_ids=True)
    items = _outputs([1, 3, 2], None)  # every step makes tokens, so every step is written before the next
    kept_up = _events(asyncio.run(asyncio.wait_for(_kept_up(body, items, load_codec(tiny_ckpt)), 30)))
    assert [len(e["choices"][0]["token_ids"]) for e in kept_up] == [1, 3, 2]


def test_a_failure_queued_behind_tokens_comes_after_them(tiny_ckpt: str) -> None:
    from reference_engine.serve.engine_loop import EngineFailure

    body = CompletionRequest(prompt=PROMPT, max_tokens=8, stream=True, return_token_ids=True)
    items = _outputs([1, 3, 0, 2], None)
    events = _events(asyncio.run(_streamed(body, [*items[:2], EngineFailure("engine died")], None, True)))
    assert events[0]["choices"][0]["token_ids"] == items[1].token_ids  # the tokens made before the failure
    assert "engine died" in json.dumps(events[1])


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("with_codec", [False, True])
def test_streamed_chunks_are_the_pydantic_bytes(tiny_ckpt: str, return_token_ids: bool, logprobs: int | None,
                                                with_codec: bool) -> None:
    codec = load_codec(tiny_ckpt) if with_codec else None
    body = CompletionRequest(prompt=PROMPT, max_tokens=8, stream=True, return_token_ids=return_token_ids,
                             logprobs=logprobs)
    items = _outputs([1, 3, 0, 2], logprobs)
    fast = asyncio.run(_streamed(body, items, codec))
    assert fast == _pydantic_events(body, items, codec)
    first = json.loads(fast.split(b"\n\n")[0].removeprefix(b"data: "))
    assert first["model"] == REPLY["model"]
    assert ("prompt_token_ids" in first["choices"][0]) == return_token_ids


async def _serve_stream(chunks: list[bytes], with_server_send: bool) -> tuple[list[dict], list[dict]]:
    """(messages through the app's ``send``, messages to the server's own send) of a stream of ``chunks``."""
    from reference_engine.serve.disconnect import SERVER_SEND, AbortOnDisconnectStream

    async def body():
        for chunk in chunks:
            yield chunk

    through, direct = [], []
    never = asyncio.Event()

    async def receive() -> dict:
        await never.wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        through.append(message)

    async def server_send(message: dict) -> None:
        direct.append(message)

    closed = []
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    if with_server_send:
        scope[SERVER_SEND] = server_send
    await AbortOnDisconnectStream(body(), on_close=lambda: closed.append(1), media_type="text/event-stream")(
        scope, receive, send)
    assert closed == [1]
    return through, direct


def test_a_streams_body_goes_straight_to_the_server_and_its_last_event_ends_it() -> None:
    chunks = [b"data: {}\n\n", b"data: {}\n\n" + app.LAST_EVENT]
    through, direct = asyncio.run(asyncio.wait_for(_serve_stream(chunks, True), 10))
    assert [m["type"] for m in through] == ["http.response.start"]  # the middleware sees the response start
    assert [(m["body"], m["more_body"]) for m in direct] == [(chunks[0], True), (chunks[1], False)]  # no extra write


def test_without_the_servers_send_a_stream_goes_through_the_app_and_ends_with_an_empty_body() -> None:
    through, direct = asyncio.run(asyncio.wait_for(_serve_stream([b"data: {}\n\n"], False), 10))
    assert direct == []
    assert [(m["type"], m.get("body"), m.get("more_body")) for m in through] == [
        ("http.response.start", None, None), ("http.response.body", b"data: {}\n\n", True),
        ("http.response.body", b"", False)]


def test_the_last_piece_of_a_stream_holds_its_finish_usage_and_done(tiny_ckpt: str) -> None:
    body = CompletionRequest(prompt=PROMPT, max_tokens=8, stream=True, stream_options={"include_usage": True})
    items = _outputs([1, 3], None)
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)

    async def pieces() -> list[bytes]:
        return [c async for c in app._sse(queue, app._Renderer(body, PROMPT, load_codec(tiny_ckpt)), REPLY, body,
                                          app._once(lambda: None), False)]

    first, last = asyncio.run(pieces())
    assert not first.endswith(app.LAST_EVENT) and last.endswith(app.LAST_EVENT)
    finish, usage = _events(last)
    assert finish["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == 4
