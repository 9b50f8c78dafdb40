"""Calibrate a profile from what a client sees: for a served engine whose steps are not visible (vLLM).

``kvbench calibrate`` records each step of the reference engine; a server only shows its client
token times and its ``/metrics``. Two kinds of designed cells make those times say what a step costs:

* **decode cells** (context ``C`` x batch ``B``): ``B`` requests of ``C``-token prompts sent at
  once, ``decode_tokens`` tokens each. Where the server publishes its own per-request decode time
  (vLLM's ``vllm:request_decode_time_seconds``, engine-core timestamps), each request's is
  ``decode_tokens - 1`` steps of ``B`` decodes (:func:`engine_decode_span`). Otherwise the client's
  times: once every request has its first token and before any finishes, each step is ``B`` decodes,
  so a request's tokens in that window time a run of known decode steps (:func:`decode_span`).
  On this machine vLLM's front end often delivered a request's 96 tokens as one chunk at its end
  (its output collector merges what the stream has not taken yet), leaving no such window.
* **prefill cells** (``P`` tokens): one request alone, ``max_tokens=1``: its TTFT is the steps of a
  chunked prefill of ``P`` tokens (:func:`~reference_engine.sim.calibrate.prefill_steps`) plus the
  request's way in and out (the fitted ``per_request_s``).

Both become :class:`~reference_engine.sim.calibrate.SpanSample` s, fitted by
:func:`~reference_engine.sim.calibrate.fit_spans` to the same cost model the simulator prices steps
with. ``/metrics`` (vLLM's ``vllm:request_prefill_time_seconds`` and
``vllm:time_to_first_token_seconds``, summed over the prefill cells) tells how much of a lone
TTFT the engine itself spent: the rest is the HTTP path, which the simulator charges as
``per_request_s``.

Where the engine timed a decode cell itself, the cell also says how the server's front end delivered
it: a :class:`~kvbench.sim.front_end.DeliveryCell` (the engine's step time, the tokens per chunk the
client saw), in ``totals["delivery"]``, for :func:`~kvbench.sim.front_end.fit_front_end`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbench.bench.workloads import Workload
from kvbench.core.requests import WorkloadRequest
from kvbench.core.trace import Trace
from kvbench.sim.front_end import DeliveryCell, tokens_per_chunk
from reference_engine.costs import CostModel, HardwareProfile, StepShape
from reference_engine.sim.calibrate import SpanSample, fit_spans, prefill_steps, span_errors

#: /metrics sums read around the prefill cells (vLLM's names; a server without them gives None)
PREFILL_METRICS = ("vllm:request_prefill_time_seconds_sum", "vllm:time_to_first_token_seconds_sum",
                   "vllm:num_preemptions_total")
#: the engine's own decode time per request (first token to last, engine-core timestamps), summed
DECODE_METRICS = ("vllm:request_decode_time_seconds_sum", "vllm:request_decode_time_seconds_count")
#: the engine's own time per request (queued, and first scheduled to last token; engine-core timestamps), summed
ENGINE_TIME_METRICS = ("vllm:request_queue_time_seconds_sum", "vllm:request_inference_time_seconds_sum")


@dataclass(frozen=True)
class ClientDesign:
    """Decode cells ``(context, batch)`` and prefill sizes; ``rounds`` interleaved passes over all."""

    decode_cells: tuple[tuple[int, int], ...] = ((32, 1), (32, 4), (32, 8), (32, 12), (160, 1), (160, 4),
                                                 (160, 6), (416, 1), (416, 3))
    #: long enough that every request of a cell decodes beside all the others for a while, though a
    #: loaded API server takes the requests in one after another (with 24 some cells of 16 never overlapped)
    decode_tokens: int = 96
    prefills: tuple[int, ...] = (32, 128, 320, 512, 800)
    prefill_repeats: int = 2
    rounds: int = 3

    def check_fits(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """ValueError naming the cell that would not fit the pool whole (a preemption would change
        the steps the design times) or the model's length."""
        for context, batch in self.decode_cells:
            need = batch * -(-(context + self.decode_tokens) // block_size)
            if need > num_blocks or context + self.decode_tokens > max_model_len:
                raise ValueError(f"ClientDesign.decode_cells: (context {context}, batch {batch}) needs {need} "
                                 f"blocks of {block_size} and {context + self.decode_tokens} tokens; the pool has "
                                 f"{num_blocks} blocks, max_model_len is {max_model_len}")
        if max(self.prefills) + 1 > max_model_len or -(-max(self.prefills) // block_size) > num_blocks:
            raise ValueError(f"ClientDesign.prefills={self.prefills}: longer than the pool or max_model_len")


def _prompt(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(3, vocab_size, size=n).tolist()


def decode_workload(context: int, batch: int, tokens: int, vocab_size: int, rng: np.random.Generator) -> Workload:
    """``batch`` requests of ``context`` random prompt tokens, ``tokens`` output tokens each, all at once."""
    reqs = [WorkloadRequest(f"r{i:04d}", _prompt(rng, context, vocab_size), tokens, 0.0) for i in range(batch)]
    return Workload(f"decode-c{context}-b{batch}", reqs, batch, {"kind": "client-calibration decode"})


def prefill_workload(prompts: Sequence[int], vocab_size: int, rng: np.random.Generator) -> Workload:
    """One request per prompt length, one at a time (closed loop of 1), ``max_tokens=1``."""
    reqs = [WorkloadRequest(f"r{i:04d}", _prompt(rng, p, vocab_size), 1, 0.0) for i, p in enumerate(prompts)]
    return Workload("prefills", reqs, 1, {"kind": "client-calibration prefill"})


def decode_span(token_times: Sequence[Sequence[float]], context: int, group: str = "") -> SpanSample | None:
    """The steady window of a decode cell: every request has its first token (the batch is whole)
    and none has its last (nobody has left). Taken on the request with the most tokens inside it:
    from its first token in the window to its last, ``k`` decode steps of ``len(token_times)``
    sequences, the one timed at position ``context + j - 1`` for its ``j``-th token. None when the
    window holds fewer than two of its tokens."""
    batch = len(token_times)
    if batch == 0 or any(len(t) < 2 for t in token_times):
        return None
    start = max(t[0] for t in token_times)
    end = min(t[-1] for t in token_times)
    best: tuple[int, int] | None = None
    for times in token_times:
        inside = [j for j, t in enumerate(times) if start <= t <= end and j >= 1]
        if len(inside) >= 2 and (best is None or inside[-1] - inside[0] > best[1] - best[0]):
            best = (inside[0], inside[-1])
            chosen = times
    if best is None:
        return None
    a, b = best
    shapes = tuple(StepShape.decode_batch(batch, context + j - 1) for j in range(a + 1, b + 1))
    return SpanSample(shapes, 0, chosen[b] - chosen[a], group)


def ttft_spans(trace: Trace, budget: int, group: str = "prefill") -> list[SpanSample]:
    """One span per finished request of a prefill cell: its TTFT, as the chunked prefill's steps
    plus one request taken in."""
    out = []
    for r in trace.requests.values():
        if r.token_times:
            out.append(SpanSample(prefill_steps(r.prompt_len, budget), 1, r.token_times[0] - r.arrival,
                                  f"{group} {r.prompt_len}"))
    return out


@dataclass
class ClientCalibration:
    """The fitted profile, its spans, and what ``/metrics`` said about the prefill cells."""

    profile: HardwareProfile
    spans: list[SpanSample] = field(repr=False)
    model_shape: Any = field(repr=False)
    metrics: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        c = self.profile.coefficients
        cost = CostModel(self.model_shape, self.profile)
        errors = span_errors(cost, self.spans)
        by_kind: dict[str, list[float]] = {}
        for s, e in zip([s for s in self.spans if s.seconds > 0], errors, strict=True):
            by_kind.setdefault(s.group.split()[0], []).append(e)
        kinds = ", ".join(f"{k} median {statistics.median(v):.1%} ({len(v)})" for k, v in sorted(by_kind.items()))
        lines = [f"client-side fit {self.profile.name!r}: fixed {c.fixed_s * 1e3:.2f} ms, per seq "
                 f"{c.per_seq_s * 1e6:.0f} us, per request {c.per_request_s * 1e3:.2f} ms, dense x{c.dense:.2f}, "
                 f"attention x{c.attention:.2f}, memory x{c.memory:.2f}; span errors: {kinds}"]
        m = self.metrics
        if m.get("client_ttft_s") is not None and m.get("server_prefill_s") is not None:
            lines.append(f"  /metrics over the prefill cells: client TTFT sum {m['client_ttft_s']:.3f} s, server TTFT "
                         f"{_s(m.get('server_ttft_s'))}, engine prefill time {_s(m.get('server_prefill_s'))} "
                         f"(the rest, {_s(m['client_ttft_s'] - m['server_prefill_s'])}, is queueing and HTTP)")
        if m.get("preemptions"):
            lines.append(f"  WARNING: the calibration itself preempted {m['preemptions']:g} times")
        return "\n".join(lines)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def client_spans(serve: Callable[[Workload], Trace], scrape: Callable[[], Any] | None, vocab_size: int,
                 budget: int, design: ClientDesign, rng: np.random.Generator,
                 say: Callable[[str], None] = print) -> tuple[list[SpanSample], dict[str, Any]]:
    """One pass over ``design``'s cells (its ``rounds`` ignored): the spans, and the ``/metrics`` sums
    over its prefill cells (:data:`PREFILL_METRICS`, plus ``client_ttft_s``) with ``delivery``: a
    :class:`~kvbench.sim.front_end.DeliveryCell` per decode cell the engine timed itself. ``scrape``: a
    ``/metrics`` snapshot (``.value(name)``), or None; ``budget``: the server's ``max_num_batched_tokens``."""
    spans: list[SpanSample] = []
    delivery: list[DeliveryCell] = []
    for context, batch in design.decode_cells:
        before = _read(scrape, DECODE_METRICS + ENGINE_TIME_METRICS)
        trace = serve(decode_workload(context, batch, design.decode_tokens, vocab_size, rng))
        after = _read(scrape, DECODE_METRICS + ENGINE_TIME_METRICS)
        span = engine_decode_span(before, after, batch, context, design.decode_tokens, f"decode c{context} b{batch}")
        per_chunk = tokens_per_chunk([q.token_times for q in trace.requests.values()])
        if span is not None and per_chunk is not None:
            step_s = span.seconds / len(span.shapes)
            delivery.append(DeliveryCell(batch, design.decode_tokens, step_s, per_chunk,
                                         delivery_lag(trace, before, after, batch)))
        if span is None:  # no /metrics: the client's own window
            span = decode_span([q.token_times for q in trace.requests.values()], context,
                               f"decode c{context} b{batch}")
        if span is None:
            say(f"  decode cell (context {context}, batch {batch}): no steady window (the requests' first and last "
                "tokens did not overlap)")
            continue
        spans.append(span)
    before = _read(scrape)
    prompts = [p for p in design.prefills for _ in range(design.prefill_repeats)]
    got = ttft_spans(serve(prefill_workload(prompts, vocab_size, rng)), budget)
    after = _read(scrape)
    totals: dict[str, Any] = {"client_ttft_s": sum(s.seconds for s in got), "delivery": delivery}
    for k in PREFILL_METRICS:
        if before.get(k) is not None and after.get(k) is not None:
            totals[k] = after[k] - before[k]
    return spans + got, totals


def fit_client(base: HardwareProfile, model_shape, spans: list[SpanSample], totals: list[dict[str, Any]],
               name: str = "client-fit") -> ClientCalibration:
    """``base``'s coefficients fitted to ``spans`` (of one or more passes; ``totals``: their /metrics sums)."""
    profile = base.with_coefficients(fit_spans(CostModel(model_shape, base), spans), name=name,
                                     source="kvbench.sim.client_calibration: client-side spans")

    def total(key: str) -> float | None:
        values = [t[key] for t in totals if key in t]
        return sum(values) if values else None

    metrics = {"client_ttft_s": total("client_ttft_s"), "server_prefill_s": total(PREFILL_METRICS[0]),
               "server_ttft_s": total(PREFILL_METRICS[1]), "preemptions": total(PREFILL_METRICS[2])}
    return ClientCalibration(profile, spans, model_shape, metrics)


def calibrate_client(serve: Callable[[Workload], Trace], scrape: Callable[[], Any] | None, model_shape,
                     base: HardwareProfile, budget: int, design: ClientDesign | None = None, seed: int = 0,
                     name: str = "client-fit", say: Callable[[str], None] = print) -> ClientCalibration:
    """``design.rounds`` passes of :func:`client_spans`, then :func:`fit_client`."""
    design = design or ClientDesign()
    rng = np.random.default_rng(seed)
    spans: list[SpanSample] = []
    totals = []
    for r in range(design.rounds):
        got, t = client_spans(serve, scrape, model_shape.vocab_size, budget, design, rng, say)
        spans += got
        totals.append(t)
        say(f"  calibration round {r + 1}/{design.rounds}: {len(spans)} spans so far")
    return fit_client(base, model_shape, spans, totals, name)


def engine_decode_span(before: dict[str, float | None], after: dict[str, float | None], batch: int, context: int,
                       tokens: int, group: str = "") -> SpanSample | None:
    """A decode cell timed by the engine itself: ``vllm:request_decode_time_seconds`` (first token to
    last, engine-core timestamps) summed over the cell's ``batch`` requests, per request: ``tokens - 1``
    decode steps of ``batch`` sequences. What a client sees of a stream on a loaded machine can be one
    chunk of every token at the end (vLLM's front end merges a request's outputs when it falls
    behind), which times nothing; the engine's timestamps do not depend on delivery. None unless the
    counter moved by exactly ``batch`` requests."""
    s0, s1 = before.get(DECODE_METRICS[0]), after.get(DECODE_METRICS[0])
    n0, n1 = before.get(DECODE_METRICS[1]), after.get(DECODE_METRICS[1])
    if None in (s0, s1, n0, n1) or round(n1 - n0) != batch or tokens < 2:  # type: ignore[operator]
        return None
    shapes = tuple(StepShape.decode_batch(batch, context + j - 1) for j in range(1, tokens))
    return SpanSample(shapes, 0, (s1 - s0) / batch, group)  # type: ignore[operator]


def delivery_lag(trace: Trace, before: dict[str, float | None], after: dict[str, float | None],
                 batch: int) -> float | None:
    """The mean over a cell's requests of the client's send-to-finish time less the engine's own time
    for them (:data:`ENGINE_TIME_METRICS`, moved by the cell); None unless every request finished and the
    server published both sums."""
    done = [r.finished - r.arrival for r in trace.requests.values() if r.finished is not None]
    engine = [after.get(k) - before.get(k) for k in ENGINE_TIME_METRICS  # type: ignore[operator]
              if after.get(k) is not None and before.get(k) is not None]
    if len(done) != batch or len(engine) != len(ENGINE_TIME_METRICS) or batch == 0:
        return None
    return sum(done) / batch - sum(engine) / batch


def _read(scrape: Callable[[], Any] | None, names: Sequence[str] = PREFILL_METRICS) -> dict[str, float | None]:
    snap = scrape() if scrape is not None else None
    if snap is None:
        return {}
    return {k: snap.value(k) for k in names}
