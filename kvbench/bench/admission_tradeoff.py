"""``kvbench admission-sweep``: one surge served under several admission settings, side by side, and
the trade-off of each against static admission.

Each setting is ``HEADROOM:PACING``: the watermark's ``admission_headroom`` and its
``prefill_pacing_tokens`` (``-`` for none), e.g. ``0.2:1`` (headroom 0.2, one prompt token per step
beside decodes). Static admission (``admission_policy=none``, recompute) is always served too, on the
surge's own pool. Step clock, rounds interleaved (every setting once, then again), medians of the
rounds; each setting is judged by :func:`kvbench.bench.scenarios.policies.goal_check` (the
``preemption_policies`` scenario's goal: docs/simulator.md#preemption-aware-policies). For a point the
scenario does not serve; the scenario is what the report and the gate read.

On the reference engine by default; any engine that takes the admission knobs (``sim:...`` too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbench.bench import metrics, repeats
from kvbench.bench import scenarios as sc
from kvbench.bench.formatting import fmt_figure, fmt_median_range
from kvbench.bench.scenarios.common import STEP_SECONDS, Job, serve
from kvbench.bench.scenarios.policies import goal_check
from kvbench.core.knobs import Knobs
from kvbench.engines.base import EngineAdapter

#: the surges a sweep can serve, by scenario name
SURGES = {"evening_surge": sc.EveningSurge, "flash_crowd": sc.FlashCrowd}
#: what each round keeps of a run
FIGURES = ("preemptions", "output_throughput", "tbt_p99")
STATIC = "static"


def parse_setting(text: str) -> Knobs:
    """``HEADROOM:PACING`` as the watermark's knobs; ValueError naming the text and what is allowed."""
    headroom, _, pacing = text.partition(":")
    allowed = "expected HEADROOM:PACING with HEADROOM in [0, 1) and PACING >= 1 tokens or '-', e.g. 0.2:1 or 0.05:-"
    try:
        knobs = Knobs(admission_policy="watermark", admission_headroom=float(headroom),
                      prefill_pacing_tokens=None if pacing in ("", "-") else int(pacing))
    except ValueError:
        raise ValueError(f"setting {text!r} is invalid: {allowed}") from None
    pacing_tokens = knobs.prefill_pacing_tokens
    if not 0 <= knobs.admission_headroom < 1 or (pacing_tokens is not None and pacing_tokens < 1):
        raise ValueError(f"setting {text!r} is invalid: {allowed}")
    return knobs


def label(knobs: Knobs) -> str:
    """A setting's name in the output: ``headroom 0.2, pacing 1``."""
    return f"headroom {knobs.admission_headroom:g}, pacing {knobs.prefill_pacing_tokens or '-'}"


@dataclass
class Sweep:
    """Every round of every setting (static first), by setting name."""

    surge: str
    scale: str
    rounds: dict[str, list[dict[str, float | None]]] = field(default_factory=dict)

    def medians(self, name: str) -> dict[str, float | None]:
        """The median of the rounds of setting ``name``, per figure."""
        return {k: repeats.median([m.get(k) for m in self.rounds[name]]) for k in FIGURES}

    def text(self) -> str:
        """Each setting's medians [min-max] and, against static, the goal's three ratios and its verdict."""
        n = len(self.rounds[STATIC])
        lines = [f"{self.surge} at {self.scale} scale, medians of {n} round(s) [min-max] (the goal judged on the "
                 "medians alone; the preemption_policies scenario's table also weighs their spread):"]
        static = self.medians(STATIC)
        for name, rounds in self.rounds.items():
            med = self.medians(name)
            pre = fmt_median_range([m.get("preemptions") for m in rounds], "{:.0f}")
            tput = fmt_median_range([m.get("output_throughput") for m in rounds], "{:.1f}")
            tbt = fmt_median_range([(m.get("tbt_p99") or 0) * 1e3 for m in rounds if m.get("tbt_p99") is not None],
                                   "{:.0f}")
            line = f"  {name:28} preemptions {pre}, {tput} tok/s, p99 TBT {tbt} ms"
            if name != STATIC:
                c = goal_check(static, med)
                verdict = {True: "met", False: "not met", None: "undecided"}[c.met]
                fewer, lower_tbt, kept = (fmt_figure(v, "{:.2f}", "-")
                                          for v in (c.fewer_preemptions, c.lower_tbt, c.throughput_kept))
                fewer = "no preemption left" if c.fewer_preemptions == math.inf else f"{fewer}x fewer preemptions"
                line += f"; {fewer}, {lower_tbt}x lower p99 TBT, {kept}x throughput: goal {verdict}"
            lines.append(line)
        return "\n".join(lines)


def sweep_admission(adapter: EngineAdapter, model: sc.Model, settings: Sequence[Knobs], surge: str = "flash_crowd",
                    scale: str = "full", rounds: int = 2, say: Callable[[str], None] = print) -> Sweep:
    """Serve ``surge`` (:data:`SURGES`) at ``scale`` on ``adapter``: static admission and each of
    ``settings`` (:func:`parse_setting`), ``rounds`` interleaved rounds on the step clock. ValueError
    naming the argument for an unknown surge or scale, or rounds < 1."""
    if surge not in SURGES:
        raise ValueError(f"surge {surge!r} is unknown; expected one of {', '.join(SURGES)}")
    if scale not in sc.SCALES:
        raise ValueError(f"scale {scale!r} is unknown; expected one of {', '.join(sc.SCALES)}")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} is invalid: expected >= 1")
    (job,) = SURGES[surge]().plan(scale, model)
    static = Knobs(block_size=job.knobs.block_size, num_gpu_blocks=job.knobs.num_gpu_blocks,
                   preemption_mode="recompute", admission_policy="none")
    variants = {STATIC: static, **{label(k): static.merged(k) for k in settings}}
    found = Sweep(surge, scale, {name: [] for name in variants})
    for r in range(rounds):
        for name, knobs in variants.items():
            t0 = time.perf_counter()
            m = metrics.summarize(serve(adapter, Job(job.workload, knobs), surge, step_seconds=STEP_SECONDS[scale]))
            found.rounds[name].append({k: m.get(k) for k in FIGURES})
            tbt = m.get("tbt_p99")
            pre = fmt_figure(m.get("preemptions"), "{:.0f}", "-")
            tput = fmt_figure(m.get("output_throughput"), "{:.1f}", "-")
            say(f"round {r + 1} {name:28} preemptions {pre}, {tput} tok/s, "
                f"p99 TBT {fmt_figure(tbt and tbt * 1e3, '{:.0f}', '-')} ms ({time.perf_counter() - t0:.0f} s)")
    return found
