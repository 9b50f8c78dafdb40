"""The capacity plan of a simulator sweep, as data: what ``kvbench simulate`` prints and plan.html shows.

:func:`capacity_plan` reads the runs of a sweep (:func:`kvbench.sim.simulate.run_sweep`) into a
:class:`CapacityPlan` of three findings, one entry per *group* (the runs that share every knob but the
one the finding reads):

* :class:`Knee`: the smallest ``max_num_seqs`` whose output throughput is within 5% of the group's best
  (more admits more preemption, not more tokens);
* :class:`PoolForBudget`: the smallest ``num_gpu_blocks`` whose preemptions per request stay within the
  budget at the workload's arrival rate, or none within the sweep;
* :class:`ModeComparison`: the preemption modes' figures side by side (and, when auto was run beside
  both fixed modes, the policy scenario's claims on it);

plus :class:`CostCrossover`, the cost model's statement of which mode is cheaper for a victim of each
length. :meth:`CapacityPlan.text` is the plan in words (the CLI prints it); :class:`PlanDocument`
bundles the plan with what was simulated (:class:`SimulationSetup`) and the runs, as plain JSON
(``plan.json``) that :mod:`kvbench.report.plan_report` renders as ``plan.html``.

Every time here is simulated seconds on the sim engine's hardware profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbench import __version__
from kvbench.bench.workloads import Workload
from kvbench.core.jsonable import jsonable
from kvbench.core.knobs import Knobs
from kvbench.sim.simulate import SimRun, fmt_ms, fmt_number

#: a knee's throughput is at least this share of its group's best
KNEE_SHARE = 0.95
#: plan.json's layout; bumped when a field changes meaning or goes away
SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------------
# the findings


@dataclass(frozen=True)
class Knee:
    """One group's knee concurrency. ``group``: the knobs its runs share (all but ``max_num_seqs``)."""

    group: dict[str, Any]
    max_num_seqs: int | None
    throughput: float | None  # output tokens/s at the knee
    best_throughput: float  # the group's best (0.0 when no run reported one)
    tbt_p99: float | None  # seconds, at the knee
    preemptions_per_request: float | None  # at the knee


@dataclass(frozen=True)
class PoolForBudget:
    """One group's smallest pool within the preemption budget. ``num_gpu_blocks`` None: no pool of
    ``swept`` (ascending) stayed within it."""

    group: dict[str, Any]
    num_gpu_blocks: int | None
    preemptions_per_request: float | None  # at that pool
    swept: list[int]


@dataclass(frozen=True)
class ModeFigures:
    """One preemption mode's run within a :class:`ModeComparison`."""

    mode: str | None
    throughput: float | None
    tbt_p99: float | None
    preemptions_recompute: float | None
    preemptions_swap: float | None
    preemptions_per_request: float | None


@dataclass(frozen=True)
class Claim:
    """A claim of the policy scenario on auto; ``held`` None: the figures cannot decide it."""

    text: str
    held: bool | None

    @property
    def verdict(self) -> str:
        return "shown" if self.held else "NOT shown" if self.held is False else "undecided"


@dataclass(frozen=True)
class ModeComparison:
    """One group's runs that differ only in ``preemption_mode``, in run order."""

    group: dict[str, Any]
    modes: list[ModeFigures]
    claims: list[Claim] = field(default_factory=list)  # only when auto, recompute and swap all ran


@dataclass(frozen=True)
class CostCrossover:
    """The cost model's verdict on swap vs recompute for a victim of each length (multiples of the
    block size up to ``max_len``): ``shorter`` is cheaper below ``length``; ``length`` None: at every
    length. ``statement`` says it in words."""

    model: str
    hardware: str
    shorter: str
    length: int | None
    max_len: int
    statement: str


