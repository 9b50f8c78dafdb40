"""Synthetic traces and results for the tests of metrics, results, report, gate and CLI.

Two kinds of helpers:

* :func:`req` / :func:`make_trace`: hand-built traces whose every figure is known exactly.
* :func:`simulate`: a tiny deterministic paged-KV scheduler (FCFS, preempt the latest admitted
  when the pool runs dry, recompute or swap) that produces realistic-looking traces, and
  :func:`synthetic_results`, a full results file built from it (storm sweep, swap-vs-recompute
  sweep, chunked prefill, prefix caching) for report, gate and CLI tests.
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvbench.bench import metrics
from kvbench.bench.results import Results
from kvbench.core.trace import RequestTrace, StepRecord, Trace


def req(rid: str, arrival: float = 0.0, tokens: Sequence[float] = (), *, prompt_len: int = 10,
        max_tokens: int | None = None, preemptions: Iterable[tuple[float, str]] = (),
        resumes: Iterable[float] = (), finished: float | str | None = "last", reason: str | None = "length",
        recomputed: int = 0, prefix_hits: int = 0, admitted: float | None = None) -> RequestTrace:
    """A request; ``finished="last"`` means at its last token (None: never finished)."""
    tokens = list(tokens)
    if finished == "last":
        finished = tokens[-1] if tokens else None
    return RequestTrace(rid, arrival, prompt_len, max_tokens if max_tokens is not None else len(tokens),
                        admitted=admitted if admitted is not None else arrival, token_times=tokens,
                        preemptions=list(preemptions), resumes=list(resumes), finished=finished,
                        finish_reason=reason if finished is not None else None, recomputed_tokens=recomputed,
                        prefix_hit_tokens=prefix_hits)


def step(t: float, duration: float = 0.01, running: int = 1, waiting: int = 0, *, swapped: int = 0,
         kv: float | None = 0.5, cpu_kv: float | None = None, prefill: int = 0, decode: int = 1,
         preempted: int = 0) -> StepRecord:
    return StepRecord(t, duration, running, waiting, swapped, kv, cpu_kv, prefill, decode, preempted)


def make_trace(*requests: RequestTrace, steps: Sequence[StepRecord] = (), counters: dict | None = None,
               not_exposed: dict | None = None, duration: float = 0.0, engine: str = "eng",
               scenario: str = "scn") -> Trace:
    return Trace(engine, scenario, {r.request_id: r for r in requests}, list(steps), dict(counters or {}),
                 dict(not_exposed or {}), duration)


# --------------------------------------------------------------------------------------------
# a tiny scheduler simulation


@dataclass(eq=False)  # identity, not field equality: membership tests run every step
class _Seq:
    trace: RequestTrace
    generated: int = 0
    computed: int = 0  # tokens whose KV is on the device
    high: int = 0  # most tokens ever computed: computing below it again is recompute
    admitted_at: float = 0.0
    swapped: bool = False

    @property
    def context(self) -> int:
        return self.trace.prompt_len + self.generated


@dataclass
class SimConfig:
    capacity_tokens: int = 2048
    max_num_seqs: int = 16
    budget: int = 512  # max_num_batched_tokens
    chunked: bool = True
    mode: str = "recompute"
    prefix_len: int = 0  # tokens shared by every prompt
    prefix_caching: bool = False
    decode_cost: float = 0.002  # seconds per running sequence per step
    prefill_cost: float = 0.00005  # seconds per prefill token
    swap_cost: float = 0.00002  # seconds per swapped token (each way)
    bytes_per_token: int = 4096
    step_overhead: float = 0.004


@dataclass
class _State:
    cfg: SimConfig
    t: float = 0.0
    waiting: list[_Seq] = field(default_factory=list)
    running: list[_Seq] = field(default_factory=list)
    swapped: list[_Seq] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)

    def bump(self, name: str, by: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by


def simulate(n_requests: int = 40, *, seed: int = 0, rate: float = 40.0, prompt_len: tuple[int, int] = (64, 256),
             max_tokens: tuple[int, int] = (16, 48), engine: str = "sim", scenario: str = "storm",
             **config: object) -> Trace:
    """Serve a seeded Poisson workload on a simulated paged-KV engine and return its trace."""
    cfg = SimConfig(**config)  # type: ignore[arg-type]
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(n_requests):
        t += rng.expovariate(rate)
        r = RequestTrace(f"r{i}", round(t, 6), rng.randint(*prompt_len), rng.randint(*max_tokens))
        arrivals.append(_Seq(r))
    trace = Trace(engine, scenario, {s.trace.request_id: s.trace for s in arrivals})
    st = _State(cfg, counters={"preemptions_recompute": 0, "preemptions_swap": 0, "recomputed_tokens": 0,
                               "computed_tokens": 0})
    pending = list(arrivals)
    while pending or st.waiting or st.running or st.swapped:
        while pending and pending[0].trace.arrival <= st.t:
            st.waiting.append(pending.pop(0))
        if not (st.waiting or st.running or st.swapped):
            st.t = pending[0].trace.arrival
            continue
        trace.steps.append(_step(st))
        if len(trace.steps) > 200_000:
            raise RuntimeError("simulation does not terminate: a request cannot fit the pool")
    trace.counters = st.counters
    trace.duration = st.t
    return trace


def _used(st: _State) -> int:
    return sum(s.computed + 1 for s in st.running)


def _step(st: _State) -> StepRecord:
    cfg = st.cfg
    swap_time = 0.0
    preempted = 0
    # resume swapped first (vLLM order), then admit waiting, while the pool and max_num_seqs allow
    for queue in (st.swapped, st.waiting):
        while queue and len(st.running) < cfg.max_num_seqs:
            s = queue[0]
            need = s.context + 1 if queue is st.swapped else min(s.context, cfg.budget) + 1
            if _used(st) + need > cfg.capacity_tokens:
                break
            queue.pop(0)
            if s.trace.admitted is None:
                s.trace.admitted = st.t
            if s.swapped:
                swap_time += s.computed * cfg.swap_cost
                st.bump("swap_ins")
                st.bump("swapped_in_bytes", s.computed * cfg.bytes_per_token)
                s.swapped = False
                s.trace.resumes.append(st.t)
            elif s.trace.preemptions:
                s.trace.resumes.append(st.t)
            st.running.append(s)
    # schedule: prefill catches up within the budget, running decodes take one token each
    budget = cfg.budget
    prefill_tokens = 0
    for s in st.running:
        missing = s.context - s.computed
        if missing > 0:
            if cfg.prefix_caching and s.computed == 0:
                st.bump("prefix_cache_queries", s.context)
                if st.counters["computed_tokens"] > 0:
                    # the shared prefix was computed before and stays cached (also after a preemption)
                    hit = min(cfg.prefix_len, missing - 1)
                    s.computed += hit
                    s.trace.prefix_hit_tokens += hit
                    st.bump("prefix_cache_hits", hit)
                    missing -= hit
            # unchunked: a whole prefill or nothing (one over-budget prefill may run alone)
            take = min(missing, budget) if cfg.chunked else (missing if missing <= budget or budget == cfg.budget
                                                              else 0)
            if take <= 0:
                continue
            budget -= take
            prefill_tokens += take
            recompute = max(0, min(s.computed + take, s.high) - s.computed)
            if recompute:
                st.bump("recomputed_tokens", recompute)
                s.trace.recomputed_tokens += recompute
            s.computed += take
            s.high = max(s.high, s.computed)
            st.bump("prefill_chunks")
    decoders = [s for s in st.running if s.computed >= s.context]
    # growing by one token each may overflow the pool: preempt the latest admitted until it fits
    while _used(st) + len(decoders) > cfg.capacity_tokens and len(st.running) > 1:
        victim = st.running.pop()
        preempted += 1
        st.bump(f"preemptions_{cfg.mode}")
        victim.trace.preemptions.append((st.t, cfg.mode))
        if cfg.mode == "swap":
            swap_time += victim.computed * cfg.swap_cost
            st.bump("swap_outs")
            st.bump("swapped_out_bytes", victim.computed * cfg.bytes_per_token)
            victim.swapped = True
            st.swapped.append(victim)
        else:
            victim.computed = 0
            st.waiting.insert(0, victim)
        if victim in decoders:
            decoders.remove(victim)
    duration = (cfg.step_overhead + cfg.prefill_cost * prefill_tokens + cfg.decode_cost * len(st.running)
                + swap_time)
    st.t = round(st.t + duration, 9)
    st.bump("computed_tokens", prefill_tokens + len(decoders))
    if swap_time:
        st.bump("swap_seconds", swap_time)
    decoding = {id(s) for s in decoders}
    for s in [*decoders, *(x for x in st.running if id(x) not in decoding and x.computed >= x.context)]:
        s.generated += 1
        s.computed = s.context  # simplification: the new token's KV counts as computed at once
        s.high = max(s.high, s.computed)
        s.trace.token_times.append(st.t)
        if s.generated >= s.trace.max_tokens:
            s.trace.finished, s.trace.finish_reason = st.t, "length"
    st.running = [s for s in st.running if s.trace.finished is None]
    cap = cfg.capacity_tokens
    cpu_usage = min(1.0, sum(s.computed for s in st.swapped) / cap)
    return StepRecord(st.t, duration, len(st.running), len(st.waiting), len(st.swapped),
                      min(1.0, _used(st) / cap), cpu_usage, prefill_tokens, len(decoders), preempted)


# --------------------------------------------------------------------------------------------
# a full results file


def synthetic_results(*, engines: Sequence[str] = ("reference", "other"), seed: int = 0,
                      slos: str = "ttft<=0.5,tbt<=0.1") -> Results:
    """A results file shaped like a full benchmark run, from simulated traces (a fresh copy each call).

    For a slower or faster run use :func:`scaled`; for names with markup in them, :func:`relabel`.
    """
    # simulating takes seconds on a shared 2-core machine: build each variant once per process
    return Results(copy.deepcopy(_synthetic_data(tuple(engines), seed, slos)))


@functools.lru_cache(maxsize=4)
def _synthetic_data(engines: tuple[str, ...], seed: int, slos: str) -> dict:
    res = Results(device="cpu (synthetic)")
    speed = {"decode_cost": 0.002, "prefill_cost": 0.00005, "step_overhead": 0.004}
    for i, eng in enumerate(engines):
        slower = 1.0 + 0.3 * i  # the second engine is 30% slower, so ratios show up
        cost = {k: v * slower for k, v in speed.items()}
        res.add_engine({"name": eng, "kind": eng, "options": {"max_num_seqs": "16"},
                        "capabilities": ["recompute", "swap", "prefix_caching", "chunked_prefill"]})
        storm = "preemption_storm"
        tr = simulate(60, seed=seed, rate=80, engine=eng, scenario=storm, capacity_tokens=3000,
                      max_num_seqs=24, prompt_len=(32, 160), max_tokens=(64, 160), **cost)
        res.add_trace(tr, slos=slos, checks={"preemptions happened": True}, notes=[f"note for {eng}"],
                      parameters={"num_gpu_blocks": 187, "block_size": 16, "max_num_seqs": 24},
                      description="concurrency swept past capacity")
        for conc in (2, 4, 8, 16, 32):
            sweep_tr = simulate(40, seed=seed + conc, rate=200, engine=eng, scenario=storm, capacity_tokens=3000,
                                max_num_seqs=conc, **cost)
            m = metrics.summarize(sweep_tr)
            res.add_sweep_point(storm, "concurrency", conc, eng, m, mode="recompute",
                                x_label="max_num_seqs")
        for mode in ("recompute", "swap"):
            for seq_len in (128, 256, 512, 1024, 2048):
                prefill = cost["prefill_cost"] * seq_len * 1.2
                swap = 0.012 + seq_len * 0.000018 * slower
                res.add_sweep_point("swap_vs_recompute", "seq_len", seq_len, eng,
                                    {"cost_s": prefill if mode == "recompute" else swap}, mode=mode,
                                    x_label="sequence length (tokens)")
        for mode, chunked in (("chunked", True), ("unchunked", False)):
            tr = simulate(30, seed=seed, rate=60, engine=eng, scenario="chunked_prefill_stalls", prompt_len=(200, 900),
                          chunked=chunked, budget=256 if chunked else 4096, capacity_tokens=20000, **cost)
            res.add_trace(tr, mode=mode, slos=slos)
        for mode, caching in (("prefix_caching", True), ("no_prefix_caching", False)):
            tr = simulate(40, seed=seed, rate=120, engine=eng, scenario="prefix_caching_recompute",
                          prompt_len=(300, 400), max_tokens=(32, 96), prefix_len=256, prefix_caching=caching,
                          capacity_tokens=4000, **cost)
            res.add_trace(tr, mode=mode, slos=slos)
    return res.to_dict()


_FASTER_IS_HIGHER = ("output_throughput", "total_throughput", "request_throughput", "goodput_rps")


def scaled(results: Results, speed: float) -> Results:
    """A copy whose engines look ``speed`` times as fast: throughputs x speed, latencies / speed.

    Cheaper than simulating again when a test needs a second run that differs only in speed.
    """
    data = copy.deepcopy(results.to_dict())

    def scale(m: dict) -> None:
        for k, v in m.items():
            if v is None or isinstance(v, bool):
                continue
            if k in _FASTER_IS_HIGHER:
                m[k] = v * speed
            elif k.split("_")[0] in ("ttft", "tbt", "tpot", "e2e", "starvation") or k == "cost_s":
                m[k] = v / speed

    for sc in data["scenarios"]:
        for res in sc["results"]:
            scale(res["metrics"])
        for sw in sc["sweeps"]:
            for p in sw["points"]:
                scale(p["metrics"])
    return Results(data)


def relabel(results: Results, suffix: str) -> Results:
    """A copy with ``suffix`` appended to every engine, scenario, mode and sweep label."""
    data = copy.deepcopy(results.to_dict())
    for e in data["engines"]:
        e["name"] += suffix
    for sc in data["scenarios"]:
        sc["name"] += suffix
        sc["description"] += suffix
        for item in [*sc["results"], *(p for sw in sc["sweeps"] for p in sw["points"])]:
            item["engine"] += suffix
            if item.get("mode"):
                item["mode"] += suffix
        for sw in sc["sweeps"]:
            sw["x_label"] += suffix
    return Results(data)
