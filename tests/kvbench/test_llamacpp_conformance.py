"""llama.cpp's server as kvbench sees it: the ``llamacpp`` preset's flags and KV layout, its dialect, its
``/metrics`` read into the counter contract, and (where llama-server is built) a conformance subset run on it as
a user runs it.

The subset is ``pytest suites/conformance --engine server:preset=llamacpp --kvbench-expectations llamacpp -k
SUBSET`` in a subprocess, judged from its ``results.json``: every selected check must be decided (passed, or
failed the way the shipped expectations pin). Skipped, saying why, where llama-server was not built
(``bash scripts/peers.sh llamacpp``) and ``KVBENCH_LLAMACPP`` names none.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvbench.core.kv_budget import KVBudget, pool_knobs, pressured
from kvbench.drivers.http_client import CompletionClient, in_dialect
from kvbench.drivers.server_metrics import MetricsSnapshot, cumulative_counters, in_flight
from kvbench.engines.http import llamacpp
from kvbench.engines.http.presets import LLAMACPP

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------- the preset, no server
def test_knobs_become_llama_server_flags():
    flags, refused = LLAMACPP.flags({"block_size": 1, "num_gpu_blocks": 512, "max_num_seqs": 16,
                                     "max_num_batched_tokens": 64, "max_model_len": 300,
                                     "enable_prefix_caching": False, "enable_chunked_prefill": True})
    assert refused == {}
    assert flags == ["-c", "512", "--parallel", "16", "-b", "64", "-ub", "64", "--kv-unified-per-slot", "300",
                     "--no-cache-prompt", "--cache-ram", "0"]


def test_what_llama_server_cannot_do_is_refused_with_the_reason():
    _, refused = LLAMACPP.flags({"preemption_mode": "recompute", "num_cpu_blocks": 64, "block_size": 16,
                                 "enable_chunked_prefill": False})
    assert "never preempts" in refused["preemption_mode"]
    assert "no swap pool" in refused["num_cpu_blocks"]
    assert refused["block_size"] == "llamacpp always runs block_size=1, not 16"
    assert "enable_chunked_prefill" in refused
    assert {"recompute", "swap", "priority", "stop_token_ids"} <= set(LLAMACPP.lacking)


def test_pressure_in_tokens_becomes_a_padded_context():
    """Unified: one pool of -c cells, padded to 256 as llama.cpp pads it; per slot: every slot's share holds the
    largest request, and the slot count is stated so the share is what the pool was sized for."""
    unified = pool_knobs(pressured([240, 100, 50]), llamacpp.UNIFIED_LAYOUT)
    assert (unified.block_size, unified.num_gpu_blocks, unified.max_num_seqs) == (1, 512, None)
    per_slot = llamacpp.layout({"args": "--no-kv-unified --parallel 3"})
    knobs = pool_knobs(KVBudget(tokens=480, largest=240), per_slot)
    assert (knobs.num_gpu_blocks, knobs.max_num_seqs) == (768, 3)  # 3 slots of 256 >= 240 each
    assert llamacpp.layout({"args": "--no-kv-unified --kv-unified"}).slots == "unified"  # the later flag wins


def test_a_request_overflows_one_slots_share_where_the_pool_is_split():
    """The overflow check sizes its request against what one request can hold: the whole unified pool, one slot's
    share per slot (256 of 1024 cells), so that per slot it asks the slot-shaped question instead of skipping."""
    from types import SimpleNamespace

    from suites.conformance.test_kv_full import OVERFLOW_POOL, request_pool

    budget = KVBudget(tokens=OVERFLOW_POOL, largest=OVERFLOW_POOL)
    for kv, want in ((llamacpp.UNIFIED_LAYOUT, 256), (llamacpp.layout({"args": "--no-kv-unified --parallel 4"}), 256)):
        knobs = pool_knobs(budget, kv)
        assert request_pool(SimpleNamespace(kv_layout=kv), knobs) == want, (kv.slots, knobs)
    per_slot = llamacpp.layout({"args": "--no-kv-unified --parallel 4"})
    assert pool_knobs(budget, per_slot).num_gpu_blocks == 1024  # the pool the check used to size against


def test_bad_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, bfloat16"):
        llamacpp.validate({"dtype": "int8"})
    with pytest.raises(ValueError, match="--parallel must be an integer"):
        llamacpp.validate({"args": "--no-kv-unified --parallel many"})


def test_dialect_states_neutral_sampling_and_asks_for_the_ids():
    body = {"prompt": [5, 6], "max_tokens": 4, "temperature": 0.0, "stream": False, "return_token_ids": True,
            "ignore_eos": True, "priority": 3, "stop_token_ids": [9], "cache_salt": "x"}
    out = in_dialect(body, "llamacpp")
    assert out == {"prompt": [5, 6], "max_tokens": 4, "temperature": 0.0, "stream": False, "ignore_eos": True,
                   "return_tokens": True, "verbose": True, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def test_ids_are_read_from_llamacpps_own_result_not_the_text():
    """A /v1/completions answer as llama-server gives it with return_tokens and verbose (server-task.cpp): the
    ids come from ``__verbose.tokens``, the truncation flag from ``__verbose.truncated``."""
    answer = {"choices": [{"text": "a b", "index": 0, "logprobs": None, "finish_reason": "length"}],
              "usage": {"completion_tokens": 3, "prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}},
              "__verbose": {"tokens": [7, 8, 9], "truncated": True, "stop_type": "limit"}}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    client = CompletionClient("http://127.0.0.1:1", dialect="llamacpp")

    async def run():
        async with httpx.AsyncClient(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(handler)) as http:
            return await client.complete(http, client.body([1, 2], 3, stream=False))

    done = asyncio.run(run())
    assert (done.token_ids, done.ids_from_text, done.truncated, done.cached_tokens) == ([7, 8, 9], False, True, 1)


METRICS = "\n".join(f"# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}" for name, kind, value in (
    ("prompt_tokens_total", "counter", 100), ("prompt_tokens_cached_total", "counter", 20),
    ("tokens_predicted_total", "counter", 55), ("n_decode_total", "counter", 40),
    ("requests_processing", "gauge", 2), ("requests_deferred", "gauge", 3))) + "\n"


def test_llamacpp_metrics_feed_the_counter_contract():
    snap = MetricsSnapshot.parse(METRICS)
    c = cumulative_counters(snap)
    assert (c.prompt_tokens, c.prefix_cache_queries, c.prefix_cache_hits, c.generated_tokens) == (120, 120, 20, 55)
    assert c.preemptions_recompute is None and c.preemptions_swap is None  # no count the server made
    assert c.aborts is None and c.finished_length is None and c.leaked_blocks is None  # not exposed, not 0
    assert in_flight(snap) == 5


# ----------------------------------------------------------------------------------- closing before the head
#: how long the fake server below holds its answer's head back, as llama-server does until the first token
HEAD_HELD = 0.6


def _close_seen_before_head(abort_before_head: bool) -> tuple[bool, float | None]:
    """(whether a server that sends no head for HEAD_HELD seconds saw the client close first, the trace's
    ``abort_sent``) for one streamed request aborted at 0.1 s."""
    from kvbench.core.trace import TraceRecorder
    from kvbench.drivers.http_driver import ClientRequest, serve_workload

    seen: dict[str, bool] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:  # the body, then EOF if the client closes while the head is held back
            await asyncio.wait_for(reader.read(), timeout=HEAD_HELD)
            seen["closed_before_head"] = True
        except TimeoutError:
            seen["closed_before_head"] = False
            event = json.dumps({"choices": [{"index": 0, "text": " t7", "token_ids": [7], "finish_reason": "length"}]})
            body = f"data: {event}\n\ndata: [DONE]\n\n".encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        recorder = TraceRecorder("fake", "head")
        async with server:
            request = ClientRequest("r", [5, 6], 1, 0.0, abort_at=0.1, abort_before_head=abort_before_head)
            await serve_workload(CompletionClient(f"http://127.0.0.1:{port}"), [request], recorder,
                                 poll_interval=None)
        return recorder.finish()

    trace = asyncio.run(main())
    return seen["closed_before_head"], trace.requests["r"].abort_sent


def test_an_abort_before_the_head_closes_a_request_the_server_holds_without_answering():
    """The early-abort check closes its targets while llama-server holds them waiting for a slot, and
    llama-server sends a response's head only with its first token: a close that waited for the head would come
    only after a token was made. ``abort_before_head`` closes at the abort's time; without it the close waits."""
    closed_first, sent = _close_seen_before_head(True)
    assert closed_first and sent is not None and sent < HEAD_HELD
    closed_first, _ = _close_seen_before_head(False)
    assert not closed_first, "without abort_before_head the client closed before the server's head"


