"""What kvbench's HTTP client and driver keep of a response, against servers whose every answer is known: the
stub server (``kvbench.testing.stub_server``) and, for error events, a few bytes served from this process.

* an abort placed after some tokens closes the stream mid-way and records what the client had by then;
* the text and ids a user reads are kept where the recorder asks for them, streamed or not;
* after the last response the /metrics poller goes on until the server holds nothing;
* a stream that ends in an error event keeps every token before it, and nothing after it changes that.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbench.core.requests import WorkloadRequest
from kvbench.core.trace import TraceRecorder
from kvbench.drivers.http_client import CompletionClient
from kvbench.drivers.http_driver import ClientRequest, run_serve
from kvbench.launch.process import ServerProcess, free_port
from kvbench.testing.stub_server import stub_token

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A stub with a 5 ms gap before each token: a 200-token stream lasts a second."""
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "kvbench.testing.stub_server", "--port", str(port),
                            "--token-delay", "0.005"], tmp_path_factory.mktemp("stub") / "stub.log")
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy(url, timeout=60)
        yield url
    finally:
        server.stop()


def serve(url: str, requests: list, keep_outputs: bool = False, poll_interval: float | None = None):
    recorder = TraceRecorder("stub", "reads", keep_outputs=keep_outputs)
    run_serve(CompletionClient(url), requests, recorder, poll_interval=poll_interval)
    return recorder.finish()


@pytest.mark.server
def test_an_abort_after_tokens_closes_the_stream_mid_way_and_records_what_the_client_had(stub):
    late = ClientRequest("late", PROMPT, 200, 0.0, abort_at=0.0, abort_after_tokens=5)
    plain = WorkloadRequest("plain", PROMPT, 20, 0.0)
    trace = serve(stub, [late, plain])
    aborted, whole = trace.requests["late"], trace.requests["plain"]
    assert aborted.finish_reason == "abort" and aborted.abort_sent is not None
    assert 5 <= aborted.tokens_at_abort < 200, "the abort did not wait for its tokens, or never closed the stream"
    assert len(aborted.token_times) == aborted.tokens_at_abort, "tokens were recorded after the client closed"
    assert whole.finish_reason == "length" and len(whole.token_times) == 20 and whole.abort_sent is None


@pytest.mark.server
def test_a_request_that_ends_before_its_abort_tokens_is_not_aborted(stub):
    short = ClientRequest("short", PROMPT, 3, 0.0, abort_at=0.0, abort_after_tokens=5)
    trace = serve(stub, [short])
    assert trace.requests["short"].finish_reason == "length" and trace.requests["short"].abort_sent is None


@pytest.mark.server
@pytest.mark.parametrize("keep", [True, False])
def test_ids_and_text_are_kept_where_the_recorder_asks_streamed_or_not(stub, keep):
    streamed = ClientRequest("streamed", PROMPT, 6, 0.0)
    unstreamed = ClientRequest("unstreamed", PROMPT, 6, 0.0, stream=False)
    trace = serve(stub, [streamed, unstreamed], keep_outputs=keep)
    ids = [stub_token(PROMPT, i) for i in range(6)]
    for rid in ("streamed", "unstreamed"):
        got = trace.requests[rid]
        assert got.finish_reason == "length" and len(got.token_times) == 6
        if keep:
            assert got.output_token_ids == ids and got.output_text == "".join(f" t{t}" for t in ids), rid
        else:
            assert got.output_token_ids is None and got.output_text is None
    one_time = set(trace.requests["unstreamed"].token_times)
    assert len(one_time) == 1, "a non-streamed response's tokens arrive together"


@pytest.mark.server
def test_the_poller_goes_on_after_the_run_until_the_server_holds_nothing(stub):
    trace = serve(stub, [WorkloadRequest(f"r{i}", PROMPT, 30, 0.0) for i in range(4)], poll_interval=0.05)
    last_finish = max(r.finished for r in trace.requests.values())
    after = [s for s in trace.steps if s.sampled and s.t >= last_finish]
    assert after, "no /metrics sample was taken after the last response"
    assert after[-1].num_running == 0 and after[-1].num_waiting == 0


# ------------------------------------------------------------------------------------ an error event mid-stream
def _sse(events: list[object]) -> bytes:
    body = b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % len(body)) + body


def _chunk(ids: list[int], text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]}


def test_a_stream_that_ends_in_an_error_event_keeps_the_tokens_before_it(tmp_path: Path):
    answer = _sse([_chunk([7], " t7"), _chunk([8, 9], " t8 t9"),
                   {"error": {"message": "engine step failed: boom", "type": "InternalServerError", "code": 500}},
                   _chunk([10], " t10", "length"), b"[DONE]"])

    async def main():
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        seen: list[list[int]] = []
        async with server:
            client = CompletionClient(f"http://127.0.0.1:{port}")
            return await client.stream(client.body([5], 4, stream=True), lambda t, ids: seen.append(ids)), seen

    done, seen = asyncio.run(main())
    assert done.finish_reason == "error" and done.error_event and done.error == "engine step failed: boom"
    assert seen[:2] == [[7], [8, 9]] and done.token_ids[:3] == [7, 8, 9]
    assert done.text is not None and done.text.startswith(" t7 t8 t9")
