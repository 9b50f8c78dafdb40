"""How a scenario's claims are decided, and, when they are not, which way they stayed open.

A claim reads the engine's own evidence, black box first, as the conformance checks do
(:mod:`kvbench.conformance.prove`): its counters over the claim's window (a server's ``/metrics``
scraped before and after each run, and sampled during it), the streams the client saw, its own
step records where an in-process engine keeps them. Never a gauge sampled ten times a second where a
counter says more: a sample that read 83.6% while the engine counted a preemption missed the moment the
pool ran dry.

Every claim ends as a :class:`Decision`: held (True), not held (False: the benchmark fails), or
undecided (None) of one of three kinds, never confused in one message:

* :data:`NOT_EXPOSED`: the engine publishes nothing that tells (no such counter, no step records), or
  what it publishes cannot place the event in the claim's window;
* :data:`DID_NOT_FIRE`: the counter is published and did not move over the window;
* :data:`NOT_REACHED`: the workload did not reach the pressure it was built for on this engine (the pool
  never filled, the sweep did not start below capacity), so the point measured nothing the scenario is
  about, and claims that rest on that pressure say so too.

Which claims are the workload's own pressure is the scenario's to say (:func:`pressure`): such a claim
is never failed, since a workload that did not push this engine hard enough is not this engine's
fault. A mechanism claim (prefix hits with caching on, no step over its budget, every request finished)
that is exposed and did not hold fails; its reason goes into the outcome's notes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbench.bench import metrics
from kvbench.core.trace import Trace
from kvbench.drivers.step_loop import workload_clock

#: the kinds of an undecided claim (results.json: each result's ``undecided_kinds``)
NOT_EXPOSED = "not exposed"
DID_NOT_FIRE = "did not fire"
NOT_REACHED = "not reached"
KINDS = (NOT_EXPOSED, DID_NOT_FIRE, NOT_REACHED)


@dataclass(frozen=True)
class Decision:
    """One claim's verdict: ``held`` True, False or None (undecided); ``kind`` says which way an undecided
    claim stayed open, or, on a claim not held, that its counter did not move (:data:`DID_NOT_FIRE`);
    ``why``: the evidence in words."""

    held: bool | None
    kind: str | None = None
    why: str = ""

    def __post_init__(self) -> None:
        if self.held is None and self.kind not in KINDS:
            raise ValueError(f"an undecided claim needs a kind, one of {KINDS}; got {self.kind!r}")

    @property
    def reason(self) -> str:
        """"<kind>: <why>" for an undecided claim, "" otherwise."""
        return "" if self.held is not None else f"{self.kind}: {self.why}" if self.why else str(self.kind)


def shown(why: str = "") -> Decision:
    return Decision(True, None, why)


def not_shown(why: str = "", kind: str | None = None) -> Decision:
    return Decision(False, kind, why)


def not_exposed(why: str) -> Decision:
    return Decision(None, NOT_EXPOSED, why)


def did_not_fire(why: str) -> Decision:
    return Decision(None, DID_NOT_FIRE, why)


def not_reached(why: str) -> Decision:
    return Decision(None, NOT_REACHED, why)


def pressure(decision: Decision) -> Decision:
    """A claim on the workload's own pressure: not shown becomes undecided, as :data:`DID_NOT_FIRE` where its
    counter did not move, else :data:`NOT_REACHED`; held and undecided stay as they are."""
    if decision.held is not False:
        return decision
    return Decision(None, decision.kind if decision.kind == DID_NOT_FIRE else NOT_REACHED, decision.why)


def resting_on(decision: Decision, *preconditions: Decision) -> Decision:
    """``decision``, unless a precondition it rests on was not reached (or its pressure did not fire): then
    :data:`NOT_REACHED`, naming it. An undecided precondition of another kind leaves ``decision`` as it is."""
    for pre in preconditions:
        if pre.held is None and pre.kind in (NOT_REACHED, DID_NOT_FIRE):
            return not_reached(f"rests on a pressure the workload did not reach ({pre.why})")
    return decision


def count_claim(value: float | None, counter: str) -> Decision:
    """"``counter`` moved" from its value over the run: None -> :data:`NOT_EXPOSED`, 0 -> not shown with
    :data:`DID_NOT_FIRE`, more -> shown."""
    if value is None:
        return not_exposed(f"this engine publishes no {counter} counter")
    if value <= 0:
        return not_shown(f"the {counter} counter is published and did not move (0 over the run)", DID_NOT_FIRE)
    return shown(f"the {counter} counter moved by {value:,.0f} over the run")


def held(decisions: Mapping[str, Decision]) -> dict[str, bool | None]:
    """The claims as ``Outcome.claims`` holds them."""
    return {claim: d.held for claim, d in decisions.items()}


def decide(outcome: Any, decisions: Mapping[str, Decision]) -> None:
    """Write ``decisions`` into an :class:`~kvbench.bench.scenarios.common.Outcome`: each claim's verdict,
    an undecided one's reason and kind, a decided one's evidence, and a failed one's evidence as a note too
    (what ``explain`` prints)."""
    for claim, d in decisions.items():
        outcome.claims[claim] = d.held
        if d.held is not None and d.why:
            outcome.claim_evidence[claim] = d.why
        if d.held is None:
            outcome.undecided_reasons[claim] = d.reason
            outcome.undecided_kinds[claim] = d.kind
        elif d.held is False and d.why:
            outcome.notes.append(f"not shown: {claim}: {d.why}")


# --------------------------------------------------------------------------------------------
# preemptions in a window, from the engine's own evidence


@dataclass(frozen=True)
class PreemptionSplit:
    """Preemptions an engine counted, split at a moment ``t0`` of the workload's clock.

    ``before``: counted surely before ``t0``; ``after``: surely at or after it; ``straddling``: counted
    between two samples on either side of it (a server's ``/metrics`` samples say *by when*, not *when*).
    ``exact``: the times are the engine's own per-request records (a counter read from outside may count
    a preemption late: vLLM V1 counts one when its victim next returns output, never early).
    ``source``: where the counts come from, in words."""

    before: int
    after: int
    straddling: int
    exact: bool
    source: str

    @property
    def total(self) -> int:
        return self.before + self.after + self.straddling


def preemption_total(trace: Trace) -> int | None:
    """The engine's own count of preemptions over the run (every mode), None where it publishes none."""
    c = trace.counters
    total = c.preemptions_total if c.preemptions_total is not None else c.preemptions
    return None if total is None else int(total)


