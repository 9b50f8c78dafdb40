"""A stub OpenAI-compatible server that answers instantly: the yardstick for kvbench's HTTP driver, and
a server whose every answer a test can predict.

``python -m kvbench.testing.stub_server --port 8123 [--token-delay S] [--no-token-ids] [engine flags]``
serves on 127.0.0.1 only:

* ``POST /v1/completions`` (token-id prompts, streamed or not): output token ``i`` of a prompt is
  ``stub_token(prompt, i)``, a pure function, so a test knows every id; ``--no-token-ids`` returns only
  text (``"t<id>"`` words, what the built-in checkpoints' tokenizer reads back) to exercise the client's
  text fallback. A prompt longer than ``--max-model-len`` is a 400 naming ``max_model_len``; a client
  that closes its stream is counted as an abort.
* ``GET /metrics``: vLLM's names with numbers that move by a known amount per request (below), starting
  from non-zero totals so a reader must subtract a before-scrape; ``vllm:cache_config_info`` echoes the
  engine flags it was started with (vLLM's names, as the reference server takes them). ``--metrics-block
  S`` makes each answer hold the server's one loop for ``S`` seconds, as a slow exporter on a
  single-loop front end does (vLLM's took ~15 ms on 2 cores): every open stream waits meanwhile.
* ``GET /health``, ``GET /v1/models``.
* ``POST /kvbench/reconfigure`` with ``{"args": [flags]}`` (as the reference server's ``--allow-reconfigure``
  takes it, always on here): the engine flags it echoes become those, and
  ``kvbench_stub:reconfigures_total`` counts the calls, so a test sees whether a launcher reconfigured it.
* ``--drop-if-prompt-has ID`` (a fault, for the HTTP liveness watchdog's tests): a completion whose prompt
  holds token ``ID`` is counted finished and forgotten without ever ending its response: a streamed
  one gets its head and its first :data:`DROPPED_AFTER` tokens, then nothing (the connection stays
  open); a non-streamed one gets no answer at all.

Per finished or aborted request: ``vllm:prefix_cache_queries_total`` += prompt length,
``vllm:prefix_cache_hits_total`` += prompt length // 2, ``vllm:num_preemptions_total`` and
``reference_engine:preemptions_recompute_total`` += 1 (``reference_engine:preemptions_swap_total`` stays
0), ``vllm:generation_tokens_total`` += tokens sent, and ``vllm:request_success_total{finished_reason}``
+= 1 ("abort" for a closed stream).

A bare asyncio protocol (no framework, no ASGI server; uvloop's loop where installed) that answers a
streamed completion with one write of pre-built bytes: the stub must cost far less per token than the
driver it is the yardstick for. ``--cpu N`` pins it to one CPU, so that a benchmark can keep it off
the driver's core. ``--per-token-writes`` writes each event on its own (yielding to the loop between
them) as a server that emits tokens one by one would, still without waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

VOCAB = 1000
FIRST_ORDINARY_ID = 3  # ids 0..2 are the built-in checkpoints' special tokens
BASE_TOTAL = 1000  # counters start here: a client that forgets to subtract is caught
DROPPED_AFTER = 3  # tokens a dropped streamed request gets before the stub forgets it


def stub_token(prompt: list[int], i: int) -> int:
    """The ``i``-th output token the stub gives ``prompt``."""
    return FIRST_ORDINARY_ID + (sum(prompt) + 7 * i) % (VOCAB - FIRST_ORDINARY_ID)


@dataclass
class StubState:
    token_delay: float = 0.0
    per_token_writes: bool = False
    metrics_block: float = 0.0  # seconds a /metrics answer holds the loop (a slow exporter on one loop)
    return_ids: bool = True
    max_model_len: int = 2048
    drop_token: int | None = None  # a prompt holding this id is dropped (the fault above)
    config: dict[str, str] = field(default_factory=dict)
    reconfigures: int = 0
    running: int = 0
    queries: int = BASE_TOTAL
    hits: int = BASE_TOTAL // 2
    preemptions: int = BASE_TOTAL // 10
    generated: int = BASE_TOTAL
    finished: dict[str, int] = field(default_factory=lambda: {"length": 0, "stop": 0, "abort": 0})
    bursts: dict[tuple[int, int], bytes] = field(default_factory=dict)  # pre-built streamed bodies

    def count(self, prompt_len: int, tokens: int, reason: str) -> None:
        self.queries += prompt_len
        self.hits += prompt_len // 2
        self.preemptions += 1
        self.generated += tokens
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def metrics(self) -> str:
        m = 'model_name="stub"'
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.config.items()))
        lines = [
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{m}}} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{m}}} 0",
            "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{m}}} {min(1.0, self.running / 100)}",
            "# TYPE vllm:num_preemptions counter", f"vllm:num_preemptions_total{{{m}}} {self.preemptions}",
            "# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total{{{m}}} {self.queries}",
            "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total{{{m}}} {self.hits}",
            "# TYPE vllm:generation_tokens counter", f"vllm:generation_tokens_total{{{m}}} {self.generated}",
            "# TYPE vllm:request_success counter",
            *(f'vllm:request_success_total{{finished_reason="{r}",{m}}} {n}' for r, n in self.finished.items()),
            "# TYPE reference_engine:preemptions_recompute counter",
            f"reference_engine:preemptions_recompute_total{{{m}}} {self.preemptions}",
            "# TYPE reference_engine:preemptions_swap counter", f"reference_engine:preemptions_swap_total{{{m}}} 0",
            "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{labels}{',' if labels else ''}{m}}} 1",
            "# TYPE kvbench_stub:reconfigures counter", f"kvbench_stub:reconfigures_total{{{m}}} {self.reconfigures}",
        ]
        return "\n".join(lines) + "\n"


def _error(message: str, param: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}}).encode()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large"}
_EVENT_HEAD = 'data: {"id":"cmpl-stub","object":"text_completion","model":"stub","choices":['
_LAST_CHUNK = b"0\r\n\r\n"
MAX_HEAD = 64 * 1024  # a request head longer than this is refused (a stub has no reason to buffer more)
_BURSTS = 4096  # pre-built streamed bodies kept (the bodies' variety: prompt sum mod the vocabulary x lengths)


def _head(status: int, content_type: str, close: bool, length: int | None) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", f"content-type: {content_type}"]
    if length is None:
        lines += ["transfer-encoding: chunked", "cache-control: no-cache"]
    else:
        lines.append(f"content-length: {length}")
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk (a server that streams frames each SSE event as its own chunk, as uvicorn does)."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(token: int, last: bool, return_ids: bool) -> bytes:
    finish = '"length"' if last else "null"
    ids_field = f',"token_ids":[{token}]' if return_ids else ""
    # formatted, not json.dumps'd: the stub must cost far less per token than the driver it measures
    return f'{_EVENT_HEAD}{{"index":0,"text":" t{token}"{ids_field},"finish_reason":{finish}}}]}}\n\n'.encode()


def _choice(state: StubState, ids: list[int], finish: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": "".join(f" t{t}" for t in ids), "finish_reason": finish}
    if state.return_ids:
        choice["token_ids"] = ids
    return choice


class StubProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection: requests parsed from the bytes as they come (``Content-Length`` bodies),
    answered in order, kept alive unless the client says ``Connection: close`` or speaks HTTP/1.0.

    A streamed completion without ``token_delay`` (and without ``per_token_writes``) is answered with
    one write of pre-built bytes (head, one chunk per SSE event, ``[DONE]``, the last chunk): the least
    a server can cost per token. With a delay (or ``per_token_writes``, a delay of 0) each event is its
    own write after ``await asyncio.sleep(delay)``, and a client that closes its connection before the
    last token is counted as an abort."""

    def __init__(self, state: StubState):
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False  # a streamed answer is being written: later requests wait in ``buf``
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._serve_buffered()

    def _serve_buffered(self) -> None:
        while not self.lost and not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self._answer(413, _error("request head too long", None), close=True)
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._answer(400, _error("malformed request", None), close=True)
                return
            if len(self.buf) < end + 4 + length:
                return  # the body is still on its way
            body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
            close = version != "HTTP/1.1" or headers.get("connection", "").lower() == "close"
            self._route(method, target.split("?", 1)[0], body, close)

    def _answer(self, status: int, body: bytes, close: bool, content_type: str = "application/json") -> None:
        assert self.transport is not None
        self.transport.write(_head(status, content_type, close, len(body)) + body)
        if close:
            self.transport.close()
            self.lost = True  # nothing more is read from a connection closed here

    def _route(self, method: str, path: str, body: bytes, close: bool) -> None:
        if path == "/health":
            self._answer(200, b"", close)
        elif path == "/v1/models":
            self._answer(200, b'{"object":"list","data":[{"id":"stub","object":"model"}]}', close)
        elif path == "/metrics":
            if self.state.metrics_block:
                time.sleep(self.state.metrics_block)  # on the loop, on purpose: every stream waits, as on vLLM's
            self._answer(200, self.state.metrics().encode(), close, "text/plain; version=0.0.4")
        elif path == "/v1/completions" and method == "POST":
            self._completions(body, close)
        elif path == "/kvbench/reconfigure" and method == "POST":
            try:
                args = parse_args(["--port", "0", *json.loads(body)["args"]])
            except (ValueError, KeyError, TypeError, SystemExit) as e:
                self._answer(400, _error(f"bad reconfigure: {e!r}", "args"), close)
                return
            self.state.config = engine_config_of(args)
            self.state.reconfigures += 1
            self._answer(200, json.dumps({"config": self.state.config}).encode(), close)
        else:
            self._answer(404, _error(f"no route {method} {path}", None), close)

    def _completions(self, raw: bytes, close: bool) -> None:
        state = self.state
        try:
            req = json.loads(raw)
        except ValueError:
            self._answer(400, _error("body is not JSON", None), close)
            return
        if not isinstance(req, dict):
            self._answer(400, _error("body must be a JSON object", None), close)
            return
        prompt, max_tokens = req.get("prompt"), req.get("max_tokens", 16)
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            self._answer(400, _error("prompt must be a non-empty list of token ids", "prompt"), close)
            return
        if not isinstance(max_tokens, int) or max_tokens < 1:
            self._answer(400, _error(f"max_tokens must be >= 1, got {max_tokens!r}", "max_tokens"), close)
            return
        if len(prompt) + max_tokens > state.max_model_len:
            self._answer(400, _error(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                                     f"max_model_len={state.max_model_len}", "prompt"), close)
            return
        dropped = state.drop_token is not None and state.drop_token in prompt
        if not req.get("stream"):
            ids = [stub_token(prompt, i) for i in range(max_tokens)]
            if dropped:  # counted finished, never answered
                state.count(len(prompt), len(ids), "length")
                return
            state.count(len(prompt), len(ids), "length")
            out = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                   "choices": [_choice(state, ids, "length")]}
            self._answer(200, json.dumps(out).encode(), close)
            return
        head = _head(200, "text/event-stream", close, None)
        if state.token_delay or state.per_token_writes:
            self.busy = True
            task = asyncio.ensure_future(self._stream_slowly(head, prompt, max_tokens, close, dropped))
            task.add_done_callback(self._streamed)
            return
        assert self.transport is not None
        if dropped:  # its first tokens, then nothing: counted finished, the connection left open
            sent = min(DROPPED_AFTER, max_tokens - 1)
            self.busy = True
            self.transport.write(head + b"".join(_chunk(_event(stub_token(prompt, i), False, state.return_ids))
                                                 for i in range(sent)))
            state.count(len(prompt), sent, "length")
            return
        self.transport.write(head + self._burst(prompt, max_tokens))
        state.count(len(prompt), max_tokens, "length")
        if close:
            self.transport.close()
            self.lost = True

    def _burst(self, prompt: list[int], max_tokens: int) -> bytes:
        """The whole streamed body, built once per (prompt's token sum mod the vocabulary, length)."""
        key = (sum(prompt) % (VOCAB - FIRST_ORDINARY_ID), max_tokens)
        body = self.state.bursts.get(key)
        if body is None:
            events = [_chunk(_event(stub_token(prompt, i), i == max_tokens - 1, self.state.return_ids))
                      for i in range(max_tokens)]
            body = b"".join(events) + _chunk(b"data: [DONE]\n\n") + _LAST_CHUNK
            if len(self.state.bursts) >= _BURSTS:
                self.state.bursts.clear()
            self.state.bursts[key] = body
        return body

    async def _stream_slowly(self, head: bytes, prompt: list[int], max_tokens: int, close: bool,
                             dropped: bool = False) -> None:
        state, transport = self.state, self.transport
        assert transport is not None
        state.running += 1
        sent = 0
        try:
            transport.write(head)
            for i in range(max_tokens):
                await asyncio.sleep(state.token_delay)
                if self.lost:
                    break
                if dropped and sent == min(DROPPED_AFTER, max_tokens - 1):
                    return  # forgotten: counted finished below, no end written, the connection left open
                transport.write(_chunk(_event(stub_token(prompt, i), i == max_tokens - 1, state.return_ids)))
                sent += 1
            if not self.lost:  # written in the same callback as the last token: no abort can fall between
                transport.write(_chunk(b"data: [DONE]\n\n") + _LAST_CHUNK)
        finally:
            state.running -= 1
            state.count(len(prompt), sent, "length" if (sent == max_tokens or dropped) and not self.lost else "abort")
        if close:
            transport.close()
            self.lost = True

    def _streamed(self, task: asyncio.Future[None]) -> None:
        self.busy = False
        if not task.cancelled() and task.exception() is not None:  # a bug here: say so, drop the connection
            print(f"stub: stream failed: {task.exception()!r}", file=sys.stderr, flush=True)
            if self.transport is not None:
                self.transport.close()
            self.lost = True
        self._serve_buffered()


