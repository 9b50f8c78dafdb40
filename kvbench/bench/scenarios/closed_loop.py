"""The head-to-head as a scenario: closed-loop throughput and TTFT at fixed concurrencies on every engine of a
benchmark session, under matched knobs (docs/benchmarks.md#the-head-to-head-scenario).

What ``kvbench head-to-head`` measures, served the way the storms are recorded: each engine's figures per
concurrency land in results.json (one result per concurrency, mode ``"concurrency N"``, with every round's
figures and their spread) and in the report (:meth:`HeadToHead.tables`, :meth:`HeadToHead.headline`). The
rounds are :func:`kvbench.bench.interleaved_rounds.serve_rounds`' (the engines' order rotating from round to
round, quiet before each timed job), after an untimed warm-up of each engine.

Claims, on each engine:

* **output token counts asserted**: every request got exactly the output tokens it asked for (the workload
  ignores EOS), else the claim fails naming the engine and the requests;
* **greedy outputs cross-checked** (:func:`cross_check`): each request's output token ids compared with the
  first engine's of the same dtype (engines in different dtypes are not compared), as "n of N identical, first
  divergence at token k". A divergence is a finding, shown, not a failure: near-ties legitimately flip a greedy
  choice. A wholesale one, fewer than half identical on a float32 pair, fails the later engine's claim.

Nothing asserts a time. :func:`run_head_to_head` serves a session's engines; :meth:`HeadToHead.judge` alone is
what :func:`kvbench.bench.scenarios.run` calls (one engine, no rotation, no cross-check).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.bench import metrics
from kvbench.bench.formatting import fmt_median_range
from kvbench.bench.interleaved_rounds import WORKLOAD_SEED, Setup, closed_loop, knobs_taken, serve_rounds, warm_up
from kvbench.bench.repeats import repeat_values
from kvbench.bench.scenarios.claims import Decision, decide, not_exposed, not_shown, shown
from kvbench.bench.scenarios.common import (
    Job,
    Model,
    Outcome,
    ResultEntry,
    Scenario,
    Served,
    all_finished,
    job_key,
    machine_load,
)
from kvbench.bench.scenarios.declare import Headline, Pressure, Score, ratio_headline
from kvbench.core.trace import Trace
from kvbench.engines.base import EngineAdapter, Knobs

#: the claim on output token counts
COUNTS_CLAIM = "every request got exactly the output tokens it asked for"
#: the concurrency the scoreboard ranks engines at: both scales serve it
RANKED_AT = 16
#: the dtype in which a wholesale disagreement of greedy outputs fails (in lower precisions near-ties flip often)
STRICT_DTYPE = "float32"
#: the per-round figures the table shows, and their ratio to the first engine's in the same round
FIGURES = ("output_throughput", "ttft_p50", "ttft_p99")


def mode_of(concurrency: float) -> str:
    """A result's mode: ``"concurrency 16"``."""
    return f"concurrency {concurrency:g}"


def ratio_key(metric: str) -> str:
    """The results key of ``metric``'s ratio to the first engine's in the same round (not a time itself)."""
    return f"ratio_{metric}"