@dataclass(frozen=True)
class CapacityPlan:
    """The findings of one sweep. A finding is None when its knob is in no run's knobs (not swept nor
    set): the runs cannot speak to it. ``arrival_rate``: the workload's mean requests per second over
    its arrival span (None when unknown or all requests arrive at once); the pool findings hold at it."""

    preemption_budget: float
    crossover: CostCrossover
    knees: list[Knee] | None = None
    pools: list[PoolForBudget] | None = None
    modes: list[ModeComparison] | None = None
    arrival_rate: float | None = None
    knee_share: float = KNEE_SHARE

    def lines(self) -> list[str]:
        """The plan in words, one finding a line (what ``kvbench simulate`` prints)."""
        out: list[str] = []
        if self.knees is not None:
            out.append(f"Knee concurrency (smallest max_num_seqs within {1 - self.knee_share:.0%} of the best "
                       "throughput):")
            out += [f"  {group_label(k.group)}: knee at max_num_seqs={k.max_num_seqs} "
                    f"({fmt_number(k.throughput)} tok/s of best {fmt_number(k.best_throughput)}; p99 TBT "
                    f"{fmt_ms(k.tbt_p99)}, {fmt_number(k.preemptions_per_request, 3)} preemptions/request)"
                    for k in self.knees]
        if self.pools is not None:
            out.append(f"Pool size for <= {self.preemption_budget:g} preemptions per request at this workload's "
                       "arrival rate:")
            for p in self.pools:
                if p.num_gpu_blocks is not None:
                    out.append(f"  {group_label(p.group)}: num_gpu_blocks={p.num_gpu_blocks} "
                               f"({fmt_number(p.preemptions_per_request, 3)} preemptions/request)")
                else:
                    out.append(f"  {group_label(p.group)}: none of {p.swept} stays within the budget")
        if self.modes is not None:
            out.append("Swap vs recompute (simulated runs):")
            for c in self.modes:
                out.append(f"  {group_label(c.group)}: " + "; ".join(
                    f"{m.mode}: {fmt_number(m.throughput)} tok/s, p99 TBT {fmt_ms(m.tbt_p99)}" for m in c.modes))
                out += [f"    {claim.verdict}: {claim.text}" for claim in c.claims]
        x = self.crossover
        out.append(f"Cost model ({x.model} on {x.hardware}): {x.statement} "
                   "(a victim swapped out and back in vs its tokens prefilled again).")
        return out

    def text(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (non-finite numbers as null); :meth:`from_json` reads it back."""
        return jsonable(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CapacityPlan:
        def listed(key: str, build: Any) -> list[Any] | None:
            return None if data.get(key) is None else [build(item) for item in data[key]]

        def comparison(item: Mapping[str, Any]) -> ModeComparison:
            return ModeComparison(item["group"], [ModeFigures(**m) for m in item["modes"]],
                                  [Claim(**c) for c in item.get("claims", [])])

        return cls(preemption_budget=data["preemption_budget"], crossover=CostCrossover(**data["crossover"]),
                   knees=listed("knees", lambda k: Knee(**k)), pools=listed("pools", lambda p: PoolForBudget(**p)),
                   modes=listed("modes", comparison), arrival_rate=data.get("arrival_rate"),
                   knee_share=data.get("knee_share", KNEE_SHARE))


def group_label(group: Mapping[str, Any]) -> str:
    """``knob=value, ...`` in knob order, or "defaults" for no knobs."""
    return ", ".join(f"{k}={v}" for k, v in sorted(group.items())) or "defaults"


def group_runs(runs: Sequence[SimRun], by: str) -> dict[tuple[tuple[str, Any], ...], list[SimRun]]:
    """The runs grouped by every knob but ``by`` (key: those knobs as sorted pairs), in run order."""
    groups: dict[tuple[tuple[str, Any], ...], list[SimRun]] = {}
    for r in runs:
        rest = tuple(sorted((k, v) for k, v in r.knobs.items() if k != by))
        groups.setdefault(rest, []).append(r)
    return groups


def mean_arrival_rate(workload: Workload | None) -> float | None:
    """Requests per second from t=0 to the last arrival; None without a workload or when every request
    arrives at t=0 (a burst has no rate)."""
    if workload is None or not workload.requests:
        return None
    last = max(r.arrival_time for r in workload.requests)
    return len(workload.requests) / last if last > 0 else None


def capacity_plan(runs: Sequence[SimRun], adapter: Any, preemption_budget: float = 0.01,
                  workload: Workload | None = None) -> CapacityPlan:
    """The plan of ``runs`` (one workload on one ``sim`` ``adapter``): knee concurrency, the pool for
    ``preemption_budget`` preemptions per request, swap vs recompute (the runs' figures and the cost
    model's crossover length). ``workload``, when given, supplies the arrival rate the pools hold at."""
    present = {k for r in runs for k in r.knobs}
    engine = adapter.build_engine(Knobs())
    crossover = engine.cost.crossover(engine.config.block_size, engine.config.max_model_len)
    return CapacityPlan(
        preemption_budget=preemption_budget,
        crossover=CostCrossover(adapter.model_shape.name, adapter.profile.name, crossover.shorter, crossover.length,
                                crossover.max_len, crossover.describe()),
        knees=_knees(runs) if "max_num_seqs" in present else None,
        pools=_pools(runs, preemption_budget) if "num_gpu_blocks" in present else None,
        modes=_modes(runs) if "preemption_mode" in present else None,
        arrival_rate=mean_arrival_rate(workload))


def _knees(runs: Sequence[SimRun]) -> list[Knee]:
    knees = []
    for rest, group in group_runs(runs, "max_num_seqs").items():
        group = sorted(group, key=lambda r: r.knobs.get("max_num_seqs", 0))
        best = max((r.figures["output_throughput"] or 0) for r in group)
        knee = next(r for r in group if (r.figures["output_throughput"] or 0) >= KNEE_SHARE * best)
        knees.append(Knee(dict(rest), knee.knobs.get("max_num_seqs"), knee.figures["output_throughput"], best,
                          knee.figures["tbt_p99"], knee.figures["preemptions_per_request"]))
    return knees


def _pools(runs: Sequence[SimRun], budget: float) -> list[PoolForBudget]:
    pools = []
    for rest, group in group_runs(runs, "num_gpu_blocks").items():
        group = sorted(group, key=lambda r: r.knobs.get("num_gpu_blocks", 0))
        ok = [r for r in group if (r.figures["preemptions_per_request"] or 0) <= budget]
        pools.append(PoolForBudget(dict(rest), ok[0].knobs.get("num_gpu_blocks") if ok else None,
                                   ok[0].figures["preemptions_per_request"] if ok else None,
                                   [r.knobs.get("num_gpu_blocks") for r in group]))
    return pools


def _modes(runs: Sequence[SimRun]) -> list[ModeComparison]:
    return [ModeComparison(dict(rest), [ModeFigures(r.knobs.get("preemption_mode"), r.figures["output_throughput"],
                                                    r.figures["tbt_p99"], r.figures["preemptions_recompute"],
                                                    r.figures["preemptions_swap"],
                                                    r.figures["preemptions_per_request"]) for r in group],
                           auto_claims(group))
            for rest, group in group_runs(runs, "preemption_mode").items()]


def auto_claims(group: Sequence[SimRun]) -> list[Claim]:
    """The scenario's claims on auto (:func:`kvbench.bench.scenarios.policies.auto_vs_fixed_claims`) for
    one group of runs that differ only in ``preemption_mode``; empty unless it has all three modes."""
    from kvbench.bench.scenarios.policies import auto_vs_fixed_claims

    by_mode = {r.knobs.get("preemption_mode"): r.figures for r in group}
    if not {"auto", "recompute", "swap"} <= set(by_mode):
        return []
    auto = by_mode["auto"]
    mixed = bool(auto.get("preemptions_swap")) and bool(auto.get("preemptions_recompute"))
    claims = auto_vs_fixed_claims(*(by_mode[m]["output_throughput"] for m in ("auto", "recompute", "swap")), mixed)
    return [Claim(claim, held) for claim, held in claims.items()]


# --------------------------------------------------------------------------------------------
# what was simulated, and the document plan.json holds


@dataclass(frozen=True)
class SimulationSetup:
    """What a plan was simulated on, as the page states it above the plan."""

    engine_spec: str  # as given to --engine
    engine_name: str
    hardware: str  # the hardware profile's name
    hardware_source: str  # where its numbers come from
    calibrated: bool  # fitted by `kvbench calibrate`, not public specs with assumed efficiencies
    model: str
    clock: str
    workload: str
    requests: int
    arrival_rate: float | None  # :func:`mean_arrival_rate`
    arrival_span_s: float | None  # t=0 to the last arrival, simulated seconds (the rate's span)
    sweep: dict[str, list[Any]]  # knob -> values, as given to --sweep
    base_knobs: dict[str, Any]  # knobs every run has (the workload's own), before the sweep's

    @classmethod
    def of(cls, engine_spec: str, adapter: Any, workload: Workload, sweep: Mapping[str, Sequence[Any]],
           base: Knobs) -> SimulationSetup:
        """The setup of a ``sim`` ``adapter`` serving ``workload`` over ``sweep`` from ``base``."""
        about = adapter.describe()
        arrivals = [r.arrival_time for r in workload.requests]
        return cls(engine_spec=engine_spec, engine_name=str(about.get("name", adapter.name)),
                   hardware=str(about.get("hardware", "")), hardware_source=str(about.get("hardware_source", "")),
                   calibrated=bool(about.get("calibrated")), model=str(about.get("model", "")),
                   clock=str(about.get("clock", "")), workload=workload.name, requests=len(workload.requests),
                   arrival_rate=mean_arrival_rate(workload), arrival_span_s=max(arrivals) if arrivals else None,
                   sweep={k: list(v) for k, v in sweep.items()}, base_knobs=base.as_dict())


@dataclass(frozen=True)
class PlanDocument:
    """Everything plan.json holds and plan.html shows: the setup, every run, and the plan."""

    setup: SimulationSetup
    runs: list[SimRun]
    plan: CapacityPlan

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values only (dicts, lists, strings, numbers, booleans, null; no NaN), versioned."""
        return jsonable({"schema_version": SCHEMA_VERSION, "kvbench_version": __version__,
                           "times": "simulated seconds", "setup": dataclasses.asdict(self.setup),
                           "runs": [dataclasses.asdict(r) for r in self.runs], "plan": self.plan.to_json()})

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanDocument:
        """Read :meth:`to_json`'s output back; ValueError on another schema version."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"plan.json schema_version {data.get('schema_version')!r}: this kvbench reads "
                             f"version {SCHEMA_VERSION}")
        return cls(SimulationSetup(**data["setup"]), [SimRun(**r) for r in data["runs"]],
                   CapacityPlan.from_json(data["plan"]))