#: engine flags (vLLM's names, as the reference server takes them) echoed into vllm:cache_config_info
ENGINE_FLAGS = {
    "--block-size": "block_size", "--num-gpu-blocks-override": "num_gpu_blocks",
    "--num-cpu-blocks-override": "num_cpu_blocks", "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens", "--preemption-mode": "preemption_mode",
    "--scheduling-policy": "scheduling_policy",
}
SWITCHES = {"--enable-prefix-caching": "enable_prefix_caching", "--enable-chunked-prefill": "enable_chunked_prefill"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvbench.testing.stub_server", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1"], help="loopback only")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="stub", help="ignored (accepted so preset command templates fit)")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds before each streamed token")
    p.add_argument("--per-token-writes", action="store_true",
                   help="write each streamed event on its own, yielding between them (default: one write)")
    p.add_argument("--metrics-block", type=float, default=0.0,
                   help="seconds each /metrics answer blocks the server's loop (every stream waits meanwhile)")
    p.add_argument("--no-token-ids", action="store_true", help="return text only, no token_ids")
    p.add_argument("--cpu", type=int, default=None,
                   help="pin the stub to this CPU (os.sched_setaffinity), e.g. off the driver's core")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--drop-if-prompt-has", type=int, default=None, metavar="ID",
                   help="a fault: a completion whose prompt holds token ID is counted finished but its response "
                        "never ends (tests of kvbench's HTTP liveness watchdog)")
    p.add_argument("--fail-on-start", default=None, help="exit 3 at start-up printing this message (tests)")
    p.add_argument("--start-delay", type=float, default=0.0,
                   help="seconds before it listens, as a server that imports a framework takes (tests of starts)")
    for flag in ENGINE_FLAGS:
        p.add_argument(flag, default=None)
    for flag in SWITCHES:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
    return p.parse_args(argv)


def engine_config_of(args: argparse.Namespace) -> dict[str, str]:
    """The engine flags given, as ``vllm:cache_config_info``'s labels."""
    config = {label: getattr(args, flag[2:].replace("-", "_")) for flag, label in {**ENGINE_FLAGS, **SWITCHES}.items()}
    config = {k: str(v) for k, v in config.items() if v is not None}
    config["max_model_len"] = str(args.max_model_len)
    return config


async def serve(state: StubState, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StubProtocol(state), host, port, backlog=2048, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.fail_on_start:
        print(args.fail_on_start, file=sys.stderr, flush=True)
        raise SystemExit(3)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.start_delay:
        time.sleep(args.start_delay)
    state = StubState(token_delay=args.token_delay, per_token_writes=args.per_token_writes,
                      metrics_block=args.metrics_block,
                      return_ids=not args.no_token_ids, max_model_len=args.max_model_len,
                      drop_token=args.drop_if_prompt_has, config=engine_config_of(args))
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(state, args.host, args.port))
    else:
        uvloop.run(serve(state, args.host, args.port))


if __name__ == "__main__":
    main()
