"""One mechanism each, on and off, side by side: prefix caching under recompute, chunked prefill
and decode stalls, priority scheduling of online beside offline work."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbench.bench.formatting import fmt_metric, fmt_noisy_ratio, fmt_time
from kvbench.bench.metrics import per_request_preemptions_known, step_tokens_known
from kvbench.bench.scenarios.claims import (
    DID_NOT_FIRE,
    Decision,
    count_claim,
    decide,
    held,
    not_exposed,
    not_reached,
    not_shown,
    preemption_total,
    pressure,
    resting_on,
    shown,
)
from kvbench.bench.scenarios.common import (
    BLOCK_SIZE,
    Job,
    Model,
    Outcome,
    ResultEntry,
    Scenario,
    Served,
    all_finished,
    build_workload,
    describe_spec,
    percentile,
    ttft_by,
)
from kvbench.bench.scenarios.declare import (
    NOISE_FLOOR_S,
    Headline,
    Pressure,
    Score,
    engines_reference_first,
    metric_of,
    noise_words,
    num,
    ratio_noise,
    result_of,
    within_noise,
)
from kvbench.bench.workloads import (
    AllAtOnce,
    ClosedLoop,
    Fixed,
    Poisson,
    Priorities,
    SharedPrefix,
    Uniform,
    WorkloadSpec,
    combine,
)
from kvbench.core.trace import Trace
from kvbench.engines.base import Knobs

# --------------------------------------------------------------------------------------------
# 5. prefix caching and recompute


@dataclass(frozen=True)
class PrefixSize:
    spec: WorkloadSpec  # shared system prompt, closed loop past capacity
    num_gpu_blocks: int


class PrefixCachingRecompute(Scenario):
    name = "prefix_caching_recompute"
    title = "Prefix caching and recompute"
    description = ("Every request starts with the same system prompt; closed-loop concurrency past capacity, "
                   "preemption by recompute, with and without prefix caching (a recompute that "
                   "hits the cached prefix only redoes the tail). Claims: without caching the "
                   "engine preempted and recomputed; with caching the shared prompt hit the cache and fewer tokens "
                   "were recomputed (caching also shrinks what each request holds, so it may preempt less).")
    needs = ("prefix_caching", "recompute")
    engine_mode_matters = False
    sizes = {  # noqa: RUF012
        "quick": PrefixSize(WorkloadSpec("prefix", 32, Uniform(32, 96), Fixed(64), ClosedLoop(12),
                                         shared_prefix=SharedPrefix(1, 256), seed=5), num_gpu_blocks=96),
        "full": PrefixSize(WorkloadSpec("prefix", 36, Uniform(32, 128), Fixed(96), ClosedLoop(16),
                                        shared_prefix=SharedPrefix(1, 512), seed=5), num_gpu_blocks=224),
    }
    modes = ("no_prefix_caching", "prefix_caching")
    pressure = Pressure(preemptions=True, kv_pinned=True, forced_mode="recompute")
    score = Score("recomputed_tokens", False, mode="prefix_caching", label="tokens recomputed with caching",
                  why="the scenario asks how much work a preemption throws away once the shared prefix is cached")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        workload = build_workload(s.spec, model)
        return [Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks, preemption_mode="recompute",
                                    enable_prefix_caching=mode == "prefix_caching"), mode=mode)
                for mode in self.modes]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "workload": describe_spec(s.spec), "preemption_mode": "recompute"}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        by_mode = {sv.job.mode: sv for sv in served}
        off, on = by_mode["no_prefix_caching"].metrics, by_mode["prefix_caching"].metrics
        for sv in served:
            out.entries.append(ResultEntry(sv.trace, mode=sv.job.mode))
        decide(out, prefix_decisions(off, on))
        out.claims["every request finished"] = all(all_finished(sv.trace) for sv in served)
        if off["recomputed_tokens"] and on["recomputed_tokens"] is not None:
            out.notes.append(f"prefix caching recomputed {on['recomputed_tokens']:,.0f} tokens against "
                             f"{off['recomputed_tokens']:,.0f} without "
                             f"({1 - on['recomputed_tokens'] / off['recomputed_tokens']:.0%} fewer)")
        return out


    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        title = "Recomputed tokens saved by prefix caching"
        for engine in engines_reference_first(recorded, reference):
            on = metric_of(recorded, engine, "recomputed_tokens", "prefix_caching")
            off = metric_of(recorded, engine, "recomputed_tokens", "no_prefix_caching")
            if on is None or off is None:
                continue
            if off == 0:
                return Headline(title, None, f"nothing was recomputed without prefix caching ({engine})")
            # counts, not times: the same requests give the same counts, no timing noise
            return Headline(title, f"{(1 - on / off) * 100:.0f}%", f"fewer tokens recomputed ({engine})",
                            f"{on:,.0f} recomputed with caching vs {off:,.0f} without")
        return Headline(title, None, "needs results with and without prefix caching")


def prefix_decisions(off: Mapping[str, float | None], on: Mapping[str, float | None]) -> dict[str, Decision]:
    """Claims of the prefix-caching scenario from the metrics without (``off``) and with (``on``) caching: going
    past capacity without caching is the workload's pressure; recomputing, hitting the cache and saving
    recomputation are the mechanisms, read from the engine's counters over each run."""
    rec_off, rec_on = off.get("recomputed_tokens"), on.get("recomputed_tokens")
    past = pressure(count_claim(off.get("preemptions"), "preemption"))
    recomputed = resting_on(count_claim(rec_off, "recomputed-token"), past)
    return {
        "without caching, the closed loop went past capacity (preemptions)": past,
        "without caching, preempted work was recomputed": recomputed,
        "with caching, the shared prompt hit the cache": count_claim(on.get("prefix_cache_hits"), "prefix-cache hit"),
        "caching recomputed fewer tokens": resting_on(
            not_exposed("this engine publishes no recomputed-token counter") if rec_off is None or rec_on is None
            else not_reached("nothing was recomputed without caching, so there was nothing to save") if rec_off == 0
            else shown(f"{rec_on:,.0f} with caching vs {rec_off:,.0f} without") if rec_on < rec_off
            else not_shown(f"{rec_on:,.0f} with caching vs {rec_off:,.0f} without"), past),
    }


