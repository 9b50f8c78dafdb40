"""Swap vs recompute: what one preempt-and-resume costs, by sequence length, in each mode
(docs/benchmarks.md#scenarios)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbench.bench import metrics
from kvbench.bench.formatting import fmt_ratio, fmt_time
from kvbench.bench.scenarios.common import (
    BLOCK_SIZE,
    Job,
    Model,
    Outcome,
    Scenario,
    Served,
    SweepPoint,
    build_workload,
)
from kvbench.bench.scenarios.declare import NOISE_FLOOR_S, Headline, Pressure, num
from kvbench.bench.workloads import (
    AllAtOnce,
    Explicit,
    WorkloadSpec,
)
from kvbench.core.trace import Trace
from kvbench.engines.base import Knobs

# --------------------------------------------------------------------------------------------
# 4. swap vs recompute crossover


@dataclass(frozen=True)
class CrossoverSize:
    lengths: tuple[int, ...]  # the victim's sequence length when it is preempted
    repeats: int
    holder_tokens: int = BLOCK_SIZE  # the holder's prompt fills whole blocks: its first decode needs a block
    holder_outputs: int = 12  # the holder decodes this long (within its second block) before it frees
    victim_outputs: int = 3  # decodes after the resume

    @property
    def num_gpu_blocks(self) -> list[int]:
        """Per length: the holder's block plus the victim's prompt blocks, not one spare."""
        return [1 + math.ceil((length - 1) / BLOCK_SIZE) for length in self.lengths]


class SwapVsRecompute(Scenario):
    name = "swap_vs_recompute"
    title = "Swap vs recompute crossover"
    description = (
        "What one preempt-and-resume costs, by the victim's sequence length L, in each mode ("
        "swap pays copies, recompute pays a prefill). Two requests: a holder (one full block of prompt) and a "
        "victim of L-1 prompt tokens, admitted together into a pool with no spare block, so the holder's first "
        "decode preempts the victim; the victim resumes when the holder finishes. cost_s = (step that preempted "
        "- decode step) + (step that resumed - decode step), from the driver's step times, each the minimum "
        "over repeats (noise only adds time); modes interleaved. Prefix caching and chunked prefill are off so "
        "that recompute redoes all L tokens. Claims: every run preempted and resumed the victim exactly once, "
        "in its mode.")
    needs = ("swap", "recompute", "events")
    knobs_needed = ("enable_chunked_prefill",)
    engine_mode_matters = False
    sizes = {  # noqa: RUF012
        "quick": CrossoverSize(lengths=(8, 16, 32, 64, 128, 256, 512, 1000), repeats=5),
        "full": CrossoverSize(lengths=(8, 16, 32, 64, 128, 256, 512, 1024, 2048), repeats=5),
    }
    modes = ("recompute", "swap")
    pressure = Pressure(preemptions=True, kv_pinned=True)  # both modes forced in turn, one preemption per run
    score = None  # one engine's two modes against each other, not engines against each other

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        jobs = []
        for length in s.lengths:
            check_crossover_length(length, s, model)
            victim_prompt = length - 1  # plus the token its prefill samples = L at preemption
            spec = WorkloadSpec(f"crossover-{length}", 2, Explicit((s.holder_tokens, victim_prompt)),
                                Explicit((s.holder_outputs, 1 + s.victim_outputs)), AllAtOnce(), seed=4)
            blocks = 1 + math.ceil(victim_prompt / BLOCK_SIZE)  # the holder's block and the victim's: none spare
            workload = build_workload(spec, model)
            for _ in range(s.repeats):
                for mode in self.modes:  # interleaved: drift in machine speed hits both modes alike
                    knobs = Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=blocks, preemption_mode=mode,
                                  num_cpu_blocks=blocks + 1 if mode == "swap" else 0,
                                  enable_prefix_caching=False, enable_chunked_prefill=False)
                    jobs.append(Job(workload, knobs, mode=mode, x=float(length)))
        return jobs

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "lengths": list(s.lengths), "repeats": s.repeats,
                "holder_tokens": s.holder_tokens, "holder_outputs": s.holder_outputs,
                "victim_outputs": s.victim_outputs}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        costs: dict[tuple[str, float], list[ResumeCost]] = {}
        bad: list[str] = []
        for sv in served:
            cost = resume_cost(sv.trace, VICTIM, sv.job.mode or "")
            if cost is None:
                bad.append(f"{sv.job.mode} at L={sv.job.x:g}")
            else:
                costs.setdefault((sv.job.mode or "", sv.job.x or 0.0), []).append(cost)
        for (mode, x), cs in sorted(costs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            out.points.append(SweepPoint("seq_len", "sequence length at preemption (tokens)", x,
                                         summarize_costs(cs), mode=mode))
        lengths = sorted({sv.job.x or 0.0 for sv in served})
        by_mode = {mode: {p.x: p.metrics["cost_s"] for p in out.points if p.mode == mode} for mode in self.modes}
        cross = metrics.crossover(lengths, [by_mode["swap"].get(x) for x in lengths],
                                  [by_mode["recompute"].get(x) for x in lengths])
        out.parameters["crossover_seq_len"] = None if cross is None else round(cross, 1)
        if bad:
            out.notes.append("runs without exactly one preemption and resume of the victim: " + ", ".join(bad))
        out.claims = {
            "every run preempted the victim once, in its mode, and resumed it": not bad,
            "both modes measured at every length": all(x in by_mode[m] for m in self.modes for x in lengths),
        }
        return out


    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        title = "Swap vs recompute"
        engines = list(dict.fromkeys(p["engine"] for sw in recorded.get("sweeps", []) for p in sw["points"]))
        for engine in ([reference] if reference in engines else []) + [e for e in engines if e != reference]:
            cx = crossover_of(recorded, engine)
            if cx is not None:
                return crossover_headline(title, engine, cx)
        return Headline(title, None, "needs a sweep with swap and recompute points")


def crossover_of(recorded: Mapping[str, Any], engine: str) -> dict[str, Any] | None:
    """``{x, xs, swap, recompute, x_label}`` of ``engine``'s cost curves (x None: they never cross)."""
    for sw in recorded.get("sweeps", []):
        curves: dict[str, dict[float, float]] = {}
        for p in sw["points"]:
            v = num(p["metrics"].get("cost_s"))
            if p["engine"] == engine and p.get("mode") in ("swap", "recompute") and v is not None:
                curves.setdefault(p["mode"], {})[float(p["x"])] = v
        if len(curves) < 2:
            continue
        xs = sorted(set(curves["swap"]) & set(curves["recompute"]))
        if not xs:
            continue
        s, r = [curves["swap"][x] for x in xs], [curves["recompute"][x] for x in xs]
        return {"x": metrics.crossover(xs, s, r), "xs": xs, "swap": s, "recompute": r, "x_label": sw["x_label"]}
    return None


