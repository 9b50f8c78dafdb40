"""Block accounting, in process: what a running request holds, step by step, against what its tokens need.

The rule (vLLM's ``allocate_slots`` and the reference engine's alike): a request's block table covers its
tokens and no more. After every step, each running request holds exactly ``ceil(tokens / block_size)``
device blocks, where ``tokens`` are the tokens whose KV it has computed (prompt and output, prefix hits
included)::

    block_size 4, 10 tokens computed       | x x x x | x x x x | x x . . |   -> 3 blocks, not 2, not 4

A request readmitted after a recompute preemption is held to the same rule from its first step back: a
readmission that allocates for more than it computes keeps blocks that no token needs, out of every other
request's reach, which no output comparison can see.

The preemption counters are held to the engine's own events, step by step: each ``preempted`` event
with ``mode="recompute"`` is one more ``preemptions_recompute``, one with ``mode="swap"`` one more
``preemptions_swap``, and one that wanted a swap but recomputed (``wanted="swap"``: the host pool was
full, the fallback of swap and auto modes alike) also one more ``swap_fallbacks``.

How it sees the steps: :func:`observe` runs the adapter's own ``generate`` while the engine that
``generate`` builds (``adapter.build_engine``, the in-process adapters' public builder, faults included)
reports every step to a :class:`StepObserver`. The observer reads the engine as the refcount machine and
the faults do (``scheduler.running``, ``block_manager.block_tables``, ``counters()``, ``add_event_sink``),
never the results kvbench reads back.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbench.engines.base import EngineAdapter, GenRequest, GenResult, Knobs

#: the counters a step's preemption events are held to, and the events each one counts
PREEMPTION_COUNTERS = ("preemptions_recompute", "preemptions_swap", "swap_fallbacks")


def blocks_needed(tokens: int, block_size: int) -> int:
    """``ceil(tokens / block_size)``: the blocks that ``tokens`` tokens of KV fill."""
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Holding:
    """One running request's blocks after one step, against what its tokens need."""

    step: int
    request_id: str
    tokens: int  # tokens whose KV it has computed
    blocks: int  # device blocks in its table
    needed: int  # blocks_needed(tokens, block_size)
    readmitted: bool  # readmitted after a recompute preemption (and not preempted since)

    def explain(self) -> str:
        how = "more" if self.blocks > self.needed else "fewer"
        after = " (readmitted after a recompute preemption)" if self.readmitted else ""
        return (f"step {self.step}: {self.request_id}{after} holds {self.blocks} blocks for {self.tokens} tokens, "
                f"which need {self.needed}: {how} than its tokens need")


@dataclass(frozen=True)
class CountStep:
    """One step whose preemption counters moved otherwise than its preemption events say."""

    step: int
    counted: dict[str, int]  # counter -> how much it moved this step
    events: dict[str, int]  # counter -> how much the step's events say it should have moved

    def explain(self) -> str:
        wrong = ", ".join(f"{name} moved +{self.counted[name]} where the step's events say +{self.events[name]}"
                          for name in PREEMPTION_COUNTERS if self.counted[name] != self.events[name])
        return f"step {self.step}: {wrong}"


@dataclass
class StepObserver:
    """Attached to one engine (:meth:`attach`), checks every running request's holding and every
    step's preemption counters after the step. Keeps the violations and how much was checked."""

    block_size: int = 0
    steps: int = 0
    holdings_checked: int = 0
    readmitted_checked: int = 0  # holdings of readmitted requests checked: the readmission rule fired
    readmitted: set[str] = field(default_factory=set)
    wrong_holdings: list[Holding] = field(default_factory=list)
    wrong_counts: list[CountStep] = field(default_factory=list)
    events_seen: Counter = field(default_factory=Counter)  # counter -> preemptions its events say, all steps
    _step_events: Counter = field(default_factory=Counter)

    def attach(self, engine: Any) -> None:
        """Observe ``engine`` (a reference ``LLMEngine``, or an engine with the same surface) from now on."""
        self.block_size = engine.block_manager.block_size
        engine.add_event_sink(self._take)
        step = engine.step

        def observed_step() -> Any:
            before = _preemption_counts(engine)
            self._step_events.clear()
            result = step()
            self._after_step(engine, before)
            return result

        engine.step = observed_step

    def _take(self, event: Any) -> None:
        """An engine event, as it is recorded (an event sink: never raises)."""
        if event.kind == "admitted" and event.data.get("resumed"):
            self.readmitted.add(event.request_id)
        elif event.kind == "preempted":
            recompute = event.data.get("mode") == "recompute"
            self._step_events["preemptions_recompute" if recompute else "preemptions_swap"] += 1
            self._step_events["swap_fallbacks"] += int(recompute and event.data.get("wanted") == "swap")
            if recompute:  # a readmission starts the rule again; a swap keeps its KV
                self.readmitted.discard(event.request_id)
        elif event.kind in ("finished", "aborted"):
            self.readmitted.discard(event.request_id)

    def _after_step(self, engine: Any, before: dict[str, int]) -> None:
        self.steps += 1
        tables = engine.block_manager.block_tables
        for request in engine.scheduler.running:
            tokens = request.num_computed_tokens
            holding = Holding(self.steps, request.request_id, tokens, len(tables.get(request.request_id, ())),
                              blocks_needed(tokens, self.block_size), request.request_id in self.readmitted)
            self.holdings_checked += 1
            self.readmitted_checked += holding.readmitted
            if holding.blocks != holding.needed:
                self.wrong_holdings.append(holding)
        after = _preemption_counts(engine)
        counted = {name: after[name] - before[name] for name in PREEMPTION_COUNTERS}
        events = {name: self._step_events[name] for name in PREEMPTION_COUNTERS}
        self.events_seen.update(events)
        if counted != events:
            self.wrong_counts.append(CountStep(self.steps, counted, events))


def _preemption_counts(engine: Any) -> dict[str, int]:
    counters = engine.counters()
    return {name: getattr(counters, name) for name in PREEMPTION_COUNTERS}


@dataclass
class ObservedRun:
    """What :func:`observe` saw: the adapter's own result, and the observer of its engine's steps."""

    result: GenResult
    observer: StepObserver


def can_observe(adapter: EngineAdapter) -> str:
    """"" when :func:`observe` can watch ``adapter``'s engine step by step, else why not."""
    if not callable(getattr(adapter, "build_engine", None)):
        return f"{adapter.name} builds no engine in this process (no build_engine), so its steps cannot be watched"
    return ""


@contextlib.contextmanager
def _observing(adapter: EngineAdapter, observer: StepObserver) -> Iterator[None]:
    """While open, every engine ``adapter`` builds is observed by ``observer`` (an instance attribute
    shadows the class's ``build_engine`` and is removed on the way out)."""
    build = adapter.build_engine

    def build_observed(knobs: Knobs) -> Any:
        engine = build(knobs)
        observer.attach(engine)
        return engine

    adapter.build_engine = build_observed  # type: ignore[method-assign]
    try:
        yield
    finally:
        del adapter.build_engine


def observe(adapter: EngineAdapter, requests: Sequence[GenRequest], knobs: Knobs) -> ObservedRun:
    """``adapter.generate(requests, knobs)`` with its engine's every step checked by a :class:`StepObserver`.
    The adapter must build its engine in this process (:func:`can_observe`)."""
    observer = StepObserver()
    with _observing(adapter, observer):
        result = adapter.generate(requests, knobs)
    if not observer.steps:
        raise RuntimeError(f"{adapter.name}.generate stepped no engine built by build_engine: nothing was observed")
    return ObservedRun(result, observer)