def preemption_split(trace: Trace, t0: float) -> PreemptionSplit | None:
    """Preemptions before and after ``t0`` (the workload's clock) from, in order of preference: the engine's
    per-request records (exact), a server's cumulative preemption count in the ``/metrics`` samples (each
    rise placed between the two samples that bound it; counts after the last sample from the run's
    total), the run's total alone (every preemption straddling). None when the engine exposes none."""
    clock = workload_clock(trace)
    if metrics.per_request_preemptions_known(trace):
        times = [clock(t) for r in trace.requests.values() for t, _ in r.preemptions]
        before = sum(1 for t in times if t < t0)
        return PreemptionSplit(before, len(times) - before, 0, True, "the engine's per-request preemption records")
    total = preemption_total(trace)
    samples = sorted((s for s in trace.steps if s.sampled and s.server_preemptions is not None), key=lambda s: s.t)
    if not samples:
        return None if total is None else PreemptionSplit(
            0, 0, total, False, "the engine's preemption counter over the whole run (no samples to place them)")
    windows: list[tuple[float, float]] = []
    previous_t, previous = -math.inf, 0
    for s in samples:
        count = int(s.server_preemptions or 0)
        windows += [(previous_t, clock(s.t))] * max(count - previous, 0)
        previous_t, previous = clock(s.t), max(previous, count)
    windows += [(previous_t, math.inf)] * max((total or 0) - previous, 0)
    before = sum(1 for _, by in windows if by < t0)
    after = sum(1 for since, _ in windows if since >= t0)
    return PreemptionSplit(before, after, len(windows) - before - after, False,
                           f"the server's preemption counter, sampled {len(samples)} times over the run")