def crossover_headline(title: str, engine: str, cx: Mapping[str, Any]) -> Headline:
    """The crossover length, or "within noise" where both modes cost less than the noise floor there."""
    xs, s, r = cx["xs"], cx["swap"], cx["recompute"]
    last = s[-1] / r[-1] if r[-1] else None
    at = f"at {xs[-1]:g} tokens swap costs {fmt_ratio(last)} of recompute"
    # lengths where both costs sit under the floor: their order is the machine's jitter, not the modes'
    quiet = [x for x, a, b in zip(xs, s, r, strict=True) if max(a, b) < NOISE_FLOOR_S]
    noise = (f"; below ~{max(quiet):g} tokens both cost < {fmt_time(NOISE_FLOOR_S)}: within noise"
             if quiet else "")
    if cx["x"] is None:
        cheaper = "swap" if s[-1] < r[-1] else "recompute"
        return Headline(title, f"{cheaper} always cheaper", f"no crossover in the sweep ({engine})", at + noise)
    x = cx["x"]
    i = next(i for i, v in enumerate(xs) if v >= x)
    lo = max(0, i - 1)
    if max(s[lo], r[lo], s[i], r[i]) < NOISE_FLOOR_S:
        return Headline(title, "within noise", f"the curves cross near {x:,.0f} tokens ({engine}), where both cost "
                        f"< {fmt_time(NOISE_FLOOR_S)}", at, within_noise=True)
    above = "swap" if s[-1] < r[-1] else "recompute"
    return Headline(title, f"{x:,.0f}", f"crossover {cx['x_label']} ({engine}): {above} is cheaper above it",
                    at + noise)


