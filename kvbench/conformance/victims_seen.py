"""Which requests an engine preempted, read from outside: streams that stopped while the others went on,
lined up with the rises of the engine's preemption counter.

Over HTTP kvbench sees when each request was sent, when each of its tokens arrived, and, every poll, the
server's cumulative preemption count (``/metrics``, the trace's sampled steps). A recompute preemption shows
there as a *stall*: the victim's stream stops for far longer than a step while the others keep receiving
tokens, until it is admitted again and its first token after the recompute arrives. The same reading works
on an in-process trace, whose engine steps count their preemptions exactly.

The inference, in order:

1. **the tolerance** (:func:`tolerance`): on an engine's own step records, the longest step; from a client,
   :data:`TOLERANCE_STEPS` times the median gap between a stream's successive chunks (distinct arrival times,
   so a burst of several tokens counts once), and at least the client's delivery jitter. A server that
   delivers more than :data:`MAX_TOKENS_PER_CHUNK` tokens per chunk leaves the run undecided.
2. **stalls**: a gap of one stream during which another stream received chunks of tokens from steps this one
   missed: at least one on an engine's own step records (exact), :data:`SAMPLED_MISSED` from a client (the
   chunks of one step reach the client's streams in any order). A server that delivers in bursts, or pauses
   every stream at once, makes no stall; one that stalls streams for other reasons makes stalls the counter
   does not count.
3. **the count and the timing**: the k-th stall (by start) lies in the sampling window of the k-th rise of the
   counter, give or take the tolerance; that bounds when its preemption happened. Where they stop lining up (a
   victim preempted before its first token, or twice in one stall, shows no stall of its own; a stall the
   counter did not count), nothing from there on is judged: a victim may have run unseen. Before it, an unseen
   victim would have shown a token. An engine may instead count a preemption when its victim next gives output
   (vLLM V1 counts it from the request's events, which leave the engine with its next output): then the k-th
   stall *by end* lies in the k-th rise's window, for every stall and with the counts equal, or nothing is read
   (an unseen preemption could lie anywhere before its rise). When not even the first stall lines up, the run
   is undecided.
4. **who was running**: each stream's life is a chain of *segments*, first token to last token before a stall
   or its finish. A segment was admitted at most a tolerance before its first token (the workload keeps every
   context within one step's token budget, so a (re)admitted request computes it in one step) and after its
   arrival (or its previous stall), and it ended when its stall's preemption did (or at its last token).
   Stalls whose preemptions may have happened at the same moment are one *group*, one decision of the policy,
   which must have named all of them. Each other request was surely running then, surely not, or maybe.
5. **the admission order** (FCFS): by the admission windows where they do not overlap; else by the FCFS
   queue, where both requests were waiting at once: a victim goes back to its head (ahead of new arrivals and
   of earlier victims), new arrivals queue in arrival order (the workload staggers them so that the engine's
   arrival order is the sending order, and the first tokens must come in that order, else the run is
   undecided), nobody overtakes. Otherwise the order is unknown.

A group is *decided* when neither a maybe-running request nor an unknown order could change what the policy
names; it is then judged, else counted as ambiguous with its reason. The check passes only on decided groups,
never on a guess.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbench.conformance.victims import check_policy, importance
from kvbench.core import delivery
from kvbench.core.delivery import MAX_TOKENS_PER_CHUNK
from kvbench.core.trace import Trace

#: from a client, a gap of one stream is a stall when another stream received this many chunks inside it
SAMPLED_MISSED = 3
# MAX_TOKENS_PER_CHUNK (kvbench.core.delivery, shared with the report): more tokens per chunk than this, over
# every stream, is a server delivering in bursts: a stream's gaps then say when the server wrote, not when the
# engine stopped computing it
#: the tolerance in steps (:func:`tolerance`): how far a preemption, an admission or a counter rise may lie
#: from the token arrival that bounds it
TOLERANCE_STEPS = 3


@dataclass(frozen=True)
class Stall:
    """A stream that stopped while the others went on: its last token before the gap at ``start``, its next at
    ``end``; ``preempted``: when the preemption happened, as far as the stall and its counter rise bound it."""

    request_id: str
    start: float
    end: float
    preempted: tuple[float, float] = (float("-inf"), float("inf"))


@dataclass(frozen=True)
class Segment:
    """One stretch of a request's life with tokens: admitted in ``(admitted_after, first]``, tokens from ``first``
    to ``last``, ended within ``ended`` (by a preemption: its stall's bounds; else by its finish); ``resumed``
    after a stall; ``stall``: the stall that ended it, None when it finished."""

    request_id: str
    admitted_after: float
    first: float
    last: float
    ended: tuple[float, float]
    resumed: bool
    stall: Stall | None


@dataclass(frozen=True)
class Group:
    """Victims whose preemptions may have happened at the same moment (their bounds overlap): one decision of
    the policy, which must have named all of them; ``at`` bounds it."""

    victims: tuple[str, ...]
    at: tuple[float, float]


@dataclass(frozen=True)
class Verdict:
    """One group judged: ``expected`` is what the policy names (None when ``ambiguous`` says why it cannot)."""

    group: Group
    running: tuple[str, ...]  # surely running (the victims included), admission order where known
    expected: tuple[str, ...] | None
    ambiguous: str | None = None

    @property
    def decided(self) -> bool:
        return self.expected is not None

    @property
    def right(self) -> bool:
        return self.expected is not None and set(self.expected) == set(self.group.victims)


@dataclass
class Reading:
    """What a trace says about preemption victims: the verdicts, or why nothing could be read (``undecided``)."""

    verdicts: list[Verdict] = field(default_factory=list)
    undecided: str | None = None
    step: float | None = None
    tolerance: float | None = None
    stalls: list[Stall] = field(default_factory=list)
    #: where stalls and counter rises stop lining up (None: they all do); nothing from there on is judged
    consistent_until: float | None = None
    #: when the engine's counter counts a preemption, as the rises line up with the stalls
    counted: str = "when the victim is preempted"

    @property
    def decided(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.decided]

    @property
    def ambiguous(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.decided]

    def summary(self) -> str:
        """One line: the step, the stalls, decided and ambiguous groups."""
        if self.undecided:
            return f"undecided: {self.undecided}"
        assert self.step is not None and self.tolerance is not None
        until = ("" if self.consistent_until is None
                 else f" (lining up with the counter until {self.consistent_until:.3f} s)")
        return (f"step {self.step * 1e3:.1f} ms, tolerance {self.tolerance * 1e3:.1f} ms, {len(self.stalls)} stalls"
                f"{until} in {len(self.verdicts)} groups: {len(self.decided)} decided, {len(self.ambiguous)} "
                f"ambiguous; the counter counts a preemption {self.counted}")


def chunk_times(trace: Trace) -> dict[str, list[float]]:
    """Each request's distinct token arrival times, in order (a burst of tokens counts once)."""
    return {rid: sorted(set(r.token_times)) for rid, r in trace.requests.items()}


def typical_step(chunks: Mapping[str, Sequence[float]]) -> float | None:
    """The median gap between a stream's successive chunks, over every stream; None without two chunks."""
    gaps = [b - a for times in chunks.values() for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else None


def tolerance(trace: Trace, chunks: Mapping[str, Sequence[float]], jitter: float) -> float | None:
    """How far a preemption, admission or counter rise may lie from the token arrival bounding it: the longest
    step on an engine's own step records; from a client, :data:`TOLERANCE_STEPS` median chunk gaps, at least
    ``jitter``. None without a step to measure."""
    engine_steps = [s.duration for s in trace.steps if not s.sampled]
    if engine_steps:
        return max(engine_steps)
    step = typical_step(chunks)
    return None if step is None or step <= 0 else max(TOLERANCE_STEPS * step, jitter)


def peak_kv_tokens(trace: Trace) -> int:
    """The most KV (in tokens) the streams provably held at one moment: at each token arrival, the sum over the
    streams between their first and last token of their prompt and the tokens they had received by then. A pool
    smaller than this had to preempt (or hold KV it does not have)."""
    streams = [(r.prompt_len, sorted(r.token_times)) for r in trace.requests.values() if r.token_times]
    peak = 0
    for t in sorted({t for _, times in streams for t in times}):
        peak = max(peak, sum(prompt + bisect.bisect_right(times, t) for prompt, times in streams
                             if times[0] <= t <= times[-1]))
    return peak


def preemption_windows(trace: Trace, total: int) -> list[tuple[float, float]]:
    """One ``(after, by)`` window per preemption the engine counted, in order: the counter had not risen at
    ``after`` and had at ``by``. From the trace's steps: a server's sampled cumulative count, or an engine's
    per-step count; preemptions ``total`` counts beyond them (after the last sample) get ``(last, inf)``."""
    windows: list[tuple[float, float]] = []
    previous_t, previous, count = float("-inf"), 0, 0
    for s in trace.steps:
        if s.sampled:
            if s.server_preemptions is None:
                continue
            count = s.server_preemptions
        else:
            count += s.num_preempted
        windows += [(previous_t, s.t)] * max(count - previous, 0)
        previous_t, previous = s.t, max(previous, count)
    return windows + [(previous_t, float("inf"))] * max(total - len(windows), 0)


def find_stalls(chunks: Mapping[str, Sequence[float]], missed: int) -> list[Stall]:
    """Every gap of a stream during which another stream received at least ``missed`` chunks of tokens (the
    stream missed that many of the engine's steps, give or take delivery jitter); by start."""
    stalls = []
    for rid, times in chunks.items():
        others = [t for other, t in chunks.items() if other != rid]
        for a, b in itertools.pairwise(times):
            inside = max((bisect.bisect_left(t, b) - bisect.bisect_right(t, a) for t in others), default=0)
            if inside >= missed:
                stalls.append(Stall(rid, a, b))
    return sorted(stalls, key=lambda s: (s.start, s.request_id))


def segments(trace: Trace, chunks: Mapping[str, Sequence[float]], stalls: Sequence[Stall],
             tol: float) -> dict[str, list[Segment]]:
    """Each request's segments (see the module docstring), cut at its stalls."""
    cuts: dict[str, list[Stall]] = {}
    for stall in stalls:
        cuts.setdefault(stall.request_id, []).append(stall)
    out: dict[str, list[Segment]] = {}
    for rid, times in chunks.items():
        if not times:
            continue
        out[rid] = []
        after, first = trace.requests[rid].arrival, times[0]
        for stall in sorted(cuts.get(rid, []), key=lambda s: s.start):
            out[rid].append(Segment(rid, after, first, stall.start, stall.preempted, bool(out[rid]), stall))
            after, first = stall.start, stall.end
        out[rid].append(Segment(rid, after, first, times[-1], (times[-1], times[-1] + tol), bool(out[rid]), None))
    return out


def _admitted_lo(seg: Segment, tol: float) -> float:
    """The earliest the segment can have been admitted: after its arrival (or stall), at most ``tol`` before its
    first token (the workload's contexts fit one step's token budget)."""
    return max(seg.admitted_after, seg.first - tol)


def _state(seg_list: Sequence[Segment], lo: float, hi: float, tol: float) -> tuple[str, Segment | None]:
    """("running" | "maybe" | "not", the segment that says so) for a request during ``[lo, hi]``."""
    maybe = None
    for seg in seg_list:
        if seg.first <= lo and seg.ended[0] >= hi:
            return "running", seg
        if not (_admitted_lo(seg, tol) > hi or seg.ended[1] < lo):
            maybe = maybe or seg
    return ("maybe", maybe) if maybe is not None else ("not", None)


def _order(a: Segment, b: Segment, arrival: Mapping[str, int], tol: float) -> bool | None:
    """Whether ``a`` was admitted before ``b`` (None: unknown). Windows that do not overlap decide; else the FCFS
    queue does where both were waiting at once: a victim goes back to the head of the queue (ahead of every new
    arrival, and of victims preempted before it), new arrivals queue in arrival order, and nobody overtakes."""
    if a.first < _admitted_lo(b, tol):
        return True
    if b.first < _admitted_lo(a, tol):
        return False
    if not a.resumed and not b.resumed:
        return arrival[a.request_id] < arrival[b.request_id]

    def queue_rank(seg: Segment) -> tuple[int, float]:  # smaller = nearer the head
        return (0, -seg.admitted_after) if seg.resumed else (1, float(arrival[seg.request_id]))

    ahead, behind = (a, b) if queue_rank(a) < queue_rank(b) else (b, a)
    if ahead.admitted_after < _admitted_lo(behind, tol):  # it was waiting before the other could be admitted
        return ahead is a
    return None


def _fcfs(running: dict[str, Segment], maybe: dict[str, Segment], k: int, arrival: Mapping[str, int],
          tol: float) -> tuple[tuple[str, ...] | None, str | None, tuple[str, ...]]:
    """(the k latest admitted, or None; why not; the running in admission order where known)."""
    order = sorted(running, key=functools.cmp_to_key(
        lambda a, b: -1 if _order(running[a], running[b], arrival, tol) else 1))
    head, tail = order[:-k], order[-k:]
    for a in head:
        for b in tail:
            if _order(running[a], running[b], arrival, tol) is not True:
                return None, f"admission order of {a} and {b} unknown (windows overlap)", tuple(order)
    for rid, seg in maybe.items():
        later = [b for b in tail if _order(seg, running[b], arrival, tol) is not True]
        if later:
            return None, f"{rid} may have been running (admitted around then) and later than {later[0]}", tuple(order)
    return tuple(tail), None, tuple(order)


def _priority(running: dict[str, Segment], maybe: dict[str, Segment], k: int, priority: Mapping[str, int],
              arrival: Mapping[str, int]) -> tuple[tuple[str, ...] | None, str | None, tuple[str, ...]]:
    """(the k least important, or None; why not; the running by arrival)."""
    def key(rid: str) -> tuple[int, int]:
        return importance(rid, priority, arrival)

    order = tuple(sorted(running, key=lambda rid: arrival[rid]))
    tail = tuple(sorted(running, key=key)[-k:])
    least = min(key(rid) for rid in tail)
    worse = [rid for rid in maybe if key(rid) > least]
    if worse:
        return None, f"{worse[0]} (priority {priority[worse[0]]}) may have been running then", order
    return tail, None, order


def read_victims(trace: Trace, policy: str, priority: Mapping[str, int], arrival: Mapping[str, int],
                 total: int, jitter: float = 0.0) -> Reading:
    """Infer the victims of ``trace``'s ``total`` preemptions and what ``policy`` names for each group
    (see the module docstring). ``priority`` and ``arrival`` (rank in sending order) per request id;
    ``jitter``: a client's delivery jitter, the least tolerance from a client (unused on an engine's own step
    records, which are exact and on the tokens' clock)."""
    check_policy(policy)
    chunks = chunk_times(trace)
    tol = tolerance(trace, chunks, jitter)
    if tol is None:
        return Reading(undecided="no stream received two chunks of tokens: no step to measure stalls by")
    exact = any(not s.sampled for s in trace.steps)
    reading = Reading(step=typical_step(chunks), tolerance=tol)
    per_chunk = delivery.tokens_per_chunk(r.token_times for r in trace.requests.values())
    if delivery.bursty(per_chunk):
        assert per_chunk is not None
        reading.undecided = (f"the server delivers tokens in bursts ({per_chunk:.1f} tokens per chunk over "
                             f"every stream, {MAX_TOKENS_PER_CHUNK} at most): a gap says when it wrote, not when "
                             "its engine left a request out (a front end short of CPU writes so: a server kvbench "
                             "starts can give it a core of its own, helper_cores=engine)")
        return reading
    firsts = sorted((arrival[rid], times[0], rid) for rid, times in chunks.items() if times)
    for (_, a_first, a), (_, b_first, b) in itertools.pairwise(firsts):
        if a_first > b_first + tol:
            reading.undecided = (f"first tokens came out of arrival order ({a}, sent before {b}, got its first token "
                                 f"{(a_first - b_first) * 1e3:.0f} ms after it): the engine's admission order is not "
                                 "known")
            return reading
    stalls = find_stalls(chunks, 1 if exact else SAMPLED_MISSED)
    windows = sorted(preemption_windows(trace, total), key=lambda w: w[1])
    lag = 0.0 if exact else tol  # a sampled counter shows a preemption up to a tolerance late; an engine's, at once
    timed, broken, why = _match(stalls, windows, tol, lag)
    if broken is not None:  # an engine may count a preemption when its victim next gives output, not at once
        at_resume = _match_at_resume(stalls, windows, tol, lag)
        if at_resume is not None:
            timed, broken, reading.counted = at_resume, None, "when the victim resumes"
    reading.stalls, reading.consistent_until = timed, broken
    # an unseen victim ran at most from the step before the unseen preemption (exact steps: from its own step)
    cutoff = None if broken is None else broken if exact else broken - 2 * tol
    matched = [st for st in timed if cutoff is None or st.preempted[1] <= cutoff]
    if not matched:
        reading.undecided = (f"{len(stalls)} stalls (a stream stopped while others went on), {total} preemptions "
                             f"counted: {why} (a server that delivers in bursts, a victim preempted before its first "
                             "token or twice in one stall, a stream stopped for another reason)")
        return reading
    segs = segments(trace, chunks, timed, tol)
    for group in _groups(timed):
        if cutoff is not None and group.at[1] > cutoff:
            reading.verdicts.append(Verdict(group, (), None, f"at or after {broken:.3f} s, where a preemption shows no "
                                            "stall or a stall no preemption: who ran then is not known"))
        else:
            reading.verdicts.append(_judge(group, segs, policy, priority, arrival, tol))
    return reading


def _match(stalls: Sequence[Stall], windows: Sequence[tuple[float, float]], tol: float,
           lag: float) -> tuple[list[Stall], float | None, str]:
    """The stalls, each bounded by its counter rise where the k-th stall lines up with the k-th rise; the time
    from which they stop lining up (None: all do); and what went wrong there. Past it a victim may have run
    unseen (admitted and preempted again before a token), so nothing there is judged; before it, such a request
    would have shown a token (a step that runs a request gives it one)."""
    timed: list[Stall] = []
    broken: float | None = None
    why = "stalls line up with preemptions"
    k = 0
    for stall in stalls:
        if broken is None and k < len(windows):
            after, by = windows[k]
            lo, hi = max(stall.start - tol, after - lag), min(stall.start + tol, by)
            if lo <= hi:
                # a sampled counter's earlier sample bounds nothing for sure (the engine may count late), its later
                # one does (nothing is counted before it happens); an engine's own step records bound both ends
                bounds = (lo if not lag else stall.start - tol, hi)
                timed.append(Stall(stall.request_id, stall.start, stall.end, bounds))
                k += 1
                continue
            if stall.start + tol < after - lag:
                broken, why = stall.start, (f"the stall of {stall.request_id} from {stall.start:.3f} s does not line "
                                            f"up with the rise of the preemption counter between {after:.3f} s and "
                                            f"{by:.3f} s")
            else:
                broken, why = after, f"the preemption counted between {after:.3f} s and {by:.3f} s shows no stall"
        if broken is None:
            broken, why = stall.start, f"the stall of {stall.request_id} from {stall.start:.3f} s was never counted"
        timed.append(Stall(stall.request_id, stall.start, stall.end, (stall.start - tol, stall.end)))
    if broken is None and k < len(windows):
        after, by = windows[k]
        broken, why = after, f"the preemption counted between {after:.3f} s and {by:.3f} s shows no stall"
    return timed, broken, why


def _match_at_resume(stalls: Sequence[Stall], windows: Sequence[tuple[float, float]], tol: float,
                     lag: float) -> list[Stall] | None:
    """The stalls bounded as :func:`_match` does, for an engine that counts a preemption when its victim next gives
    output (its first token after the stall): the k-th stall by end lies in the k-th rise's window, every one of
    them, and the counts agree; None otherwise (an unseen preemption could then lie anywhere before its rise). The
    rise says nothing of when the preemption happened, only that it did; the stall's start bounds that."""
    if len(stalls) != len(windows):
        return None
    timed = []
    for stall, (after, by) in zip(sorted(stalls, key=lambda s: s.end), windows, strict=True):
        if not (after - lag < stall.end + tol and stall.end - tol <= by):
            return None
        timed.append(Stall(stall.request_id, stall.start, stall.end, (stall.start - tol, stall.start + tol)))
    return sorted(timed, key=lambda s: (s.start, s.request_id))


def _groups(stalls: Sequence[Stall]) -> list[Group]:
    """Stalls whose preemption bounds overlap the previous one's (bounds that only touch are consecutive steps), one
    group each run of them."""
    groups: list[list[Stall]] = []
    for stall in sorted(stalls, key=lambda s: s.preempted):
        if groups and stall.preempted[0] < max(s.preempted[1] for s in groups[-1]):
            groups[-1].append(stall)
        else:
            groups.append([stall])
    return [Group(tuple(s.request_id for s in g), (min(s.preempted[0] for s in g), max(s.preempted[1] for s in g)))
            for g in groups]


def _judge(group: Group, segs: Mapping[str, Sequence[Segment]], policy: str,
           priority: Mapping[str, int], arrival: Mapping[str, int], tol: float) -> Verdict:
    lo, hi = group.at
    running: dict[str, Segment] = {}
    maybe: dict[str, Segment] = {}
    for rid in group.victims:  # each victim's segment that its stall ended
        running[rid] = next(s for s in segs[rid] if s.stall is not None and s.stall.preempted[0] >= lo
                            and s.stall.preempted[1] <= hi)
    for rid, seg_list in segs.items():
        if rid in running:
            continue
        state, seg = _state(seg_list, lo, hi, tol)
        if state == "running" and seg is not None:
            running[rid] = seg
        elif state == "maybe" and seg is not None:
            maybe[rid] = seg
    k = len(group.victims)
    if policy == "fcfs":
        expected, why, order = _fcfs(running, maybe, k, arrival, tol)
    else:
        expected, why, order = _priority(running, maybe, k, priority, arrival)
    return Verdict(group, order, expected, why)


def violations(reading: Reading, policy: str, priority: Mapping[str, int]) -> list[str]:
    """One line per decided group whose victims the policy does not name (the wording of
    :func:`kvbench.conformance.victims.victim_violations`)."""
    problems = []
    for i, v in enumerate(reading.decided):
        if v.right:
            continue
        got, want = ", ".join(v.group.victims), ", ".join(v.expected or ())
        when = f"preempted between {v.group.at[0]:.3f} s and {v.group.at[1]:.3f} s"
        if policy == "fcfs":
            problems.append(f"preemption group {i} ({when}): FCFS must preempt the latest admitted {want}, but "
                            f"preempted {got} (running, oldest first: {list(v.running)})")
        else:
            problems.append(f"preemption group {i} ({when}): the priority policy must preempt the least important "
                            f"{want} (priorities {[priority[r] for r in v.expected or ()]}), but preempted {got} "
                            f"(priorities {[priority[r] for r in v.group.victims]}; running by arrival: "
                            f"{list(v.running)})")
    return problems