def prefix_claims(off: Mapping[str, float | None], on: Mapping[str, float | None]) -> dict[str, bool | None]:
    """:func:`prefix_decisions` as plain verdicts."""
    return held(prefix_decisions(off, on))


# --------------------------------------------------------------------------------------------
# 6. chunked prefill and decode stalls


@dataclass(frozen=True)
class ChunkedSize:
    decoders: WorkloadSpec  # short prompts, long outputs, at t=0
    long_prompts: WorkloadSpec  # long prompts arriving while the decoders run
    long_start_s: float
    budgets: tuple[int, int]  # (the ITL budget, the throughput budget) in tokens per step
    num_gpu_blocks: int
    budget_note: str = ""


class ChunkedPrefillStalls(Scenario):
    name = "chunked_prefill_stalls"
    title = "Chunked prefill and decode stalls"
    description = ("Requests decoding while long prompts arrive. Unchunked, a long prefill takes a whole step and "
                   "every decode waits for it (a TBT spike); chunked, the prefill is split under a token budget "
                   "and decodes ride along every step (a budget of 512 tokens favours inter-token latency, 2048 and "
                   "up throughput). Modes: unchunked, chunked (the small budget), chunked_large (the large one). "
                   "No preemption: the pool is roomy. Claims: unchunked prefilled a long prompt in one step "
                   "beside decodes; chunked split the long prompts and kept every step within its budget.")
    needs = ("chunked_prefill",)
    knobs_needed = ("enable_chunked_prefill",)  # off, for the unchunked mode
    engine_mode_matters = False
    sizes = {  # noqa: RUF012
        "quick": ChunkedSize(
            decoders=WorkloadSpec("decoders", 6, Uniform(16, 32), Fixed(400), AllAtOnce(), seed=6),
            long_prompts=WorkloadSpec("long", 6, Uniform(704, 832), Fixed(4), Poisson(8.0), seed=7),
            long_start_s=0.1, budgets=(128, 512), num_gpu_blocks=512,
            budget_note="512 and 2048 at full scale (3,072-token prompts) scaled by 1/4 to the tiny model's "
                        "768-token prompts: 128 and 512"),
        "full": ChunkedSize(
            decoders=WorkloadSpec("decoders", 10, Uniform(32, 64), Fixed(192), AllAtOnce(), seed=6),
            long_prompts=WorkloadSpec("long", 3, Uniform(2112, 2304), Fixed(4), Poisson(2.0), seed=7),
            long_start_s=1.0, budgets=(512, 2048), num_gpu_blocks=1024,
            budget_note="512 (vLLM's chunked-prefill default, tuned for ITL) and 2048 (its advice for throughput)"),
    }
    modes = ("unchunked", "chunked", "chunked_large")
    pressure = Pressure()  # a roomy pool: any preemption is a deviation
    reads_settings = True  # the budget a server confirms proves its split from outside (chunked_decisions)
    score = Score("tbt_p99", False, mode="chunked", label="p99 TBT, chunked at the small budget",
                  why="chunked prefill exists to keep long prompts from stalling running decodes: the tail gap")

    def budget_of(self, mode: str, scale: str) -> int | None:
        small, large = self.size(scale).budgets
        return {"unchunked": None, "chunked": small, "chunked_large": large}[mode]

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        long_prompts = build_workload(s.long_prompts, model).shifted(s.long_start_s)
        workload = combine(self.name, build_workload(s.decoders, model), long_prompts)
        jobs = []
        for mode in self.modes:
            budget = self.budget_of(mode, scale)
            jobs.append(Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks,
                                            enable_chunked_prefill=budget is not None, max_num_batched_tokens=budget,
                                            enable_prefix_caching=False), mode=mode))
        return jobs

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "decoders": describe_spec(s.decoders),
                "long_prompts": describe_spec(s.long_prompts), "budget_chunked": s.budgets[0],
                "budget_chunked_large": s.budgets[1], "budgets_note": s.budget_note}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        s = self.size(scale)
        out = self.outcome(scale, model)
        long_from = s.long_prompts.input_len.bounds()[0]
        by_mode = {sv.job.mode: sv for sv in served}
        for sv in served:
            budget = self.budget_of(sv.job.mode or "", scale)
            steps = sv.trace.steps
            known = step_tokens_known(sv.trace)  # /metrics samples carry no per-step token counts
            extra = {"budget": float(budget) if budget else None,
                     "max_step_tokens": float(max((st.num_prefill_tokens + st.num_decode_tokens for st in steps),
                                                  default=0)) if known else None,
                     "stall_steps": float(len(stall_steps(sv.trace, long_from))) if known else None}
            out.entries.append(ResultEntry(sv.trace, mode=sv.job.mode, extra=extra))
        decide(out, chunked_decisions(by_mode["unchunked"].trace,
                                      {self.budget_of(m, scale) or 0: by_mode[m].trace for m in self.modes[1:]},
                                      long_from,
                                      {self.budget_of(m, scale) or 0: by_mode[m].settings for m in self.modes[1:]}))
        counts = {sv.job.mode: sv.metrics["preemptions"] for sv in served}
        # a roomy pool is the workload's own condition: a preemption means it was not roomy on this engine
        decide(out, {"no preemption muddied the comparison": pressure(
            not_exposed("this engine publishes no preemption counter") if None in counts.values()
            else shown("0 preemptions in every mode") if not any(counts.values())
            else not_shown("the pool was not roomy on this engine: " + ", ".join(
                f"{n:,.0f} preemptions {mode}" for mode, n in counts.items() if n)))})
        out.claims["every request finished"] = all(all_finished(sv.trace) for sv in served)
        return out


    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        title = "p99 TBT with vs without chunked prefill"
        for engine in engines_reference_first(recorded, reference):
            on_res, off_res = result_of(recorded, engine, "chunked"), result_of(recorded, engine, "unchunked")
            on = num(on_res["metrics"].get("tbt_p99")) if on_res else None
            off = num(off_res["metrics"].get("tbt_p99")) if off_res else None
            if on is None or not off:
                continue
            ratio, noise = on / off, ratio_noise(on_res, off_res, "tbt_p99")
            caption = f"chunked ÷ unchunked p99 TBT ({engine})"
            detail = f"{fmt_time(on)} with chunking vs {fmt_time(off)} without · {noise_words(noise)}"
            if max(on, off) < NOISE_FLOOR_S or within_noise(ratio, noise):
                return Headline(title, "within noise", f"{caption}: {fmt_noisy_ratio(ratio, noise)}", detail,
                                within_noise=True)
            return Headline(title, fmt_noisy_ratio(ratio, noise), caption, detail)
        return Headline(title, None, "needs results in modes 'chunked' and 'unchunked'")


