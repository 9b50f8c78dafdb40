"""Shared machinery of the conformance suite: the seeded request sets, the ground truth, the
equivalence verdicts and the proof that a mechanism fired.

Two rules make a check honest:

* **Outputs first, then prove it fired.** A check compares outputs before anything else, so a wrong
  answer fails whether or not the mechanism can be proven. Then :func:`prove` asserts that an engine
  counter (preemptions of the right mode, swap-ins, prefix hits, prefill chunks) is positive. If the
  engine exposes no such counter the check is *undecided* (:mod:`kvbench.conformance.verdict`), never
  passed: matching outputs with an unproven mechanism prove nothing.
* **Equal, or a documented near-tie.** The reference engine in float32 must match the ground truth token
  for token. Other engines, and the reference engine in bfloat16 or float16, may diverge only where the
  ground truth's top-2 logit margin is below the tolerance of the dtype they compute in
  (:func:`near_tie_tolerance`, :mod:`kvbench.conformance.equivalence`); such near-ties are reported apart
  from failures.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from kvbench.conformance.equivalence import Verdict, compare, confirm_near_tie, tolerance_for
from kvbench.conformance.preconditions import note_greedy_reaches_eos
from kvbench.conformance.verdict import claim, record_proof, undecided
from kvbench.core.evidence import record_evidence
from kvbench.core.kv_budget import pressured, request_tokens, roomy, together
from kvbench.engines.base import EngineAdapter, GenRequest, GenResult, Knobs

#: The conformance request set: long enough prompts to span many blocks, short enough to be quick.
NUM_REQUESTS = 24
PROMPT_LEN = (1, 200)
OUTPUT_LEN = (1, 40)
#: Pressure is stated in tokens relative to the workload (kvbench.core.kv_budget) and each engine turns it
#: into its own terms (:meth:`EngineAdapter.pool_knobs`): the pressured pool holds the largest request
#: PRESSURE times over, a sixth of the whole conformance set (reference engine: 24 blocks of 16; vLLM's CPU
#: build: 12 blocks of 32).
PRESSURE = 2.0


def kv_needs(requests: Sequence[GenRequest], outputs: GenResult | None = None) -> list[int]:
    """Each request's KV need in tokens: prompt + ``max_tokens``, or prompt + the tokens it really got in
    ``outputs`` (the ground truth's), for requests that stop early."""
    if outputs is None:
        return [request_tokens(len(r.prompt_token_ids), r.max_tokens) for r in requests]
    return [request_tokens(len(r.prompt_token_ids), len(o.token_ids))
            for r, o in zip(requests, outputs.outputs, strict=True)]


def pressured_knobs(engine: EngineAdapter, requests: Sequence[GenRequest], factor: float = PRESSURE,
                    outputs: GenResult | None = None, **more: Any) -> Knobs:
    """Knobs for a pool that holds the largest of ``requests`` alone (``factor`` times it) but far from all of
    them, in ``engine``'s terms (``outputs``: see :func:`kv_needs`); ``more`` knobs on top."""
    # sized by what the requests really need (``outputs``), yet the largest must be admitted whatever it
    # turns out to need, so ``largest`` is its max_tokens need
    # roundable: any pool within a factor of two of this one pressures the set as meant, so an engine that starts
    # afresh per knob set may give several checks one pool (:func:`kvbench.core.kv_budget.shared_pool`)
    budget = replace(pressured(kv_needs(requests, outputs), factor), largest=max(kv_needs(requests), default=1),
                     roundable=True)
    knobs = engine.pool_knobs(budget).merged(Knobs(**more))
    _mark_run(engine, requests, unpressured=False)
    return knobs


def roomy_knobs(engine: EngineAdapter, requests: Sequence[GenRequest], sent: Sequence[GenRequest] = (),
                **more: Any) -> Knobs:
    """Knobs for a run of ``requests`` in which nothing is preempted: a pool that holds every one of them at once,
    or, on a server whose pool is fixed (:meth:`OpenAIAdapter.fixed_pool`), its own pool with the run marked
    unpressured, so the adapter sends it in waves that each fit the pool (:meth:`OpenAIAdapter.mark_run`).
    ``sent``: the requests the run really sends, where they are more than the pool is sized for (a request sent
    to be refused): the run is marked by them."""
    knobs = engine.pool_knobs(roomy(kv_needs(requests))).merged(Knobs(**more))
    _mark_run(engine, sent or requests, unpressured=True)
    return knobs


def together_knobs(engine: EngineAdapter, requests: Sequence[GenRequest], **more: Any) -> Knobs:
    """Knobs for a run that sends ``requests`` all at once and preempts none, with no room to spare: a pool that
    holds them all in whole blocks (:func:`~kvbench.core.kv_budget.together`), which an engine that starts
    afresh per knob set rounds up to a pool other checks share (one launch, not one of its own, as
    :func:`roomy_knobs`' pool four times the need would be). For a run that cannot go in waves (a served
    workload); ``more`` knobs on top."""
    knobs = engine.pool_knobs(together(kv_needs(requests), engine.kv_layout.block_size())).merged(Knobs(**more))
    _mark_run(engine, requests, unpressured=True)
    return knobs


def _mark_run(engine: EngineAdapter, requests: Sequence[GenRequest], *, unpressured: bool) -> None:
    """Tell an engine with a fixed pool whether the coming run of ``requests`` is to be unpressured (it then goes in
    waves that fit the pool) or pressured (all at once); engines whose pool a check sets need not know."""
    mark = getattr(engine, "mark_run", None)
    if mark is not None:
        mark(requests, unpressured=unpressured)


def model_vocab(model_dir: str) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from the checkpoint's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 2048))


def conformance_requests(model_dir: str, seed: int = 2024, n: int = NUM_REQUESTS, temperature: float = 0.0,
                         shared_prefix: int = 0, prompt_len: tuple[int, int] = PROMPT_LEN,
                         output_len: tuple[int, int] = OUTPUT_LEN) -> list[GenRequest]:
    """The seeded request set every engine gets (the same seed gives the same requests everywhere)."""
    from kvbench.bench.workloads import AllAtOnce, SharedPrefix, Uniform, WorkloadSpec

    vocab, _ = model_vocab(model_dir)
    spec = WorkloadSpec(
        name="conformance", num_requests=n, input_len=Uniform(*prompt_len), output_len=Uniform(*output_len),
        arrival=AllAtOnce(), seed=seed, temperature=temperature,
        shared_prefix=SharedPrefix(num_groups=2, prefix_len=shared_prefix) if shared_prefix else None)
    workload = spec.build(vocab)
    return [GenRequest(r.request_id, list(r.prompt_token_ids), r.max_tokens, temperature=r.temperature,
                       seed=r.seed if r.seed is not None else (1000 + i if temperature > 0 else None))
            for i, r in enumerate(workload.requests)]


#: at most this many requests in a set sized to a server's pool (bounded runs)
MAX_FITTED_REQUESTS = 256


def fitted_requests(engine: EngineAdapter, model_dir: str, **kwargs: Any) -> list[GenRequest]:
    """The conformance request set, sized to the pool of a server that is already running (whose pool a check
    cannot change, :meth:`OpenAIAdapter.fixed_pool`): request lengths scaled so the pool holds the largest
    PRESSURE times (within the model's and the server's length limits), and more requests where the lengths
    alone cannot give a workload of about six pools' worth. Engines whose pool a check sets get
    :func:`conformance_requests` unchanged. Skips when no bounded request set can pressure the pool."""
    fixed = getattr(engine, "fixed_pool", None)
    pool = fixed() if fixed is not None else None
    if pool is None:
        return conformance_requests(model_dir, **kwargs)
    tokens = pool.block_size * pool.num_gpu_blocks
    _, max_len = model_vocab(model_dir)
    max_len = min(max_len, pool.max_model_len or max_len)
    largest = min(int(tokens / PRESSURE), max_len)
    scale = largest / (PROMPT_LEN[1] + OUTPUT_LEN[1])
    prompt = (1, max(2, int(PROMPT_LEN[1] * scale)))
    output = (1, max(2, int(OUTPUT_LEN[1] * scale)))
    average = (prompt[1] + output[1]) / 2
    n = max(kwargs.pop("n", NUM_REQUESTS), math.ceil(6 * tokens / average))  # all of them: ~6 pools' worth
    if n > MAX_FITTED_REQUESTS:
        pytest.skip(f"{engine.name}'s pool ({tokens} tokens) is too large to pressure with at most "
                    f"{MAX_FITTED_REQUESTS} requests of at most {max_len} tokens; start the server with a smaller "
                    "pool (--num-gpu-blocks-override), or let kvbench start one (--engine server:...)")
    return conformance_requests(model_dir, n=n, prompt_len=prompt, output_len=output, **kwargs)


@dataclass
class Comparison:
    """Per-request verdicts of one engine run against the ground truth."""

    label: str
    verdicts: list[tuple[str, Verdict]] = field(default_factory=list)
    #: the engine's compute dtype when it is unknown (None: known), so the ground truth's float32 cannot judge
    #: its near-ties: a mismatch then leaves the check undecided instead of failing it
    unknown_dtype_of: str | None = None

    @property
    def mismatches(self) -> list[tuple[str, Verdict]]:
        return [(rid, v) for rid, v in self.verdicts if v.status == "mismatch"]

    @property
    def near_ties(self) -> list[tuple[str, Verdict]]:
        return [(rid, v) for rid, v in self.verdicts if v.status == "near_tie"]


def near_tie_tolerance(engine: EngineAdapter, override: float | None = None) -> float:
    """The near-tie tolerance ``engine`` is judged with: ``override`` (``--kvbench-near-tie-tolerance``) when
    given, else the default of the dtype it computes in (:meth:`EngineAdapter.compute_dtype`)."""
    return override if override is not None else tolerance_for(engine.compute_dtype())


def exact_only(engine: EngineAdapter) -> bool:
    """Whether ``engine`` is held to exact token equality: the reference engine in float32 is, since it
    computes what the float32 ground truth computes. In bfloat16 or float16 it is not: its compiled decode
    kernel and its prefill path round differently, so the same engine's greedy pick flips at a near-tie
    between a decode and a recompute of the same position (measured: docs/checks.md)."""
    return engine.kind == "reference" and engine.compute_dtype() in (None, "float32")


def compare_outputs(engine: EngineAdapter, result: GenResult, truth: GenResult, requests: Sequence[GenRequest],
                    margins_of: Any, label: str, tolerance: float | None = None,
                    aborted: Collection[str] = (), gap_of: Any = None) -> Comparison:
    """Verdicts for every request. ``margins_of(prompt, tokens)`` gives the ground truth's top-2
    margins (only asked for where tokens diverge). The reference engine in float32 gets no near-tie
    excuse (:func:`exact_only`). ``tolerance``: default :func:`near_tie_tolerance` of ``engine``.
    ``aborted``: the ids of the requests the check itself aborted; any other abort is a mismatch.
    ``gap_of(prompt, tokens, position, token)``, if given (``HFAdapter.logit_gap``), confirms each near-tie:
    the engine's token must be within the tolerance of the ground truth's best (:func:`confirm_near_tie`)."""
    # what a pinned finding may need of the checkpoint (kvbench.conformance.preconditions), from the truth compared
    note_greedy_reaches_eos(getattr(engine, "model_dir", None), requests, truth.outputs)
    dtype_of = getattr(engine, "compute_dtype", None)
    comparison = Comparison(label, unknown_dtype_of=None if dtype_of is None or dtype_of() else engine.name)
    exact = exact_only(engine)
    tolerance = near_tie_tolerance(engine) if tolerance is None else tolerance
    for req, got, want in zip(requests, result.outputs, truth.outputs, strict=True):
        margins: list[float] = []
        if got.token_ids != want.token_ids and not exact and got.token_ids and want.token_ids:
            margins = margins_of(req.prompt_token_ids, want.token_ids)
        verdict = compare(want.token_ids, got.token_ids, margins, tolerance=tolerance,
                          expected_finish_reason=want.finish_reason, actual_finish_reason=got.finish_reason,
                          abort_requested=req.request_id in aborted)
        if verdict.status == "near_tie" and gap_of is not None:
            verdict = confirm_near_tie(verdict, gap_of(req.prompt_token_ids, want.token_ids, verdict.position,
                                                       verdict.actual_token))
        comparison.verdicts.append((req.request_id, verdict))
    return comparison


def assert_conforms(comparison: Comparison, near_ties: list[str] | None = None) -> None:
    """Fail naming every mismatching request; record near-ties (they are not failures)."""
    if near_ties is not None:
        near_ties.extend(f"{comparison.label}: {rid}: {v.explain()}" for rid, v in comparison.near_ties)
    bad = comparison.mismatches
    if bad and comparison.unknown_dtype_of is not None:
        # a bfloat16 server (a GPU vLLM at --dtype auto) differs from a float32 ground truth at its near-ties;
        # without its dtype, kvbench cannot tell those from a wrong answer
        undecided(f"{comparison.label}: {len(bad)} of {len(comparison.verdicts)} requests differ from the float32 "
                  f"ground truth, and {comparison.unknown_dtype_of}'s compute dtype is unknown, so kvbench cannot tell "
                  "a reduced-precision near-tie from a wrong answer (start the server with --dtype). First: "
                  f"{bad[0][0]}: {bad[0][1].explain()}")
    if bad:
        lines = "\n".join(f"  {rid}: {v.explain()}" for rid, v in bad[:10])
        pytest.fail(f"{comparison.label}: {len(bad)} of {len(comparison.verdicts)} requests differ from the ground "
                    f"truth:\n{lines}", pytrace=False)


#: counters whose firing depends on when requests arrive (a preemption needs the pool to run dry while requests
#: overlap), not only on what was asked: zero of them over HTTP is undecided, not failed (:func:`prove`)
TIMED_TRIGGERS = frozenset({"preemptions_recompute", "preemptions_swap"})


#: pressured runs tried on an engine kvbench does not step while its timed trigger stayed at zero (see
#: :func:`until_triggered`); on a stepped engine one run is the answer
TIMED_TRIES = 3


def until_triggered(engine: EngineAdapter, counter: str | Sequence[str], attempt: Callable[[], Any]) -> Any:
    """The result of ``attempt`` (one pressured run whose outputs it checks itself, failing the check on a
    mismatch), run again while ``counter``, a timed trigger (:data:`TIMED_TRIGGERS`), stayed at zero on an engine
    kvbench does not step, at most :data:`TIMED_TRIES` times: over HTTP whether a pool runs dry depends on how the
    requests' arrivals overlapped (a loaded machine spreads them), so a run that did not preempt is served again
    rather than left undecided at once. A failed attempt is never tried again (its claim ends the check); on an
    engine kvbench steps, or for any other counter, one attempt. ``counter`` may name several (any of them moving
    is the trigger), and the result may be a trace (both have ``counters``). Records how many were made
    (``pressured_tries``)."""
    counters = (counter,) if isinstance(counter, str) else tuple(counter)
    timed = not getattr(engine, "steppable", False) and any(c in TIMED_TRIGGERS for c in counters)
    tries = TIMED_TRIES if timed else 1

    def fired(result: Any) -> bool:
        return any((result.counters.get(c) or 0) > 0 for c in counters)

    def exposed(result: Any) -> bool:  # an engine that counts none of them cannot show one fired: no retry
        return any(c in result.counters for c in counters)

    made, result = 1, attempt()
    while made < tries and exposed(result) and not fired(result):
        made, result = made + 1, attempt()
    record_evidence("pressured_tries", made)
    return result


def quietly(engine: EngineAdapter) -> contextlib.AbstractContextManager:
    """A block in which nothing else of ``engine``'s starts (no server started ahead for a later test, those still
    starting paused: :meth:`ServerAdapter.quiet <kvbench.engines.http.server.ServerAdapter.quiet>`), for a run
    whose reading depends on timing; a no-op on an engine without such starts."""
    quiet = getattr(engine, "quiet", None)
    return quiet() if callable(quiet) else contextlib.nullcontext()


def timed_trigger_missed(engine: EngineAdapter, what: str) -> None:
    """Undecided, saying ``what`` and why, when ``engine`` is one kvbench does not step (a server reached over
    HTTP): there the requests reach it as the client and the machine send them, and on a loaded machine they can
    arrive spread out enough that the pool never runs dry, which says nothing about the engine (the check compared
    its outputs first). Returns on an engine kvbench steps: the same workload preempts there every time, so the
    caller's claim that it did fails."""
    if not getattr(engine, "steppable", False):
        undecided(f"{what} in this run: its requests reached it over HTTP as the machine sent them, and whether a "
                  "pool runs dry depends on how their arrivals overlapped, so the mechanism was not put to the test "
                  "(the outputs were compared)")


def prove(result: GenResult, engine: EngineAdapter, counter: str, what: str, minimum: float = 1) -> float:
    """Prove the engine's ``counter`` reached ``minimum``: the mechanism the check is about fired.

    Call it *after* the outputs were compared, so that a wrong answer fails whatever the engine can prove.
    An engine that does not expose ``counter`` leaves the check undecided (never passed:
    :func:`~kvbench.conformance.verdict.undecided`); a counter below ``minimum`` fails it (a
    :func:`~kvbench.conformance.verdict.claim`, so a pin can excuse exactly this), except a preemption counter
    (:data:`TIMED_TRIGGERS`) on an engine kvbench does not step: whether its pool ran dry depended on how the
    requests' arrivals overlapped, so the check is undecided, saying so. The value is recorded as
    the running test's evidence (``kvbench.evidence.<counter>``) before the verdict, so a failed proof shows
    what was seen, and a proof that holds is recorded as proven (:func:`~kvbench.conformance.verdict.record_proof`)."""
    if counter not in result.counters:
        undecided(f"{engine.name} exposes no {counter!r} counter, so nothing could prove that {what} happened "
                  "(outputs that match decide nothing while the mechanism is unproven)")
    value = result.counters[counter]
    record_evidence(counter, value)
    if value < minimum and counter in TIMED_TRIGGERS:
        timed_trigger_missed(engine, f"{what} did not happen on {engine.name} ({counter}={value})")
    claim(value >= minimum, f"{what} did not happen on {engine.name} ({counter}={value}): the check would pass "
                            f"without exercising the mechanism. Evidence: {result.evidence[:5]}")
    if value >= minimum:
        record_proof(counter, value)
    return value


def greedy(requests: Sequence[GenRequest]) -> list[GenRequest]:
    return [replace(r, temperature=0.0, seed=None) for r in requests]


def require_events(result: GenResult, engine: EngineAdapter, what: str) -> list:
    """The run's events (:mod:`kvbench.core.engine_events`); skip when the engine reports none."""
    if result.events is None:
        pytest.skip(f"{engine.name} reports no engine events, so nothing could prove {what}")
    return result.events


def require_knobs(engine: EngineAdapter, *knobs: str) -> None:
    """Skip, with the adapter's own reason, when the engine cannot set one of these knobs (the check's
    prerequisite, e.g. a block pool to size, is missing: a skip, not a failure)."""
    unsupported = getattr(engine, "unsupported_knobs", {}) or {}
    missing = [k for k in knobs if k in unsupported]
    if missing:
        pytest.skip("; ".join(f"{engine.name} cannot set {k}: {unsupported[k]}" for k in missing))