class HeadToHead(Scenario):
    name = "head_to_head"
    title = "Head-to-head"
    doc = "docs/benchmarks.md#the-head-to-head-scenario"
    description = ("Closed-loop work at fixed concurrencies on every engine under the same knobs (block size, a pool "
                   "that holds every running request, max_num_seqs, max_num_batched_tokens, max_model_len = prompt + "
                   "output, prefix caching off on all): token-id prompts, greedy, EOS ignored. Rounds interleaved, "
                   "the engines' order rotating; each figure is the median over the rounds with their range, and "
                   "each ratio is taken to the first engine within a round. Claims: every request got exactly its "
                   "output tokens; greedy outputs agree with the first engine of the same dtype (a divergence is "
                   "shown; fewer than half identical in float32 fails).")
    #: the work and knobs: the quick scale small, the full scale ``kvbench head-to-head``'s defaults
    sizes = {  # noqa: RUF012
        "quick": Setup(concurrency=(4, RANKED_AT), rounds=3, requests=32, max_num_seqs=RANKED_AT),
        "full": Setup(),
    }
    #: vLLM's CPU attention takes multiples of 32: one block size every engine takes, at both scales
    block_size = 32
    engine_mode_matters = False  # nothing is preempted: the pool holds every running request
    pressure = Pressure()
    score = Score("output_throughput", True, mode=mode_of(RANKED_AT), label=f"output tok/s at concurrency {RANKED_AT}",
                  why="the same closed-loop work under the same knobs: the tokens each engine delivers per second")

    def size(self, scale: str) -> Setup:
        return super().size(scale)

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        return [Job(closed_loop(model, s.requests, s.prompt, s.output, c, WORKLOAD_SEED), s.knobs(), mode=mode_of(c),
                    x=float(c)) for c in s.concurrency]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        knobs = s.knobs()
        return {"scale": scale, "model": model.preset, "block_size": knobs.block_size,
                "num_gpu_blocks": knobs.num_gpu_blocks, "doc": self.doc,
                "workload": f"{s.requests} requests, prompts {s.prompt} token ids, outputs {s.output} (greedy, EOS "
                            "ignored), closed loop",
                "concurrencies": list(s.concurrency), "max_num_seqs": s.max_num_seqs,
                "max_num_batched_tokens": s.max_num_batched_tokens, "max_model_len": knobs.max_model_len,
                "enable_prefix_caching": False, "cool_down_s": s.cool_down}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        served = sorted(served, key=lambda sv: sv.job.x or 0.0)
        for sv in served:
            out.entries.append(ResultEntry(sv.trace, mode=sv.job.mode, extra={"concurrency": sv.job.x}))
        decide(out, {COUNTS_CLAIM: token_counts([sv.trace for sv in served])})
        out.claims["every request finished at every concurrency"] = all(all_finished(sv.trace) for sv in served)
        return out

    # -- the report ------------------------------------------------------------------------------------------

    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        modes = sorted({r.get("mode") for r in recorded.get("results", []) if r.get("mode")},
                       key=lambda m: float(m.split()[-1]))
        mode = mode_of(RANKED_AT) if mode_of(RANKED_AT) in modes else (modes[-1] if modes else None)
        return ratio_headline(recorded, reference, title="Head-to-head throughput", metric="output_throughput",
                              what=f"output tok/s at {mode or 'a fixed concurrency'}", mode=mode)

    def tables(self, recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [*figure_tables(recorded), *cross_check_table(recorded), *knobs_table(recorded)]


# --------------------------------------------------------------------------------------------
# claims


def miscounted(trace: Trace) -> list[str]:
    """Each request of ``trace`` that got another number of output tokens than its ``max_tokens`` (the tokens the
    client received; the output's token ids where they were kept), in words: ``"r0003 got 63 of 64"``."""
    wrong = []
    for rid, r in trace.requests.items():
        got = len(r.output_token_ids) if r.output_token_ids is not None else len(r.token_times)
        if got != r.max_tokens:
            wrong.append(f"{rid} got {got} of {r.max_tokens}")
    return wrong


def token_counts(traces: Sequence[Trace]) -> Decision:
    """Every request of every trace got exactly ``max_tokens`` output tokens (:func:`miscounted`): shown, or not
    shown naming the engine and the requests. Where the server returned no token ids (``transformers serve``:
    text only), a request's tokens are counted from its stream's text chunks, and a token whose text is empty
    (a special token, part of a character) arrives in no chunk of its own: a count short there is not exposed,
    never a failure; a request whose ids the server returned is held to its count."""
    wrong = [w for trace in traces for w in miscounted(trace)]
    total = sum(len(trace.requests) for trace in traces)
    if not total:
        return not_shown("no request was served")
    engine = traces[0].engine if traces else "?"
    from_chunks = {rid for trace in traces for rid, r in trace.requests.items() if r.output_token_ids is None}
    if wrong and all(w.split(" ", 1)[0] in from_chunks for w in wrong):
        return not_exposed(f"{engine} returns no token ids: its tokens were counted from its stream's text chunks, "
                           f"where a token with empty text arrives in no chunk of its own; {len(wrong)} of {total} "
                           f"counts differ that way ({', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''})")
    if wrong:
        return not_shown(f"{engine}: {len(wrong)} of {total} requests got another number of output tokens than "
                         f"asked: {', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''}")
    return shown(f"{engine}: all {total} requests got exactly the output tokens they asked for")


@dataclass(frozen=True)
class Agreement:
    """Greedy outputs of engine ``b`` against engine ``a`` (the first of their dtype), request by request."""

    a: str
    b: str
    dtype: str
    compared: int
    identical: int
    #: the earliest output token (0-based) at which any request's outputs differ; None when none does
    first_divergence: int | None
    #: requests one of the two engines returned no token ids for (not compared)
    not_recorded: int = 0

    @property
    def words(self) -> str:
        """"30 of 32 identical, first divergence at token 17"."""
        if not self.compared:
            return f"not compared: no output token ids recorded for {self.not_recorded} requests"
        where = ("" if self.first_divergence is None else f", first divergence at token {self.first_divergence}")
        return f"{self.identical} of {self.compared} identical{where}"

    @property
    def wholesale(self) -> bool:
        """Fewer than half identical: more than near-ties can explain, in float32."""
        return self.compared > 0 and 2 * self.identical < self.compared

    def to_dict(self) -> dict[str, Any]:
        return {"engines": [self.a, self.b], "dtype": self.dtype, "compared": self.compared,
                "identical": self.identical, "first_divergence": self.first_divergence,
                "not_recorded": self.not_recorded, "words": self.words}


def first_difference(x: Sequence[int], y: Sequence[int]) -> int | None:
    """The first index at which two token sequences differ (a length difference counts), None if equal."""
    for i, (p, q) in enumerate(zip(x, y, strict=False)):
        if p != q:
            return i
    return None if len(x) == len(y) else min(len(x), len(y))


def compare(a: str, b: str, dtype: str, ta: Sequence[Trace], tb: Sequence[Trace]) -> Agreement:
    """Engine ``b``'s outputs against ``a``'s, job by job (``ta[j]`` and ``tb[j]`` served the same requests)."""
    compared = identical = missing = 0
    first: int | None = None
    for x, y in zip(ta, tb, strict=True):
        for rid, r in x.requests.items():
            other = y.requests.get(rid)
            if r.output_token_ids is None or other is None or other.output_token_ids is None:
                missing += 1
                continue
            compared += 1
            k = first_difference(r.output_token_ids, other.output_token_ids)
            if k is None:
                identical += 1
            else:
                first = k if first is None else min(first, k)
    return Agreement(a, b, dtype, compared, identical, first, missing)


def cross_check(traces: Mapping[str, Sequence[Trace]], dtypes: Mapping[str, str | None]) -> list[Agreement]:
    """Every engine's outputs against the first engine (in ``traces``' order) of the same dtype; engines of
    another dtype are compared only within theirs (one whose dtype is None: float32)."""
    firsts: dict[str, str] = {}
    out = []
    for name, mine in traces.items():
        dtype = dtypes.get(name) or STRICT_DTYPE  # an engine that does not say: float32 (compute_dtype's rule)
        if dtype not in firsts:
            firsts[dtype] = name
            continue
        out.append(compare(firsts[dtype], name, dtype, traces[firsts[dtype]], mine))
    return out


def agreement_decision(agreement: Agreement) -> Decision:
    """The claim on ``agreement.b``: shown unless a float32 pair disagrees wholesale (then not shown); outside
    float32 a divergence is reported and the claim shown, saying so. Nothing compared (an engine that returned no
    token ids): undecided, not exposed."""
    if not agreement.compared:
        return not_exposed(f"{agreement.b} against {agreement.a}: {agreement.words} (an engine whose driver keeps no "
                           "output token ids)")
    if agreement.dtype == STRICT_DTYPE and agreement.wholesale:
        return not_shown(f"{agreement.b} against {agreement.a} ({agreement.dtype}): {agreement.words}: fewer than "
                         "half identical, more than near-ties explain")
    return shown(f"{agreement.b} against {agreement.a} ({agreement.dtype}): {agreement.words}")


def agreement_claim(agreement: Agreement) -> str:
    return f"greedy outputs agree with {agreement.a}'s (at least half identical in {STRICT_DTYPE})"


# --------------------------------------------------------------------------------------------
# serving a session's engines


def engine_dtype(adapter: EngineAdapter) -> str | None:
    """The dtype an engine computes in, where its adapter says; None where it cannot tell, which
    :meth:`~kvbench.engines.base.EngineAdapter.compute_dtype` says is taken as float32 (:func:`cross_check`
    compares it so; the knobs table says "assumed")."""
    try:
        return adapter.compute_dtype()
    except Exception:  # an adapter that cannot tell before it runs
        return None


def run_head_to_head(adapters: Mapping[str, EngineAdapter], model: Model, scale: str, *, rounds: int | None = None,
                     step_seconds: float | None = None, cool_down: float | None = None,
                     say: Callable[[str], None] = lambda line: None,
                     scenario: HeadToHead | None = None) -> dict[str, Outcome | Exception]:
    """Serve :data:`HEAD_TO_HEAD` on every adapter (by engine name, the first the one ratios divide by): an untimed
    warm-up each, then ``rounds`` (default the scale's) interleaved rounds (:func:`serve_rounds`), each judged
    per engine; then the ratios to the first engine within each round and the cross-check of outputs, added to
    each engine's outcome. Returns what :func:`kvbench.bench.scenarios.run_interleaved` returns: per engine its
    first round's :class:`Outcome` with every round in ``repeats``, or the exception serving it raised (the
    others go on). ``cool_down`` overrides the scale's quiet before each job (tests of in-process engines: 0);
    ``scenario`` the sizes (default :data:`HEAD_TO_HEAD`'s)."""
    scenario = scenario or HEAD_TO_HEAD
    s = scenario.size(scale)
    rounds = s.rounds if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    shared = s.knobs()
    knobs: dict[str, Knobs] = {}
    dropped: dict[str, dict[str, str]] = {}
    for name, adapter in adapters.items():
        knobs[name], dropped[name] = knobs_taken(adapter, shared)
    failed: dict[str, Exception] = {}
    live: dict[str, EngineAdapter] = {}
    for name, adapter in adapters.items():  # one engine that cannot start fails its own test only
        try:
            warm_up({name: adapter}, model, knobs.__getitem__, s.prompt, say)
            live[name] = adapter
        except Exception as e:
            failed[name] = e
    loads: list[float | None] = []
    plans: list[list[Job]] = []  # each round's jobs, as served

    def plan() -> list[Job]:
        loads.append(machine_load())
        plans.append(scenario.plan(scale, model))
        return plans[-1]

    served, failed_later = serve_rounds(
        live, plan, rounds, cool_down=s.cool_down if cool_down is None else cool_down,
        knobs_of=lambda name, job: knobs[name], scenario=scenario.name, step_seconds=step_seconds, keep_outputs=True,
        on_served=lambda r, j, name, trace: say(f"   round {r + 1} {mode_of(s.concurrency[j])} {name}: "
                                                 f"{metrics.summarize(trace)['output_throughput'] or 0:,.0f} tok/s"),
        catch=True)
    failed.update(failed_later)
    names = [n for n in adapters if n not in failed]
    judged: dict[str, list[Outcome]] = {n: [] for n in names}
    for r, jobs in enumerate(served):
        for name in list(names):
            try:
                outcome = scenario.judge([Served(plans[r][j], jobs[j][name]) for j in range(len(jobs))], scale, model)
            except Exception as e:  # that engine's result, not the others'
                failed[name] = e
                names.remove(name)
                continue
            outcome.machine_load = loads[r]
            outcome.job_keys = {id(jobs[j][name]): job_key(plans[r][j], adapters[name]) for j in range(len(jobs))}
            judged[name].append(outcome)
    names = [n for n in names if n not in failed]
    _add_ratios(judged, names)
    agreements = cross_check({n: [served[0][j][n] for j in range(len(served[0]))] for n in names},
                             {n: engine_dtype(adapters[n]) for n in names}) if served else []
    params = {"ratio_to": names[0] if names else None, "rounds": rounds,
              "cross_check": [a.to_dict() for a in agreements],
              "knobs_by_engine": {n: {"knobs": {k: v for k, v in knobs[n].as_dict().items() if v is not None},
                                      "left_out": dropped[n],
                                      "dtype": engine_dtype(adapters[n]) or f"{STRICT_DTYPE} (assumed)"}
                                  for n in names}}
    result: dict[str, Outcome | Exception] = {}
    for name in adapters:
        if name in failed:
            result[name] = failed[name]
            continue
        first = judged[name][0]
        # the step clock reaches only an engine kvbench steps (as run_interleaved's): the others ran on the wall
        first.repeats = judged[name]
        first.step_seconds = step_seconds if getattr(adapters[name], "steppable", False) else None
        first.interleaved = tuple(names) if len(names) > 1 else ()
        first.parameters.update(params)
        # the knobs left out and the agreements are the scenario's tables (and the claims' evidence), not notes:
        # one place per fact
        decide(first, {agreement_claim(a): agreement_decision(a) for a in agreements if a.b == name})
        result[name] = first
    return result


def _add_ratios(judged: Mapping[str, list[Outcome]], names: Sequence[str]) -> None:
    """Each engine's figures divided by the first engine's of the same round and job, into its entries' extra."""
    if len(names) < 2:
        return
    base = names[0]
    for name in names[1:]:
        for mine, theirs in zip(judged[name], judged[base], strict=False):
            for e, b in zip(mine.entries, theirs.entries, strict=True):
                m, bm = metrics.summarize(e.trace), metrics.summarize(b.trace)
                for metric in FIGURES:
                    x, y = m.get(metric), bm.get(metric)
                    e.extra[ratio_key(metric)] = x / y if x is not None and y else None


# --------------------------------------------------------------------------------------------
# the report's tables (plain dicts of results.json in, strings out)


def _per_round(result: Mapping[str, Any], metric: str) -> list[float]:
    values = repeat_values(result, metric)
    if values:
        return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    v = result.get("metrics", {}).get(metric)
    return [] if v is None else [v]


def figure_tables(recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One table per concurrency: engines as rows; output tok/s, TTFT p50 and p99, and their ratios to the first
    engine within each round, each as median [min-max] over the rounds."""
    params = recorded.get("parameters", {})
    base = params.get("ratio_to")
    by_mode: dict[str, list[Mapping[str, Any]]] = {}
    for r in recorded.get("results", []):
        if r.get("mode"):
            by_mode.setdefault(r["mode"], []).append(r)
    out = []
    for mode in sorted(by_mode, key=lambda m: float(m.split()[-1])):
        rows = []
        for r in by_mode[mode]:
            ratio = [fmt_median_range(_per_round(r, ratio_key(m)), "{:.2f}x") if r["engine"] != base else "1 (base)"
                     for m in ("output_throughput", "ttft_p50")]
            rows.append([r["engine"], fmt_median_range(_per_round(r, "output_throughput")),
                         fmt_median_range([v * 1000 for v in _per_round(r, "ttft_p50")], "{:,.0f}"),
                         fmt_median_range([v * 1000 for v in _per_round(r, "ttft_p99")], "{:,.0f}"),
                         *(ratio if base else [])])
        columns = ["engine", "output tok/s", "TTFT p50 ms", "TTFT p99 ms"]
        columns += [f"tok/s ÷ {base}", f"TTFT p50 ÷ {base}"] if base else []
        rounds = params.get("rounds")
        out.append({"title": f"Head-to-head at {mode}", "columns": columns, "rows": rows,
                    "note": f"median [min-max] over {rounds or 'the'} rounds; ratios taken within each round; "
                            "TTFT ÷ below 1: the engine answered first"})
    return out


def cross_check_table(recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
    checks = recorded.get("parameters", {}).get("cross_check") or []
    if not checks:
        return []
    rows = [[f"{c['engines'][1]} vs {c['engines'][0]}", c["dtype"], c["words"]] for c in checks]
    return [{"title": "Greedy outputs cross-checked", "columns": ["engines", "dtype", "agreement"], "rows": rows,
             "note": "the first round's outputs, request by request; engines compared only within a dtype. A "
                     "divergence is a finding, not a failure (near-ties flip greedy choices); fewer than half "
                     f"identical in {STRICT_DTYPE} fails"}]


def knobs_table(recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
    by_engine = recorded.get("parameters", {}).get("knobs_by_engine") or {}
    if not by_engine:
        return []
    keys = list(dict.fromkeys(k for v in by_engine.values() for k in v.get("knobs", {})))
    rows = [[name, str(v.get("dtype") or "?"), *(str(v.get("knobs", {}).get(k, "left out")) for k in keys)]
            for name, v in by_engine.items()]
    notes = [f"{name}: {k} left out ({why})" for name, v in by_engine.items()
             for k, why in v.get("left_out", {}).items()]
    return [{"title": "Knobs every engine was given", "columns": ["engine", "dtype", *keys], "rows": rows,
             "note": "as kvbench sets them, before each engine restates its pool in its own blocks; "
                     + ("; ".join(notes) if notes else "every knob matched on every engine")}]


HEAD_TO_HEAD = HeadToHead()