def stall_steps(trace: Trace, long_from: int) -> list[int]:
    """Indexes of steps that prefilled at least ``long_from`` tokens while other requests decoded."""
    return [i for i, s in enumerate(trace.steps) if s.num_prefill_tokens >= long_from and s.num_decode_tokens > 0]


#: why a claim about the make-up of engine steps stays open on an engine reached from outside
NO_STEPS = ("a client sees no engine step's make-up: this engine's step records are /metrics samples, which carry "
            "no per-step token counts")


def split_from_outside(trace: Trace, settings: Mapping[str, Any]) -> Decision:
    """"Long prompts were split into chunks" for an engine that counts no prefill chunks, from what it confirms
    (:meth:`~kvbench.engines.base.EngineAdapter.confirmed_settings`, never what kvbench asked for), as the
    conformance check does (:mod:`kvbench.conformance.chunking`): one step computes at most its token budget
    ``B``, so with chunked prefill on and prefix caching off, a prompt longer than ``B`` that the engine answered
    had its prefill computed in at least ``ceil(L / B)`` steps. Rests on the engine's word for its budget."""
    if settings.get("enable_chunked_prefill") is not True:
        said = settings.get("enable_chunked_prefill")
        return not_exposed("this engine counts no prefill chunks and does not confirm chunked prefill on" if said
                           is None else f"this engine counts no prefill chunks and says enable_chunked_prefill={said}")
    budget = settings.get("max_num_batched_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        return not_exposed("this engine counts no prefill chunks and does not confirm its step's token budget")
    if settings.get("enable_prefix_caching") is not False:
        return not_exposed("this engine counts no prefill chunks and does not confirm prefix caching off (a cached "
                           "prefix could have served part of a long prompt)")
    longer = [r.prompt_len for r in trace.requests.values() if r.token_times and r.prompt_len > budget]
    if not longer:
        return not_reached(f"no answered prompt was longer than the confirmed budget of {budget} tokens")
    pieces = sum(math.ceil(n / budget) - 1 for n in longer)
    return shown(f"the engine confirms chunked prefill at a budget of {budget} tokens and answered {len(longer)} "
                 f"prompts longer than it: at least {pieces} prefill chunks")


def chunked_decisions(unchunked: Trace, chunked: Mapping[int, Trace], long_from: int,
                      settings: Mapping[int, Mapping[str, Any]] | None = None) -> dict[str, Decision]:
    """Claims from the unchunked run and the chunked runs by budget: the engine's own step records where it keeps
    them, its ``prefill_chunks`` counter for the split, else the budget it confirms it ran each chunked run with
    (``settings`` by budget: :func:`split_from_outside`). A claim about per-step token counts is
    :data:`~kvbench.bench.scenarios.claims.NOT_EXPOSED` for a trace whose steps are ``/metrics`` samples."""
    def by_steps(trace: Trace, test: Any, words: str) -> Decision:
        if not step_tokens_known(trace):
            return not_exposed(NO_STEPS)
        return shown(words) if test(trace.steps) else not_shown(f"no engine step: {words}", DID_NOT_FIRE)

    out = {"unchunked: a long prompt was prefilled in one step beside decodes": by_steps(
        unchunked, lambda _: bool(stall_steps(unchunked, long_from)),
        f"a step prefilled >= {long_from} tokens beside decodes")}
    for budget, trace in chunked.items():
        chunks = trace.counters.get("prefill_chunks")
        out[f"budget {budget}: long prompts were split into chunks"] = (
            count_claim(chunks, "prefill-chunk") if chunks is not None
            else split_from_outside(trace, (settings or {}).get(budget, {})))
        known = step_tokens_known(trace)
        over = [s.num_prefill_tokens + s.num_decode_tokens for s in trace.steps
                if s.num_prefill_tokens + s.num_decode_tokens > budget] if known else []
        out[f"budget {budget}: no step went over the budget"] = (
            not_exposed(NO_STEPS) if not known else shown(f"every one of {len(trace.steps)} steps within {budget}")
            if not over else not_shown(f"{len(over)} steps over {budget} tokens (the largest {max(over)})"))
        out[f"budget {budget}: prefill chunks rode along with decodes"] = by_steps(
            trace, lambda steps: any(s.num_prefill_tokens > 0 and s.num_decode_tokens > 0 for s in steps),
            "a step carried prefill and decode tokens")
    return out


def chunked_claims(unchunked: Trace, chunked: Mapping[int, Trace], long_from: int) -> dict[str, bool | None]:
    """:func:`chunked_decisions` as plain verdicts."""
    return held(chunked_decisions(unchunked, chunked, long_from))


# --------------------------------------------------------------------------------------------
# 7. priority: online traffic beside offline batch work


@dataclass(frozen=True)
class PrioritySize:
    offline: WorkloadSpec  # priority 1, all at t=0: a batch job that fills the pool
    online: WorkloadSpec  # priority 0, Poisson arrivals while the batch runs
    online_start_s: float
    num_gpu_blocks: int


HIGH, LOW = 0, 1  # vLLM's convention: lower is more important


class PriorityOnlineOffline(Scenario):
    name = "priority_online_offline"
    title = "Priority: online beside offline"
    description = ("A batch of offline work (priority 1) fills the pool; online requests (priority 0) arrive while "
                   "it runs (preemption as the means of fairness). Modes: the priority policy, and FCFS "
                   "as the control. Figures: TTFT of each class. Claims: under the priority policy online "
                   "traffic preempted offline work and no online request was preempted for offline work; every "
                   "request finished.")
    needs = ("priority",)
    knobs_needed = ("scheduling_policy",)
    sizes = {  # noqa: RUF012
        "quick": PrioritySize(
            offline=WorkloadSpec("offline", 16, Uniform(192, 320), Fixed(128), AllAtOnce(),
                                 priorities=Priorities((LOW,), (1.0,)), seed=8),
            online=WorkloadSpec("online", 20, Uniform(32, 96), Fixed(32), Poisson(5.0),
                                priorities=Priorities((HIGH,), (1.0,)), seed=9),
            online_start_s=0.3, num_gpu_blocks=96),
        "full": PrioritySize(
            offline=WorkloadSpec("offline", 16, Uniform(256, 448), Fixed(96), AllAtOnce(),
                                 priorities=Priorities((LOW,), (1.0,)), seed=8),
            online=WorkloadSpec("online", 24, Uniform(64, 160), Fixed(32), Poisson(2.0),
                                priorities=Priorities((HIGH,), (1.0,)), seed=9),
            online_start_s=2.0, num_gpu_blocks=160),
    }
    modes = ("priority", "fcfs")
    pressure = Pressure(preemptions=True, kv_pinned=True, starvation=True)
    score = Score("ttft_p50_high", False, mode="priority", label="online p50 TTFT under the priority policy",
                  why="priority scheduling exists to answer online users first while batch work waits")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        online = build_workload(s.online, model).shifted(s.online_start_s)
        workload = combine(self.name, build_workload(s.offline, model), online)
        return [Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks, scheduling_policy=mode),
                    mode=mode) for mode in self.modes]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "offline": describe_spec(s.offline),
                "online": describe_spec(s.online), "online_start_s": s.online_start_s}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        for sv in served:
            out.entries.append(ResultEntry(sv.trace, mode=sv.job.mode, extra=class_figures(sv.trace)))
        prio = next(sv for sv in served if sv.job.mode == "priority")
        fcfs = next(sv for sv in served if sv.job.mode == "fcfs")
        decide(out, priority_decisions(prio.trace))
        decide(out, priority_vs_fcfs_decisions(prio.trace, fcfs.trace))
        out.claims["every request finished"] = all(all_finished(sv.trace) for sv in served)
        return out

    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        title = "Online TTFT: priority vs FCFS"
        for engine in engines_reference_first(recorded, reference):
            prio, fcfs = result_of(recorded, engine, "priority"), result_of(recorded, engine, "fcfs")
            p = num(prio["metrics"].get("ttft_p50_high")) if prio else None
            f = num(fcfs["metrics"].get("ttft_p50_high")) if fcfs else None
            if p is None or f is None:
                continue
            noise = ratio_noise(prio, fcfs, "ttft_p50_high")
            p99p, p99f = (num(r["metrics"].get("ttft_p99_high")) for r in (prio, fcfs))  # type: ignore[index]
            detail = f"p99 {fmt_time(p99p)} vs {fmt_time(p99f)} · {noise_words(noise)}"
            caption = f"online p50 TTFT with priority vs under FCFS ({engine})"
            if max(p, f) < NOISE_FLOOR_S or (f and within_noise(p / f, noise)):
                return Headline(title, "within noise", f"{caption}: {fmt_time(p)} vs {fmt_time(f)}", detail,
                                within_noise=True)
            return Headline(title, f"{fmt_time(p)} vs {fmt_time(f)}", caption, detail)
        return Headline(title, None, "needs the priority run and its FCFS control")

    def tables(self, recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
        rows = []
        for r in recorded.get("results", []):
            if r.get("mode") not in self.modes:
                continue
            m = r["metrics"]
            for cls, label in (("high", "online (priority 0)"), ("low", "offline (priority 1)")):
                rows.append([r["engine"], r["mode"], label,
                             *(fmt_time(num(m.get(f"{k}_{cls}"))) for k in ("ttft_p50", "ttft_p99", "tbt_p50",
                                                                             "tbt_p99")),
                             fmt_metric("preemptions", m.get(f"preemptions_{cls}"))])
        # priority and FCFS of one engine next to each other, class by class
        rows.sort(key=lambda row: (row[0], row[2], row[1] != "priority"))
        return [{"title": "Each class, priority policy vs FCFS", "rows": rows,
                 "columns": ["engine", "policy", "class", "p50 TTFT", "p99 TTFT", "p50 TBT", "p99 TBT",
                             "preempted"],
                 "note": "FCFS is the control run: the same requests, the same pool"}] if rows else []


def class_figures(trace: Trace) -> dict[str, float | None]:
    """TTFT and TBT percentiles, first-token steps and preemptions of each priority class, and the
    high/low TTFT ratio."""
    out: dict[str, float | None] = {}
    for name, level in (("high", HIGH), ("low", LOW)):
        ttfts = ttft_by(trace, lambda r, level=level: r.priority == level)
        gaps = [b - a for r in trace.requests.values() if r.priority == level
                for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
        out[f"ttft_p50_{name}"] = percentile(ttfts, 50)
        out[f"ttft_p99_{name}"] = percentile(ttfts, 99)
        out[f"tbt_p50_{name}"] = percentile(gaps, 50)
        out[f"tbt_p99_{name}"] = percentile(gaps, 99)
        steps = first_token_steps(trace, level)
        out[f"ttft_steps_p50_{name}"] = percentile(steps, 50) if steps is not None else None
        out[f"ttft_steps_p99_{name}"] = percentile(steps, 99) if steps is not None else None
        # None where the per-request records miss preemptions the engine counted (a server over HTTP): never a 0
        # beside a counter that counted some
        out[f"preemptions_{name}"] = float(sum(len(r.preemptions) for r in trace.requests.values()
                                               if r.priority == level)) if per_request_preemptions_known(trace) \
            else None
    hi, lo = out["ttft_p50_high"], out["ttft_p50_low"]
    out["ttft_p50_high_over_low"] = hi / lo if hi is not None and lo else None
    return out


def first_token_steps(trace: Trace, level: int) -> list[float] | None:
    """For each request of priority ``level`` with a token: how many engine steps ended after it arrived
    and up to its first token. A count of steps, not a time, so comparing two runs of the same
    requests does not depend on the machine's speed. None without engine step records: a server's
    records are /metrics samples (``sampled``), taken every poll interval, and counting polls would
    turn the claim into a wall-clock one under another name."""
    if not trace.steps or any(s.sampled for s in trace.steps):
        return None
    ends = sorted(s.t for s in trace.steps)
    return [float(bisect.bisect_right(ends, r.token_times[0]) - bisect.bisect_right(ends, r.arrival))
            for r in trace.requests.values() if r.priority == level and r.token_times]


def priority_vs_fcfs_decisions(priority: Trace, fcfs: Trace) -> dict[str, Decision]:
    """The priority policy against its FCFS control (same requests, same pool): online requests got
    their first token in fewer engine steps, at the median and at p99. Steps, not seconds, so the
    claim does not ride on timing noise; the report shows the TTFTs in seconds beside it."""
    p, f = first_token_steps(priority, HIGH), first_token_steps(fcfs, HIGH)
    out: dict[str, Decision] = {}
    for q in (50, 99):
        pq = percentile(p, q) if p else None
        fq = percentile(f, q) if f else None
        claim = f"online p{q} TTFT (in engine steps) better with priority than under FCFS"
        if p is None or f is None:
            out[claim] = not_exposed("a client sees no engine steps: this engine's step records are /metrics "
                                     "samples, and counting polls would make a wall-clock claim of it")
        elif pq is None or fq is None:
            out[claim] = not_reached("no online request got a first token in one of the runs")
        elif fq <= 1:
            # An FCFS control whose online requests waited at most one step had nothing for a priority
            # policy to win back (the online wave arrived after the offline work, as on a fast engine
            # served on the wall clock): the workload's pressure was not reached, not a failure of the policy.
            out[claim] = not_reached(f"under FCFS online requests waited {fq:g} engine step(s) at p{q}: nothing "
                                     "for a priority policy to win back")
        else:
            words = f"{pq:g} steps with priority vs {fq:g} under FCFS"
            out[claim] = shown(words) if pq < fq else not_shown(words)
    return out


def priority_vs_fcfs_claims(priority: Trace, fcfs: Trace) -> dict[str, bool | None]:
    """:func:`priority_vs_fcfs_decisions` as plain verdicts."""
    return held(priority_vs_fcfs_decisions(priority, fcfs))


def priority_decisions(trace: Trace) -> dict[str, Decision]:
    """Claims of the priority-policy run (per-request preemption records required: which request was
    preempted; a server's counter says how many, not whose). Online traffic preempting offline work is the
    workload's pressure; never preempting online work while offline work ran is the policy."""
    first, second = "online traffic preempted offline work", "no online request was preempted while offline work ran"
    if "preemptions" in trace.not_exposed or "events" in trace.not_exposed:
        total = preemption_total(trace)
        if total == 0:  # none at all, whoever's: the pressure did not come, whatever a client cannot see
            preempted = pressure(count_claim(total, "preemption"))
            return {first: preempted, second: resting_on(not_exposed(""), preempted)}
        why = ("a client sees no preemption per request, so whose work was preempted cannot be told"
               + ("" if total is None else f" (the engine counted {total:,.0f} preemptions in all)"))
        return {first: not_exposed(why), second: not_exposed(why)}
    low = [t for r in trace.requests.values() if r.priority == LOW for t, _ in r.preemptions]
    high = [t for r in trace.requests.values() if r.priority == HIGH for t, _ in r.preemptions]
    preempted = pressure(shown(f"{len(low)} preemptions of offline work") if low
                         else not_shown("no offline request was preempted", DID_NOT_FIRE))
    # A high-priority victim is legitimate only when nothing of low priority was left running.
    wrong = [t for t in high if any(_running_at(r, t) for r in trace.requests.values() if r.priority == LOW)]
    # with no preemption of either class the policy was never put to the test: resting on the pressure
    protected = shown(f"{len(high)} online preemptions, none beside running offline work") if not wrong \
        else not_shown(f"{len(wrong)} online preemptions while offline work ran")
    return {first: preempted, second: protected if wrong or high else resting_on(protected, preempted)}


def priority_claims(trace: Trace) -> dict[str, bool | None]:
    """:func:`priority_decisions` as plain verdicts."""
    return held(priority_decisions(trace))


def _running_at(r: Any, t: float) -> bool:
    """Whether request ``r`` held the engine at ``t``: admitted, not finished, not preempted then."""
    if r.admitted is None or r.admitted > t or (r.finished is not None and r.finished <= t):
        return False
    out_since = [p for p, _ in r.preemptions if p <= t]
    back_since = [x for x in r.resumes if x <= t]
    return len(back_since) >= len(out_since)
