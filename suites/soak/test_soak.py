"""Soak: long runs that a leak, a lost request or a pool that drifts would fail, in-process and over HTTP.

Marked ``soak`` and skipped unless ``--soak`` is given, so neither ``pytest`` nor ``.ci/run`` runs
them::

    pytest suites/soak --soak -s                      # both; -s shows the figures
    pytest suites/soak --soak --soak-minutes 2 -k http

**4x overload**, in both tests: four times ``max_num_seqs`` requests are in flight (arrived, not yet
finished) whenever the arrivals allow, and the device KV pool holds a quarter of what ``max_num_seqs``
running requests of average length need. The arrivals are Poisson at a rate above what the engine
can serve, held back only by that in-flight cap: the engine is always overloaded, yet its queue stays
bounded, so memory measured in the last quarter is comparable with the first (a queue that grew
without bound would grow memory legitimately and hide a leak, or fake one).

Checks (each a way to fail): every request finishes exactly once (nothing lost, nothing finished
twice); a request not aborted gets exactly the tokens of an unpressured run, an aborted one a prefix
of them; the aborts and the preemptions of the mode provably happened; at the end the pool is whole
(every block free, invariants hold, no request left); resident memory of the engine's process grows
less than 5% from the first quarter of the run to the last (:func:`suites.soak.procfs.growth`); over
HTTP, also the server's open sockets return to their level before the load, and its thread count ends
no higher than in the first quarter.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from suites.soak.procfs import growth, rss_bytes, socket_count, thread_count, tree_total

pytestmark = pytest.mark.soak

BLOCK_SIZE = 16
MAX_NUM_SEQS = 8
OVERLOAD = 4
ABORT_FRACTION = 0.10
PROMPT_LEN = (8, 64)
OUTPUT_LEN = (4, 24)
MAX_RSS_GROWTH = 0.05
#: in-process, per preemption mode; KVBENCH_SOAK_REQUESTS overrides it (a quicker rehearsal)
NUM_REQUESTS = int(os.environ.get("KVBENCH_SOAK_REQUESTS", "1000"))


def _pool_blocks() -> int:
    """A quarter of the KV that MAX_NUM_SEQS requests of average length need (but room for the largest)."""
    mean_tokens = sum(PROMPT_LEN) / 2 + sum(OUTPUT_LEN) / 2
    need = MAX_NUM_SEQS * -(-int(mean_tokens) // BLOCK_SIZE)
    largest = -(-(PROMPT_LEN[1] + OUTPUT_LEN[1]) // BLOCK_SIZE)
    return max(need // OVERLOAD, largest)


@dataclass(frozen=True)
class SoakRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    aborted_after: int | None  # abort after this many engine steps (in-process) or tokens received (HTTP)


def make_requests(n: int, vocab: int, seed: int) -> list[SoakRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_LEN))]
        aborted_after = rng.randint(1, 12) if rng.random() < ABORT_FRACTION else None
        out.append(SoakRequest(f"soak-{i}", prompt, rng.randint(*OUTPUT_LEN), aborted_after))
    return out


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from kvbench.models.builtin import builtin_checkpoint

    return str(builtin_checkpoint("tiny"))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The benchmarks' thread policy (KVBENCH_TORCH_THREADS, else 1): on a shared 2-core machine spinning
    OpenMP threads made tiny-model steps several times slower."""
    from kvbench.bench.threads import pinned_torch_threads

    with pinned_torch_threads("quick") as threads:
        yield threads


@pytest.fixture(scope="module")
def in_process_case(tiny_model: str) -> tuple[list[SoakRequest], dict[str, list[int]]]:
    """The in-process soak's requests and their unpressured outputs, shared by both modes."""
    from kvbench.bench.threads import pinned_torch_threads

    requests = make_requests(NUM_REQUESTS, 512, seed=7)
    with pinned_torch_threads("quick"):
        return requests, _unpressured(tiny_model, requests)


def _engine(model: str, **overrides):
    from reference_engine import EngineConfig, LLMEngine

    config = dict(model=model, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS, device="cpu")
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def _unpressured(model: str, requests: list[SoakRequest]) -> dict[str, list[int]]:
    """Greedy outputs with a pool roomy enough that nothing is preempted."""
    from reference_engine import SamplingParams

    engine = _engine(model, num_gpu_blocks_override=4096)
    outs = engine.generate([r.prompt for r in requests],
                           [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                            for r in requests])
    assert engine.counters().preemptions_recompute + engine.counters().preemptions_swap == 0
    return {r.request_id: o.token_ids for r, o in zip(requests, outs, strict=True)}