def test_the_slots_are_held_until_fewer_bystanders_than_slots_are_left():
    """The early-abort check judges a close only while every slot is provably held by a bystander: bystanders come
    first, so a freed slot goes to a waiting one while one waits; with 2 slots and 4 bystanders, until the third
    finish. A bystander that never finished leaves it unknown."""
    from types import SimpleNamespace

    from suites.conformance.test_nothing_lost import SLOTS, _targets_waiting, slots_held_until

    assert SLOTS == 2
    four = [SimpleNamespace(finished=t) for t in (2.0, 1.0, 4.0, 3.0)]
    assert slots_held_until(four) == 3.0
    assert slots_held_until(four[:2]) == 1.0
    assert slots_held_until([SimpleNamespace(finished=None), *four[1:]]) is None
    # a sample's waiting requests less the bystanders still waiting: at 0.5 s two of the four wait beside 3 targets
    waiting = _targets_waiting(four)
    assert waiting(SimpleNamespace(t=0.5, num_waiting=5)) == 3
    assert waiting(SimpleNamespace(t=3.5, num_waiting=1)) == 1


# ----------------------------------------------------------------------------------- the peer itself
#: checks llama.cpp is decided on, chosen to need few server starts (~1 s each) and little time: the prefix-cache
#: check passes with its hits proven on llama.cpp's own /metrics; the others fail as the shipped expectations pin.
#: Not the full-cache check: whether its 8 requests overlap enough to fill llama.cpp's cache depends on the
#: machine's load (under the CI's two xdist workers they once did not: undecided, and a pin whose check went
#: undecided is reported stale), so it is decided in the full suite run, not gated on here
SUBSET = ("unpressured_matches_ground_truth or prefix_caching_equivalence or cannot_finish "
          "or batch_of_16 or over_long_prompt")