def preempted_after(trace: Trace, t0: float, what: str) -> Decision:
    """"Preemptions came after ``t0`` (when ``what`` began)", from :func:`preemption_split`:

    * exposed nowhere: :data:`NOT_EXPOSED`; counted none over the run: not shown, :data:`DID_NOT_FIRE`;
    * every one surely before ``t0``: not shown (the pressure came before ``what``: a capacity gap);
    * some surely after ``t0``: shown, where the times are exact, or, from a counter read outside, where
      none was counted before ``t0`` or across it (a count may lag its preemption, so with counts before
      ``t0`` too, a later one may be an earlier preemption told late);
    * else :data:`NOT_EXPOSED`: the engine counts them, but not when closely enough to split at ``t0``."""
    split = preemption_split(trace, t0)
    if split is None:
        return not_exposed("this engine publishes no preemption counter, and a client sees no preemption per "
                           "request")
    where = f"{split.before} before, {split.after} after, {split.straddling} across t={t0:g}s ({split.source})"
    if split.total == 0:
        return not_shown(f"the preemption counter is published and did not move (0 over the run; {split.source})",
                         DID_NOT_FIRE)
    if split.after == 0 and split.straddling == 0:
        return not_shown(f"every preemption came before {what} began: {where}")
    if split.after > 0 and (split.exact or split.before + split.straddling == 0):
        return shown(where)
    return not_exposed(f"the engine counted preemptions but its counts cannot be placed on either side of {what}'s "
                       f"start: {where}")


def kv_filled(trace: Trace, t0: float, level: float) -> Decision:
    """"The pool filled (usage above ``level``) from ``t0`` on", from the engine's own evidence:

    * a preemption counted from ``t0`` on (or across it): the engine preempts only when no block is free, so
      the pool ran dry, whatever a sampled gauge read;
    * else its KV usage above ``level`` at an engine step, or at a ``/metrics`` sample (a sample over the
      level shows it; under it, it may have missed the peak);
    * else :data:`NOT_REACHED` (the peak seen and where it was read), or :data:`NOT_EXPOSED` without gauge or
      counter."""
    clock = workload_clock(trace)
    split = preemption_split(trace, t0)
    if split is not None and split.after + split.straddling > 0:
        return shown(f"the engine preempted from t={t0:g}s on ({split.after + split.straddling} counted; "
                     f"{split.source}): it preempts only when no block is free, so the pool ran dry")
    published = [s for s in trace.steps if s.kv_usage is not None]
    usage = [s.kv_usage for s in published if clock(s.t) >= t0]
    sampled = any(s.sampled for s in trace.steps)
    read = "/metrics samples" if sampled else "every engine step"
    if usage and max(usage) > level:
        return shown(f"peak KV usage {max(usage):.1%} from t={t0:g}s on ({read})")
    if not published and split is None:
        return not_exposed("this engine publishes neither KV usage nor a preemption counter")
    peak = (f"peak KV usage {max(usage):.1%} from t={t0:g}s on ({read}{', which can miss the peak' if sampled else ''})"
            if usage else f"no KV usage read from t={t0:g}s on" if published else "no KV usage published")
    counted = "no preemption counted" if split is not None else "no preemption counter published"
    return not_reached(f"{peak}; {counted} from then on")


def undecided_summary(outcome: Any) -> str | None:
    """Why a run decided nothing about its scenario (every claim but "every request finished..." undecided),
    each claim with its kind and its evidence, or None when one was decided. Such a benchmark proved nothing, so
    it is skipped with this reason (and listed as skipped in results.json), never passed."""
    from kvbench.bench.scenarios.common import SANITY_CLAIM

    about = {c: v for c, v in outcome.claims.items() if not c.startswith(SANITY_CLAIM)}
    if not about or any(v is not None for v in about.values()):
        return None
    return (f"{outcome.scenario.name}: nothing decided on this engine: " + "; ".join(
        f"{claim} ({outcome.undecided_reasons.get(claim) or outcome.undecided_kinds.get(claim) or 'undecided'})"
        for claim in about))
