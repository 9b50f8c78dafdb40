"""The equivalence rule: when do an engine's tokens count as "the same" as the ground truth's?

The reference engine is held to exact token equality. Any other engine (``hf-cb``, a remote server)
computes the same float32 model through different kernels, batch shapes and attention layouts, so
its logits differ from the ground truth's (``hf``) by float noise, and greedy decoding may pick the
other token where the top-2 logits are (nearly) tied. After such a flip the two continuations are
legitimately different, so comparing further is meaningless.

:func:`compare` therefore walks both token lists to the first divergence and asks how close the
ground truth's top-1/top-2 logits were at that position (``margins``, from
:meth:`kvbench.engines.hf.HFAdapter.top2_margins`):

* ``exact``: same tokens, same length (or the actual output is a prefix of the expected one and
  the request was aborted: see below);
* ``near_tie``: the first divergence sits where the ground truth's margin is below ``tolerance``:
  float noise may flip it, so it is not evidence of a bug;
* ``mismatch``: anything else: a divergence at a confident position, a divergence where no margin is
  known, or a length difference that the finish reasons do not explain.

Length differences with no token divergence (one output is a strict prefix of the other). Both sides
of a comparison are expected to have run with the same ``max_tokens`` and ``ignore_eos``, so the
only legitimate reason for one to be shorter is that it was cut short on purpose: the shorter side's
finish reason is ``"abort"``. That counts as ``exact`` (the tokens it did produce are right) and
:meth:`Verdict.explain` says so. Everything else is a ``mismatch``: a ``"stop"`` on one side only
means the engines disagree on EOS handling, ``"length"`` on both means they disagree on
``max_tokens``, and ``"error"`` is a failure.

Why ``DEFAULT_TOLERANCE = 1e-3`` (logits, not probabilities): the float32 noise between two correct
implementations of the tiny/small presets (incremental decode vs a full forward, paged vs contiguous
attention, batch of 1 vs a packed batch) is about 1e-5 to 1e-4 in the logits (see
``reference_engine.checkpoint.measure_margins``'s ``float32_noise``). 1e-3 leaves an order of
magnitude of headroom above that, while the checkpoints are built so that greedy margins are O(1):
a KV-cache bug shows up as a divergence at a position with a large margin and is never excused.
Use a larger tolerance for float16/bfloat16 engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Default near-tie tolerance on the top-1 minus top-2 logit margin (see the module docstring).
DEFAULT_TOLERANCE = 1e-3

STATUSES = ("exact", "near_tie", "mismatch")


@dataclass(frozen=True)
class Verdict:
    """The outcome of comparing one request's tokens with the ground truth.

    ``position`` is the index of the first divergent token (``None`` if the tokens agree on their
    common length), ``margin`` the ground truth's top-2 margin there (``None`` if unknown or no
    divergence). ``note`` says why a verdict that is not plainly exact was reached.
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
            return (f"mismatch: tokens agree on their common length but expected {self.expected_len} tokens "
                    f"and got {self.actual_len}; {self.note}")
        where = (f"first divergence at generated position {self.position}: expected token "
                 f"{self.expected_token}, got {self.actual_token}")
        if self.status == "near_tie":
            return (f"near_tie: {where}, where the ground truth's top-2 margin {self.margin:.3g} < tolerance "
                    f"{self.tolerance:.3g}: float noise may flip it")
        if self.margin is None:
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
) -> Verdict:
    """Compare an engine's tokens with the ground truth's under the near-tie rule.

    ``margins[i]`` is the ground truth's top-1 minus top-2 logit margin of the distribution that
    predicted ``expected_tokens[i]`` (``HFAdapter.top2_margins``); ``None`` or a too-short list
    means "unknown", and a divergence at a position with an unknown margin is a mismatch.
    Finish reasons matter only for length differences (see the module docstring).
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
                           **tokens, **common)
        status = "near_tie" if margin < tolerance else "mismatch"
        return Verdict(status, i, margin, **tokens, **common)

    if len(expected) == len(actual):
        return Verdict("exact", None, None, **common)
    shorter_reason = actual_finish_reason if len(actual) < len(expected) else expected_finish_reason
    shorter = "actual" if len(actual) < len(expected) else "expected"
    if shorter_reason == "abort":
        return Verdict("exact", None, None, note=f"{shorter} output is a prefix: that request was aborted",
                       **common)
    return Verdict("mismatch", None, None,
                   note=(f"the {shorter} output is a strict prefix and its finish reason {shorter_reason!r} "
                         "does not explain it (only 'abort' does)"),
                   **common)