def _llamacpp_missing() -> str | None:
    from kvbench.launch.peers import PeerMissing, find_llamacpp

    try:
        find_llamacpp()
    except PeerMissing as e:
        return str(e)
    return None


@pytest.mark.server
@pytest.mark.slow
def test_conformance_subset_against_real_llamacpp(tmp_path: Path) -> None:
    why = _llamacpp_missing()
    if why:
        pytest.skip(f"llama-server is not available here: {why}")
    cmd = [sys.executable, "-m", "pytest", "suites/conformance", "-p", "no:cacheprovider", "-q", "-rs",
           "--engine", f"server:preset=llamacpp,log_dir={tmp_path / 'logs'}", "--kvbench-expectations", "llamacpp",
           "-k", SUBSET, "--report-dir", str(tmp_path / "reports"), "--timeout", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    tail = "\n".join(done.stdout.splitlines()[-40:])
    assert done.returncode == 0, f"{' '.join(cmd)}\nexited {done.returncode}:\n{tail}\n{done.stderr[-2000:]}"
    records = json.loads(next((tmp_path / "reports").glob("*/results.json")).read_text())["conformance"]
    assert records, f"no conformance record was written:\n{tail}"
    undecided = [(r["check"], r["reason"]) for r in records if r["outcome"] == "skipped"]
    assert not undecided, f"checks llama.cpp can be decided on were skipped: {undecided}"
    outcomes = {r["check"]: r["outcome"] for r in records}
    assert outcomes.get("prefix_caching_equivalence_and_hits") == "passed", outcomes
    assert (next(r for r in records if r["check"] == "prefix_caching_equivalence_and_hits")["evidence"] or {}).get(
        "prefix_cache_hits", 0) > 0, "the prefix-cache hits were not proved from llama.cpp's /metrics"