VICTIM = "r0001"  # the second request of a crossover workload (the first is the holder)


def check_crossover_length(length: int, size: CrossoverSize, model: Model) -> None:
    """A length must fit the model next to the holder, in one unchunked step."""
    need = length - 1 + size.holder_tokens
    if length < 2 or need > model.max_model_len or length + size.victim_outputs > model.max_model_len:
        raise ValueError(f"crossover length {length} does not fit: the victim's prompt ({length - 1}) plus the "
                         f"holder's ({size.holder_tokens}) must fit one step of max_model_len={model.max_model_len}")


@dataclass(frozen=True)
class ResumeCost:
    """One preempt-and-resume, read off a trace: the two steps it touched and the plain decode steps."""

    preempt_step_s: float  # swap: a decode plus the copy out; recompute: a decode (freeing is bookkeeping)
    resume_step_s: float  # swap: the copy in plus a decode; recompute: the prefill of all L tokens
    decode_step_s: float  # the fastest plain decode step of the run

    @property
    def cost_s(self) -> float:
        return self.preempt_step_s + self.resume_step_s - 2 * self.decode_step_s


def resume_cost(trace: Trace, victim: str, mode: str) -> ResumeCost | None:
    """The steps of one preempt-and-resume of ``victim``, or None unless the trace shows exactly one
    preemption of ``victim`` in ``mode`` followed by exactly one resume (and some plain decode steps:
    no prefill, no preemption, not the resume)."""
    r = trace.requests.get(victim)
    if r is None or len(r.preemptions) != 1 or len(r.resumes) != 1 or r.preemptions[0][1] != mode:
        return None
    t_pre, t_res = r.preemptions[0][0], r.resumes[0]
    if not t_pre < t_res:
        return None
    by_t = {s.t: s for s in trace.steps}
    pre, res = by_t.get(t_pre), by_t.get(t_res)
    decodes = [s.duration for s in trace.steps if s.num_prefill_tokens == 0 and s.num_preempted == 0
               and s.num_decode_tokens > 0 and s.t not in (t_pre, t_res)]
    if pre is None or res is None or not decodes:
        return None
    return ResumeCost(pre.duration, res.duration, min(decodes))


def summarize_costs(costs: Sequence[ResumeCost]) -> dict[str, float | None]:
    """A sweep point's metrics over repeats.

    ``cost_s`` (what the report plots) = fastest preempting step + fastest resuming step - 2 x
    fastest decode step, each the minimum over all repeats: on a shared machine timing noise only
    ever adds time (``timeit``'s argument for the minimum), so minima compare like with like. The
    median of the per-run costs is kept as ``cost_median_s``.
    """
    pre, res = min(c.preempt_step_s for c in costs), min(c.resume_step_s for c in costs)
    decode = min(c.decode_step_s for c in costs)
    return {"cost_s": pre + res - 2 * decode, "cost_median_s": float(np.median([c.cost_s for c in costs])),
            "preempt_extra_s": pre - decode, "resume_extra_s": res - decode, "decode_step_s": decode,
            "repeats": float(len(costs))}
