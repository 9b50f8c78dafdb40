"""Minimal reproductions of what kvbench's conformance suite found in llama.cpp's server (llama-server built from
the llama.cpp that llama-cpp-python 0.3.36 vendors, 0c1e570), on kvbench's built-in tiny checkpoint as a float32
GGUF, its KV cache in f32.

    python scripts/findings/llamacpp_repro.py [--only NAME]

Needs llama-server (``bash scripts/peers.sh llamacpp``, or ``KVBENCH_LLAMACPP``). Each finding starts its own
llama-server on 127.0.0.1 with llama.cpp's own flags (kvbench's launcher: one process group, stopped on exit),
sends plain HTTP with the standard library (token-id prompts on ``/v1/completions``), and prints what was
expected and what came back. Exit status: the number of findings that reproduced (0 when all are fixed).

1. ``full_cache_fails_in_flight`` (lost work): with a unified KV cache (``--kv-unified``, llama-server's default
   when it picks the slot count) that holds every request alone but not all of them at once, the server admits
   requests into every free slot without looking at the cache; when a decode finds no free cell it purges idle
   slots, halves its batch down to one token, and then fails *every* request in flight with "Context size has
   been exceeded." (tools/server/server-context.cpp, the ``n_batch == 1 && ret == 1`` branch), after streaming
   part of their tokens; nothing is preempted, deferred or retried.
2. ``context_full_truncates_silently`` (silent truncation): a request whose prompt fits a slot but whose prompt
   and ``max_tokens`` do not is admitted, generates until the slot's context is full and then ends with
   ``finish_reason: "length"`` and HTTP 200, fewer tokens than ``max_tokens`` and no error; only llama.cpp's own
   ``truncated`` field (in its native answer, or ``__verbose`` on ``/v1/completions``) says so. The server checks
   the prompt alone against the context (``task.n_tokens() >= slot.n_ctx``), never the prompt plus
   ``n_predict``, and with context shift off (the default) stops generation at the edge as a "limit".
3. ``ignore_eos_bans_eos`` (semantics): ``ignore_eos`` bans every end-of-generation token (a -inf logit bias,
   tools/server/server-schema.cpp) instead of only not stopping at one: where the model's greedy choice is EOS,
   the request without ``ignore_eos`` stops there with EOS, and with it emits another token, so the rest of its
   output is not the model's greedy continuation (vLLM and transformers emit EOS and go on).
4. ``abort_while_waiting_still_runs`` (wasted work): a client that closes its stream while its request waits for
   a slot is not noticed while other requests stream: the HTTP thread waiting for the request's first result
   checks its connection only when a whole second (``HTTP_POLLING_SECONDS``) passes with no result for *any*
   task (``server_response::recv_with_timeout`` waits on one condition variable that every slot's token wakes,
   tools/server/server-queue.cpp), so the request stays deferred (``llamacpp:requests_deferred``), and once a
   slot frees it is given the slot, its prompt computed and tokens generated
   (``llamacpp:tokens_predicted_total`` counts them) before the closed connection is seen at the first write.
5. ``negative_context_misreported`` (error message): ``-c -1`` passes argument parsing and the server exits with
   "failed to allocate buffer for kv cache" (unified cache) or "n_ctx_seq == 0" (``--no-kv-unified``), naming
   neither ``-c`` nor the value.
"""

from __future__ import annotations

import http.client
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvbench.launch.peers import find_llamacpp  # noqa: E402
from kvbench.launch.process import ServerProcess, free_port  # noqa: E402

START_TIMEOUT_S = 120.0


def model() -> str:
    """kvbench's tiny checkpoint as a float32 GGUF (converted once, cached)."""
    from kvbench.models.builtin import builtin_checkpoint
    from kvbench.models.gguf import gguf_checkpoint

    return str(gguf_checkpoint(builtin_checkpoint("tiny"), "float32"))


