"""A stub OpenAI-compatible server that answers instantly: the yardstick for kvbench's HTTP driver, and
a server whose every answer a test can predict.

``python -m kvbench.engines.stub_server --port 8123 [--token-delay S] [--no-token-ids] [engine flags]``
serves on 127.0.0.1 only:

* ``POST /v1/completions`` (token-id prompts, streamed or not): output token ``i`` of a prompt is
  ``stub_token(prompt, i)``, a pure function, so a test knows every id; ``--no-token-ids`` returns only
  text (``"t<id>"`` words, what the built-in checkpoints' tokenizer reads back) to exercise the client's
  text fallback. A prompt longer than ``--max-model-len`` is a 400 naming ``max_model_len``; a client
  that closes its stream is counted as an abort.
* ``GET /metrics``: vLLM's names with numbers that move by a known amount per request (below), starting
  from non-zero totals so a reader must subtract a before-scrape; ``vllm:cache_config_info`` echoes the
  engine flags it was started with (vLLM's names, as the reference server takes them).
* ``GET /health``, ``GET /v1/models``.

Per finished or aborted request: ``vllm:prefix_cache_queries_total`` += prompt length,
``vllm:prefix_cache_hits_total`` += prompt length // 2, ``reference_engine:preemptions_total{mode=
"recompute"}`` += 1, ``vllm:generation_tokens_total`` += tokens sent, and
``vllm:request_success_total{finished_reason}`` += 1 ("abort" for a closed stream).

A raw ASGI application (no framework) so the stub costs as little per chunk as uvicorn allows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

VOCAB = 1000
FIRST_ORDINARY_ID = 3  # ids 0..2 are the built-in checkpoints' special tokens
BASE_TOTAL = 1000  # counters start here: a client that forgets to subtract is caught


def stub_token(prompt: list[int], i: int) -> int:
    """The ``i``-th output token the stub gives ``prompt``."""
    return FIRST_ORDINARY_ID + (sum(prompt) + 7 * i) % (VOCAB - FIRST_ORDINARY_ID)


@dataclass
class StubState:
    token_delay: float = 0.0
    return_ids: bool = True
    max_model_len: int = 2048
    config: dict[str, str] = field(default_factory=dict)
    running: int = 0
    queries: int = BASE_TOTAL
    hits: int = BASE_TOTAL // 2
    preemptions: int = BASE_TOTAL // 10
    generated: int = BASE_TOTAL
    finished: dict[str, int] = field(default_factory=lambda: {"length": 0, "stop": 0, "abort": 0})

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
            "# TYPE reference_engine:preemptions counter",
            f'reference_engine:preemptions_total{{mode="recompute",{m}}} {self.preemptions}',
            f'reference_engine:preemptions_total{{mode="swap",{m}}} 0',
            "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{labels}{',' if labels else ''}{m}}} 1",
        ]
        return "\n".join(lines) + "\n"


Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def _respond(send: Send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


def _error(message: str, param: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}}).encode()


_EVENT_HEAD = 'data: {"id":"cmpl-stub","object":"text_completion","model":"stub","choices":['


def _choice(state: StubState, ids: list[int], finish: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": "".join(f" t{t}" for t in ids), "finish_reason": finish}
    if state.return_ids:
        choice["token_ids"] = ids
    return choice


class StubApp:
    """The ASGI application."""

    def __init__(self, state: StubState):
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await _respond(send, 200, b"")
        elif path == "/v1/models":
            await _respond(send, 200, b'{"object":"list","data":[{"id":"stub","object":"model"}]}')
        elif path == "/metrics":
            await _respond(send, 200, self.state.metrics().encode(), b"text/plain; version=0.0.4")
        elif path == "/v1/completions" and method == "POST":
            await self.completions(receive, send)
        else:
            await _respond(send, 404, _error(f"no route {method} {path}", None))

    async def completions(self, receive: Receive, send: Send) -> None:
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            req = json.loads(raw)
        except ValueError:
            await _respond(send, 400, _error("body is not JSON", None))
            return
        prompt, max_tokens = req.get("prompt"), req.get("max_tokens", 16)
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            await _respond(send, 400, _error("prompt must be a non-empty list of token ids", "prompt"))
            return
        if not isinstance(max_tokens, int) or max_tokens < 1:
            await _respond(send, 400, _error(f"max_tokens must be >= 1, got {max_tokens!r}", "max_tokens"))
            return
        if len(prompt) + max_tokens > self.state.max_model_len:
            await _respond(send, 400, _error(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                                             f"max_model_len={self.state.max_model_len}", "prompt"))
            return
        ids = [stub_token(prompt, i) for i in range(max_tokens)]
        if not req.get("stream"):
            self.state.count(len(prompt), len(ids), "length")
            body = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                    "choices": [_choice(self.state, ids, "length")]}
            await _respond(send, 200, json.dumps(body).encode())
            return
        await self.stream(receive, send, prompt, ids)

    async def stream(self, receive: Receive, send: Send, prompt: list[int], ids: list[int]) -> None:
        state = self.state
        disconnected = asyncio.Event()

        async def watch() -> None:  # the only way an ASGI app learns that the client went away
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        watcher = asyncio.ensure_future(watch())
        state.running += 1
        sent = 0
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            for i, token in enumerate(ids):
                if disconnected.is_set():
                    break
                if state.token_delay:
                    await asyncio.sleep(state.token_delay)
                finish = '"length"' if i == len(ids) - 1 else "null"
                ids_field = f',"token_ids":[{token}]' if state.return_ids else ""
                # formatted, not json.dumps'd: the stub must cost far less per token than the driver it measures
                event = (f'{_EVENT_HEAD}{{"index":0,"text":" t{token}"{ids_field},"finish_reason":{finish}}}]}}\n\n')
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                sent += 1
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            state.running -= 1
            watcher.cancel()
            state.count(len(prompt), sent, "length" if sent == len(ids) and not disconnected.is_set() else "abort")


#: engine flags (vLLM's names, as the reference server takes them) echoed into vllm:cache_config_info
ENGINE_FLAGS = {
    "--block-size": "block_size", "--num-gpu-blocks-override": "num_gpu_blocks",
    "--num-cpu-blocks-override": "num_cpu_blocks", "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens", "--preemption-mode": "preemption_mode",
    "--scheduling-policy": "scheduling_policy",
}
SWITCHES = {"--enable-prefix-caching": "enable_prefix_caching", "--enable-chunked-prefill": "enable_chunked_prefill"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvbench.engines.stub_server", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1"], help="loopback only")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="stub", help="ignored (accepted so preset command templates fit)")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds before each streamed token")
    p.add_argument("--no-token-ids", action="store_true", help="return text only, no token_ids")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--fail-on-start", default=None, help="exit 3 at start-up printing this message (tests)")
    for flag in ENGINE_FLAGS:
        p.add_argument(flag, default=None)
    for flag in SWITCHES:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import sys

    import uvicorn

    args = parse_args(argv)
    if args.fail_on_start:
        print(args.fail_on_start, file=sys.stderr, flush=True)
        raise SystemExit(3)
    config = {label: getattr(args, flag[2:].replace("-", "_")) for flag, label in {**ENGINE_FLAGS, **SWITCHES}.items()}
    config = {k: str(v) for k, v in config.items() if v is not None}
    config["max_model_len"] = str(args.max_model_len)
    state = StubState(token_delay=args.token_delay, return_ids=not args.no_token_ids,
                      max_model_len=args.max_model_len, config=config)
    uvicorn.run(StubApp(state), host=args.host, port=args.port, log_level="warning", access_log=False,
                lifespan="on")


if __name__ == "__main__":
    main()
