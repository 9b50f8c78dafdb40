"""The equivalence rule: when do an engine's tokens count as "the same" as the ground truth's?

The reference engine in float32 is held to exact token equality (in bfloat16 or float16 it is not:
see below). Any other engine (``hf-cb``, a remote server) computes the same float32 model through
different kernels, batch shapes and attention layouts, so its logits differ from the ground truth's
(``hf``) by float noise, and greedy decoding may pick the other token where the top-2 logits are
(nearly) tied. After such a flip the two continuations are legitimately different, so comparing
further is meaningless.

:func:`compare` therefore walks both token lists to the first divergence and asks how close the
ground truth's top-1/top-2 logits were at that position (``margins``, from
:meth:`kvbench.engines.hf.generate.HFAdapter.top2_margins`):

* ``exact``: same tokens, same length (or the actual output is a prefix of the expected one and
  the check aborted that request on purpose: see below);
* ``near_tie``: the first divergence sits where the ground truth's margin is below ``tolerance``:
  float noise may flip it, so it is not evidence of a bug;
* ``mismatch``: anything else, with its ``cause`` named (:data:`CAUSES`): a divergence at a
  confident position or where no margin is known, or a length difference that the finish reasons
  do not explain.

Length differences with no token divergence (one output is a strict prefix of the other). Both sides
of a comparison are expected to have run with the same ``max_tokens`` and ``ignore_eos``, so the
only legitimate reason for one to be shorter is that the check cut it short on purpose: the shorter
side's finish reason is ``"abort"`` *and* the caller says so (``abort_requested=True``). That counts
as ``exact`` (the tokens it did produce are right) and :meth:`Verdict.explain` says so. An abort
nobody asked for is the engine dropping a request (a preemption victim it gave up on, say): a
mismatch whose cause is ``unrequested_abort``. So are a rejection (``rejected``), a ``"length"``
finish short of the other side's length (``truncated``), a ``"stop"`` on one side only (the engines
disagree on EOS handling: ``early_stop``), an ``"error"`` (``error``), and an engine output longer
than the ground truth's (``overrun``).

Why ``DEFAULT_TOLERANCE = 1e-3`` (logits, not probabilities): the float32 noise between two correct
implementations of the tiny/small presets (incremental decode vs a full forward, paged vs contiguous
attention, batch of 1 vs a packed batch) is about 1e-5 to 1e-4 in the logits (see
``kvbench.models.random_llama.measure_margins``'s ``float32_noise``). 1e-3 leaves an order of
magnitude of headroom above that, while the checkpoints are built so that greedy margins are O(1):
a KV-cache bug shows up as a divergence at a position with a large margin and is never excused.

Reduced precision (:data:`TOLERANCES`, :func:`tolerance_for`). An engine that runs bfloat16 or float16
is compared with a ground truth in the same dtype (transformers' ``generate`` loaded in it): rounding
the float32 weights to bfloat16 makes another model, whose logits sit up to 3.6 away from float32's on
the built-in checkpoints (a top-1 gain; 10% of ``small``'s greedy picks differ), above their median
margin (1.3-1.7). Within bfloat16 the noise between correct computations (the compiled decode kernel
vs the prefill path's SDPA, batch of 1 vs 16, vs transformers' dense forward) reached a top-1 gain
of 1.39 (``small``; tiny 0.72; p99 1.2); the tolerance, 2.0, is 1.4x the largest seen. float16: 0.17
at most (``small``; tiny 0.10), tolerance 0.25. The figures and their command
(``python -m kvbench.models.random_llama --measure-margins DIR --dtype bfloat16``,
:mod:`kvbench.models.logit_noise`) are in docs/checks.md.

A bfloat16 tolerance is above the top-2 margin at about 60% of the checkpoints' positions, so the
margin alone would excuse most divergences, a KV-cache bug's included (``scrambles_swap_in`` passed
that way). :func:`confirm_near_tie` therefore also asks how far below the ground truth's best the
engine's token was: noise flips a pick only to a token within the tolerance (the divergences of a
correct bfloat16 engine were at gap 0, exact bfloat16 ties), while corrupted KV picked tokens 7 to 33
logits down. The check applies in every dtype; in float32 it changes nothing for a real near-tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

#: Near-tie tolerance on the top-1 minus top-2 logit margin, per dtype the engine computes in (see the
#: module docstring for how each was chosen).
TOLERANCES: dict[str, float] = {"float32": 1e-3, "bfloat16": 2.0, "float16": 0.25}
#: The tolerance of a float32 engine, and of one whose dtype is unknown.
DEFAULT_TOLERANCE = TOLERANCES["float32"]


def tolerance_for(dtype: str | None) -> float:
    """The near-tie tolerance of an engine computing in ``dtype`` (``None``: unknown, taken as float32)."""
    if dtype is None:
        return DEFAULT_TOLERANCE
    if dtype not in TOLERANCES:
        raise ValueError(f"no near-tie tolerance for dtype {dtype!r}: expected one of {sorted(TOLERANCES)}")
    return TOLERANCES[dtype]

STATUSES = ("exact", "near_tie", "mismatch")

#: Why a verdict is a mismatch (``Verdict.cause``), each with the words the verdict explains it in.
CAUSES: dict[str, str] = {
    "divergence": "a token differs where the ground truth is confident or its margin is unknown",
    "unrequested_abort": "aborted by the engine, not asked for",
    "rejected": "rejected by the engine",
    "truncated": "finished 'length' short of the other side's length",
    "early_stop": "finished 'stop' where the other side went on",
    "error": "failed with an error",
    "overrun": "the engine produced more tokens than the ground truth",
    "unexplained": "shorter, with a finish reason that does not explain it",
}
#: The shorter side's finish reason -> the cause of the length mismatch (anything else: ``unexplained``).
_SHORT_FINISH_CAUSES = {"abort": "unrequested_abort", "rejected": "rejected", "length": "truncated",
                        "stop": "early_stop", "error": "error"}


@dataclass(frozen=True)
class Verdict:
    """The outcome of comparing one request's tokens with the ground truth.

    ``position`` is the index of the first divergent token (``None`` if the tokens agree on their
    common length), ``margin`` the ground truth's top-2 margin there (``None`` if unknown or no
    divergence). ``note`` says why a verdict that is not plainly exact was reached; ``cause`` names
    a mismatch's kind (a key of :data:`CAUSES`; empty unless the status is ``mismatch``).
    """

    status: str
    position: int | None
    margin: float | None
    expected_len: int
    actual_len: int
    tolerance: float
    note: str = ""
    expected_token: int | None = None
    actual_token: int | None = None
    cause: str = ""

    @property
    def ok(self) -> bool:
        """True unless the verdict is a mismatch."""
        return self.status != "mismatch"

    def explain(self) -> str:
        """One human-readable sentence (or two) for assertion messages and reports."""
        if self.status == "exact":
            text = f"exact: {self.actual_len} tokens agree"
            return f"{text} ({self.note})" if self.note else text
        if self.position is None:  # mismatch on length only
            return (f"mismatch ({self.cause}): tokens agree on their common length but expected "
                    f"{self.expected_len} tokens and got {self.actual_len}; {self.note}")
        where = (f"first divergence at generated position {self.position}: expected token "
                 f"{self.expected_token}, got {self.actual_token}")
        if self.status == "near_tie":
            return (f"near_tie: {where}, where the ground truth's top-2 margin {self.margin:.3g} < tolerance "
                    f"{self.tolerance:.3g}: float noise may flip it")
        if self.margin is None or self.note:
            return f"mismatch: {where}; {self.note}"
        return (f"mismatch: {where}, where the ground truth's top-2 margin {self.margin:.3g} >= tolerance "
                f"{self.tolerance:.3g}: not a near tie")


def compare(
    expected_tokens: Sequence[int],
    actual_tokens: Sequence[int],
    margins: Sequence[float] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    expected_finish_reason: str | None = None,
    actual_finish_reason: str | None = None,
    abort_requested: bool = False,
) -> Verdict:
    """Compare an engine's tokens with the ground truth's under the near-tie rule.

    ``margins[i]`` is the ground truth's top-1 minus top-2 logit margin of the distribution that
    predicted ``expected_tokens[i]`` (``HFAdapter.top2_margins``); ``None`` or a too-short list
    means "unknown", and a divergence at a position with an unknown margin is a mismatch.
    Finish reasons matter only for length differences (see the module docstring): a shorter output
    finished ``"abort"`` is exact only when ``abort_requested`` says the check aborted that request.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    expected, actual = list(expected_tokens), list(actual_tokens)
    common = dict(expected_len=len(expected), actual_len=len(actual), tolerance=tolerance)

    for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
        if e == a:
            continue
        margin = float(margins[i]) if margins is not None and i < len(margins) else None
        tokens = dict(expected_token=e, actual_token=a)
        if margin is None:
            return Verdict("mismatch", i, None, note="no ground-truth margin known at that position",
                           cause="divergence", **tokens, **common)
        if margin < tolerance:
            return Verdict("near_tie", i, margin, **tokens, **common)
        return Verdict("mismatch", i, margin, cause="divergence", **tokens, **common)

    if len(expected) == len(actual):
        return Verdict("exact", None, None, **common)
    actual_shorter = len(actual) < len(expected)
    shorter = "actual" if actual_shorter else "expected"
    shorter_reason = actual_finish_reason if actual_shorter else expected_finish_reason
    if shorter_reason == "abort" and abort_requested:
        return Verdict("exact", None, None, note=f"{shorter} output is a prefix: that request was aborted, as asked",
                       **common)
    cause = _SHORT_FINISH_CAUSES.get(shorter_reason or "", "unexplained")
    if not actual_shorter and cause != "unrequested_abort":
        cause = "overrun"
    return Verdict("mismatch", None, None, cause=cause,
                   note=(f"the {shorter} output is a strict prefix, finished {shorter_reason!r}: {CAUSES[cause]} "
                         "(only an abort the check asked for explains a shorter output)"),
                   **common)


def confirm_near_tie(verdict: Verdict, gap: float | None) -> Verdict:
    """A near-tie stays one only if the engine's token is within the tolerance of the ground truth's best.

    ``gap``: the ground truth's top-1 logit minus its logit for the engine's token at the divergence
    (``HFAdapter.logit_gap``; None: unknown, the verdict stands). Noise can only flip the pick to a token
    that was nearly as good, so a gap at or above the tolerance is a mismatch even where the top-2 margin
    was small. This matters in bfloat16, whose tolerance (2.0) is above the margin at about 60% of the
    positions, yet only one or two tokens of 512 lie within it of the best: without this, a KV-cache bug
    that picks an arbitrary token at a close position would be excused."""
    if verdict.status != "near_tie" or gap is None or gap < verdict.tolerance:
        return verdict
    return replace(verdict, status="mismatch", cause="divergence",
                   note=(f"the ground truth's top-2 margin there is {verdict.margin:.3g}, but the engine's token "
                         f"is {gap:.3g} below the ground truth's best (>= tolerance {verdict.tolerance:.3g}): "
                         "noise does not pick a token that far down"))