@contextmanager
def llama_server(*flags: str) -> Iterator[str]:
    """A running llama-server on the tiny GGUF (its base URL), stopped with its process group on exit."""
    port = free_port()
    argv = [str(find_llamacpp().server), "-m", model(), "--host", "127.0.0.1", "--port", str(port), "--metrics",
            "--no-webui", "-ctk", "f32", "-ctv", "f32", "--threads", "1", *flags]
    log = Path(tempfile.mkdtemp(prefix="llamacpp-repro-")) / "server.log"
    print(f"$ {' '.join(argv)}\n  (log: {log})")
    server = ServerProcess(argv, log)
    server.start()
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON answer) of one greedy, non-streamed completion of a token-id prompt."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "verbose": True,
            "return_tokens": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def prompt(n: int, salt: int) -> list[int]:
    return [3 + (salt * 31 + 7 * i) % 500 for i in range(n)]


def full_cache_fails_in_flight() -> bool:
    # 256 cells, 4 slots; each request needs 96 + 96 = 192 cells: one fits alone, two do not fit together
    with llama_server("-c", "256", "--parallel", "4", "--kv-unified") as url:
        answers: dict[int, tuple[int, dict[str, Any]]] = {}

        def one(i: int) -> None:
            answers[i] = complete(url, prompt(96, i), 96)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = 0
        for i in sorted(answers):
            status, data = answers[i]
            if status == 200:
                choice = data["choices"][0]
                print(f"  request {i}: HTTP 200, finish_reason {choice['finish_reason']!r}, "
                      f"{len(data['__verbose']['tokens'])} of 96 tokens")
            else:
                failed += 1
                print(f"  request {i}: HTTP {status}: {data.get('error', {}).get('message')!r}")
        alone = complete(url, prompt(96, 0), 96)
        print(f"  request 0 again, alone: HTTP {alone[0]}, "
              f"{len(alone[1].get('__verbose', {}).get('tokens', []))} of 96 tokens")
        return failed > 0 and alone[0] == 200


def context_full_truncates_silently() -> bool:
    # one slot of 256 cells; the request needs 192 + 128 = 320 of them
    with llama_server("-c", "256", "--parallel", "1") as url:
        status, data = complete(url, prompt(192, 1), 128)
        if status != 200:
            print(f"  refused: HTTP {status}: {data.get('error', {}).get('message')!r}")
            return False
        choice, native = data["choices"][0], data["__verbose"]
        got = len(native["tokens"])
        print(f"  HTTP {status}, finish_reason {choice['finish_reason']!r}, usage.completion_tokens "
              f"{data['usage']['completion_tokens']}, {got} of 128 tokens; llama.cpp's own truncated = "
              f"{native.get('truncated')}, stop_type = {native.get('stop_type')!r}")
        return choice["finish_reason"] == "length" and got < 128


def eos_prompt() -> tuple[list[int], int]:
    """A conformance prompt of kvbench's whose greedy continuation on tiny reaches EOS (token 2), and its length
    budget (request r0002 of kvbench.conformance.prove.conformance_requests)."""
    from kvbench.conformance.prove import conformance_requests
    from kvbench.models.builtin import builtin_checkpoint

    request = conformance_requests(str(builtin_checkpoint("tiny")))[2]
    return request.prompt_token_ids, request.max_tokens


def ignore_eos_bans_eos() -> bool:
    tokens, max_tokens = eos_prompt()
    with llama_server("-c", "1024", "--parallel", "1", "-fa", "off") as url:
        def run(ignore_eos: bool) -> dict[str, Any]:
            body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos,
                    "verbose": True, "return_tokens": True, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
            request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as answer:
                return json.loads(answer.read())

        stops, goes_on = run(False), run(True)
    stopped = stops["__verbose"]["tokens"]  # ends with the EOS it stopped at
    went = goes_on["__verbose"]["tokens"]
    at = len(stopped) - 1
    print(f"  ignore_eos false: {len(stopped)} tokens, stop_type {stops['__verbose']['stop_type']!r}: {stopped} "
          f"(EOS, token 2, is the greedy choice at position {at})")
    print(f"  ignore_eos true:  position {at} is {went[at] if len(went) > at else None}, not EOS; "
          f"the first {at} agree: {went[:at] == stopped[:at]}")
    return stops["__verbose"]["stop_type"] == "eos" and len(went) > at and went[at] != 2