def _check_outputs(requests: list[SoakRequest], finals: dict[str, list[tuple[str, list[int]]]],
                   aborted: set[str], expected: dict[str, list[int]]) -> None:
    """Nothing lost, nothing finished twice, unaborted == unpressured, aborted = a prefix of it."""
    ids = {r.request_id for r in requests}
    assert set(finals) == ids, f"lost: {sorted(ids - set(finals))[:10]}"
    twice = {rid: len(f) for rid, f in finals.items() if len(f) != 1}
    assert not twice, f"finished more than once: {twice}"
    wrong, not_prefix, bad_reason = [], [], []
    for rid, ((reason, tokens),) in finals.items():
        if rid in aborted:
            bad_reason += [rid] if reason != "abort" else []
            not_prefix += [rid] if tokens != expected[rid][:len(tokens)] else []
        else:
            bad_reason += [rid] if reason != "length" else []
            wrong += [rid] if tokens != expected[rid] else []
    assert not bad_reason, f"wrong finish reasons: {bad_reason[:10]}"
    assert not wrong, f"outputs differ from the unpressured run: {wrong[:10]}"
    assert not not_prefix, f"aborted outputs are not a prefix of the unpressured ones: {not_prefix[:10]}"
    assert aborted, "no request was aborted in flight: the aborts proved nothing"


# --------------------------------------------------------------------------------------------
# (a) in-process


MODES = {"recompute": {"preemption_mode": "recompute"},
         # a host pool of half the device pool: swaps, and falls back to recompute when it is full
         "swap": {"preemption_mode": "swap", "num_cpu_blocks_override": _pool_blocks() // 2}}


@pytest.mark.parametrize("mode", list(MODES))
def test_in_process_soak(mode: str, tiny_model: str, in_process_case, record_property):
    from reference_engine import SamplingParams

    engine = _engine(tiny_model, num_gpu_blocks_override=_pool_blocks(), **MODES[mode])
    assert engine.model.config.vocab_size == 512, "the requests are drawn for the tiny model's vocabulary"
    requests, expected = in_process_case
    rng = random.Random(11)
    # Poisson arrivals, in engine steps, at 4x what a full batch finishes per step
    rate = OVERLOAD * MAX_NUM_SEQS / (sum(OUTPUT_LEN) / 2)
    arrivals, t = [], 0.0
    for _ in requests:
        t += rng.expovariate(rate)
        arrivals.append(int(t))
    finals: dict[str, list[tuple[str, list[int]]]] = {}
    aborted: set[str] = set()
    abort_due: dict[int, list[str]] = {}
    in_flight: set[str] = set()
    rss: list[int] = []
    nxt, step, started = 0, 0, time.monotonic()
    max_steps = NUM_REQUESTS * OUTPUT_LEN[1] * 4  # a watchdog far above any honest run
    while nxt < len(requests) or in_flight:
        while nxt < len(requests) and arrivals[nxt] <= step and len(in_flight) < OVERLOAD * MAX_NUM_SEQS:
            r = requests[nxt]
            engine.add_request(r.request_id, r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                      ignore_eos=True))
            in_flight.add(r.request_id)
            if r.aborted_after is not None:
                abort_due.setdefault(step + r.aborted_after, []).append(r.request_id)
            nxt += 1
        for rid in abort_due.pop(step, []):
            if engine.abort_request(rid):  # False: it had finished already, and is not counted as aborted
                aborted.add(rid)
        for out in engine.step().outputs:
            if out.finished:
                finals.setdefault(out.request_id, []).append((out.finish_reason, list(out.token_ids)))
                in_flight.discard(out.request_id)
        rss.append(rss_bytes() or 0)
        step += 1
        assert step < max_steps, f"{len(in_flight)} requests still unfinished after {step} steps"
    seconds = time.monotonic() - started
    _check_outputs(requests, finals, aborted, expected)
    counters = engine.counters()
    preemptions = counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute
    assert preemptions > 0, f"no {mode} preemption: the pool was never under pressure"
    if mode == "swap":
        assert counters.swap_ins > 0
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks, \
        "blocks still held after every request finished"
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()
    assert len(engine.events) <= engine.config.max_events
    rss_growth = growth([float(x) for x in rss]) if all(rss) else None
    figures = {"mode": mode, "requests": NUM_REQUESTS, "aborted": len(aborted), "steps": step,
               "seconds": round(seconds, 1), "preemptions": preemptions, "swap_fallbacks": counters.swap_fallbacks,
               "pool_blocks": bm.num_gpu_blocks,
               "rss_mib_first_quarter_max": round(max(rss[:len(rss) // 4]) / 2**20, 1),
               "rss_growth_pct": None if rss_growth is None else round(100 * rss_growth, 2)}
    record_property("soak", figures)
    print(f"\nsoak in-process {json.dumps(figures)}")
    if rss_growth is None:
        pytest.skip("no /proc/self/statm: resident memory not measured")
    assert rss_growth < MAX_RSS_GROWTH, f"resident memory grew {100 * rss_growth:.1f}% (limit 5%): {figures}"


# --------------------------------------------------------------------------------------------
# (b) over HTTP


PROMPT_POOL = 120  # distinct requests cycled by the HTTP load (their unpressured outputs computed once)


async def _one_request(client, base: str, r: SoakRequest) -> tuple[str, list[int], bool]:
    """Stream one completion; returns (finish reason or "client-abort", tokens received, aborted by us)."""
    body = {"prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    tokens: list[int] = []
    reason = None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, f"HTTP {resp.status_code}: {await resp.aread()}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                tokens += choice.get("token_ids") or []
                reason = choice.get("finish_reason") or reason
            if r.aborted_after is not None and len(tokens) >= min(r.aborted_after, r.max_tokens - 1):
                return "client-abort", tokens, True  # leaving the block closes the connection: the server aborts
    return reason or "none", tokens, False


async def _drive(base: str, requests: list[SoakRequest], minutes: float, server_pid: int, samples: dict) -> dict:
    import httpx

    rng = random.Random(5)
    deadline = time.monotonic() + minutes * 60
    sem = asyncio.Semaphore(OVERLOAD * MAX_NUM_SEQS)
    results: list[tuple[SoakRequest, str, list[int], bool]] = []
    errors: list[str] = []
    tasks: set[asyncio.Task] = set()
    max_requests = int(minutes * 60 * 50) + 100  # a bound on the count, far above what 2 cores serve

    async def run(r: SoakRequest) -> None:
        try:
            reason, tokens, by_us = await _one_request(client, base, r)
            results.append((r, reason, tokens, by_us))
        except Exception as e:  # every failure is a finding: it is asserted on below
            errors.append(f"{r.request_id}: {type(e).__name__}: {e}")
        finally:
            sem.release()

    async def sample() -> None:
        while True:
            # The whole process tree: the reference server steps its engine in a child process.
            for key, reader in (("rss", rss_bytes), ("sockets", socket_count), ("threads", thread_count)):
                samples[key].append(tree_total(reader, server_pid))
            await asyncio.sleep(1.0)

    limits = httpx.Limits(max_connections=OVERLOAD * MAX_NUM_SEQS + 4, max_keepalive_connections=8)
    sampler = asyncio.create_task(sample())
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        sent = 0
        while time.monotonic() < deadline and sent < max_requests:
            await asyncio.sleep(rng.expovariate(50.0))  # Poisson arrivals, faster than 2 cores serve
            await sem.acquire()  # ... held back by the in-flight cap (4 x max_num_seqs)
            base_req = requests[sent % len(requests)]
            r = SoakRequest(f"{base_req.request_id}#{sent}", base_req.prompt, base_req.max_tokens,
                            base_req.aborted_after)
            task = asyncio.create_task(run(r))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
    await asyncio.sleep(2.0)  # let the server notice the closed connections
    sampler.cancel()
    return {"results": results, "errors": errors, "sent": sent}


def _metrics(base: str) -> list[tuple[str, dict[str, str], float]]:
    """The server's /metrics as (name, labels, value) samples."""
    import httpx

    samples = []
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(",") if "=" in p)
        samples.append((name, {k: v.strip('"') for k, v in pairs.items()}, float(value)))
    return samples


def _metric(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))


@pytest.mark.server
@pytest.mark.parametrize("mode", list(MODES))
def test_http_soak(mode: str, tiny_model: str, soak_minutes: float, tmp_path: Path, record_property):
    from kvbench.launch.process import ServerProcess, free_port

    minutes = soak_minutes / len(MODES)  # --soak-minutes is the HTTP soak's total, split over the modes
    requests = make_requests(PROMPT_POOL, 512, seed=9)
    expected = _unpressured(tiny_model, requests)
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in MODES[mode].items()]
    server = ServerProcess([sys.executable, "-m", "reference_engine.serve", "--model", tiny_model, "--host",
                            "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK_SIZE), "--max-num-seqs",
                            str(MAX_NUM_SEQS), "--num-gpu-blocks-override", str(_pool_blocks()), *flags],
                           tmp_path / "server.log", env={**os.environ, "OMP_NUM_THREADS": "1"})
    server.start()
    try:
        base = f"http://127.0.0.1:{port}"
        server.wait_healthy(base, timeout=120)
        pid = server.proc.pid
        sockets_before, threads_before = tree_total(socket_count, pid), tree_total(thread_count, pid)
        samples: dict[str, list] = {"rss": [], "sockets": [], "threads": []}
        started = time.monotonic()
        run = asyncio.run(_drive(base, requests, minutes, pid, samples))
        seconds = time.monotonic() - started
        assert not run["errors"], f"{len(run['errors'])} requests failed: {run['errors'][:5]}"
        finals = {r.request_id: [("abort" if by_us else reason, tokens)] for r, reason, tokens, by_us in run["results"]}
        assert len(run["results"]) == run["sent"], "requests went missing"
        aborted = {r.request_id for r, _, _, by_us in run["results"] if by_us}
        sent_requests = [r for r, *_ in run["results"]]
        by_base = {rid.partition("#")[0]: toks for rid, toks in expected.items()}
        _check_outputs(sent_requests, finals, aborted,
                       {r.request_id: by_base[r.request_id.partition("#")[0]] for r in sent_requests})
        # the server's view: every request finished exactly once, the aborts reached the engine, pool whole
        deadline = time.monotonic() + 30
        while True:
            m = _metrics(base)
            finished = _metric(m, "vllm:request_success_total")
            if finished >= run["sent"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert finished == run["sent"], f"the server finished {finished:.0f} requests, {run['sent']} were sent"
        server_aborts = _metric(m, "vllm:request_success_total", finished_reason="abort")
        assert 1 <= server_aborts <= len(aborted), \
            f"server counted {server_aborts:.0f} aborts for {len(aborted)} client disconnects"
        assert _metric(m, "vllm:num_requests_running") == 0 and _metric(m, "vllm:num_requests_waiting") == 0
        assert _metric(m, "reference_engine:num_requests_swapped") == 0
        assert _metric(m, "reference_engine:num_free_gpu_blocks") == _metric(m, "reference_engine:num_gpu_blocks"), \
            "device blocks still held after every request finished"
        assert _metric(m, "reference_engine:cpu_cache_usage_perc") == 0
        preemptions = _metric(m, f"reference_engine:preemptions_{mode}_total")
        assert preemptions > 0, f"no {mode} preemption over HTTP: the pool was never under pressure"
        # leaks: memory, connections, threads
        for _ in range(20):  # closed connections take a moment to leave the server's table
            sockets_after = tree_total(socket_count, pid)
            if sockets_after is not None and sockets_before is not None and sockets_after <= sockets_before:
                break
            time.sleep(0.5)
        threads_after = tree_total(thread_count, pid)
        rss = [float(x) for x in samples["rss"] if x]
        quarter_threads = [t for t in samples["threads"][: max(1, len(samples["threads"]) // 4)] if t]
        figures = {"mode": mode, "minutes": round(seconds / 60, 2), "requests": run["sent"], "aborted": len(aborted),
                   "preemptions": preemptions, "server_rss_mib_first_quarter_max":
                   round(max(rss[: len(rss) // 4]) / 2**20, 1) if len(rss) >= 4 else None,
                   "rss_growth_pct": round(100 * growth(rss), 2) if len(rss) >= 4 else None,
                   "sockets_before": sockets_before, "sockets_peak": max((s for s in samples["sockets"] if s),
                                                                         default=None),
                   "sockets_after": sockets_after, "threads_before": threads_before,
                   "threads_first_quarter_max": max(quarter_threads, default=None), "threads_after": threads_after}
        record_property("soak", figures)
        print(f"\nsoak http {json.dumps(figures)}")
        if sockets_before is None or len(rss) < 4:
            pytest.skip("no /proc for the server: memory, sockets and threads not measured")
        assert sockets_after <= sockets_before, f"the server holds {sockets_after - sockets_before} more sockets"
        assert threads_after <= max(quarter_threads), f"the server's threads grew: {figures}"
        assert growth(rss) < MAX_RSS_GROWTH, f"the server's resident memory grew {100 * growth(rss):.1f}%: {figures}"
    finally:
        server.stop()
        assert not server.running()