def abort_while_waiting_still_runs() -> bool:
    # one slot, held by a streamed bystander; the waiting request's stream is closed 0.1 s after it was sent
    with llama_server("-c", "2048", "--parallel", "1") as url:
        host, port = url.removeprefix("http://").split(":")

        def gauges() -> dict[str, float]:
            text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
            return {line.split()[0].removeprefix("llamacpp:"): float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("llamacpp:")}

        before = gauges()["tokens_predicted_total"]
        done: dict[str, float] = {}

        def bystander() -> None:
            # streamed, as kvbench's clients stream: each token is a result llama-server's HTTP threads are woken by
            body = json.dumps({"prompt": prompt(16, 9), "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                               "stream": True, "return_tokens": True, "verbose": True})
            conn = http.client.HTTPConnection(host, int(port), timeout=300)
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            answer, tokens = conn.getresponse(), 0
            for line in answer:  # llama.cpp's own ids of each chunk (``__verbose.tokens``), not its text
                if line.startswith(b"data: {"):
                    tokens += len(json.loads(line[len(b"data: "):]).get("__verbose", {}).get("tokens", []))
            conn.close()
            done.update(tokens=tokens, ended=time.monotonic())

        holder = threading.Thread(target=bystander)
        holder.start()
        time.sleep(0.2)  # the bystander holds the only slot
        body = json.dumps({"prompt": prompt(32, 5), "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                           "stream": True})
        waiting = http.client.HTTPConnection(host, int(port), timeout=30)
        waiting.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        time.sleep(0.1)
        waiting.close()  # aborted while it waits: no answer, no token has come
        closed = time.monotonic()
        time.sleep(0.5)
        deferred = gauges()["requests_deferred"]  # taken while the bystander still streams
        holder.join()
        time.sleep(1.0)
        made = gauges()["tokens_predicted_total"] - before
        print(f"  0.5 s after the close, with the bystander still streaming ({done['ended'] - closed:.2f} s more), "
              f"/metrics counts {deferred:g} deferred request(s)")
        print(f"  the bystander received {done['tokens']} tokens; the server counts {made:g} generated: "
              f"{made - done['tokens']:g} for the request closed while it waited for the slot")
        return deferred > 0 and made > done["tokens"]


def negative_context_misreported() -> bool:
    from kvbench.launch.process import ServerStartError

    misreported = []
    for layout in (("--kv-unified",), ("--no-kv-unified", "--parallel", "4")):
        try:
            with llama_server("-c", "-1", "--fit", "off", *layout):  # kvbench's launch (fit on asserts first)
                print("  the server started with -c -1")
                return False
        except ServerStartError as e:
            said = [line for line in (e.engine_output or str(e)).splitlines() if "failed" in line or "error" in line]
            print(f"  {' '.join(layout)}: the server refused to start; the errors it logged:\n    "
                  + "\n    ".join(said[:3]))
            misreported.append(not any("ctx" in line.replace("n_ctx_seq", "") or "-c" in line.split()
                                       for line in said))
    return all(misreported)


FINDINGS: dict[str, Callable[[], bool]] = {
    "full_cache_fails_in_flight": full_cache_fails_in_flight,
    "context_full_truncates_silently": context_full_truncates_silently,
    "ignore_eos_bans_eos": ignore_eos_bans_eos,
    "abort_while_waiting_still_runs": abort_while_waiting_still_runs,
    "negative_context_misreported": negative_context_misreported,
}


def main() -> int:
    from runner import run_findings  # scripts/findings/runner.py: this script's folder is on sys.path

    return run_findings(__doc__.split("\n\n")[0], FINDINGS)


if __name__ == "__main__":
    sys.exit(main())
