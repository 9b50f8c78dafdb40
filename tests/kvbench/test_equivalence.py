"""Unit tests of the near-tie equivalence rule (kvbench.conformance.equivalence)."""

from __future__ import annotations

import pytest

from kvbench.conformance.equivalence import DEFAULT_TOLERANCE, Verdict, compare


def test_identical_tokens_are_exact():
    v = compare([1, 2, 3], [1, 2, 3], margins=[5.0, 5.0, 5.0])
    assert (v.status, v.position, v.margin, v.ok) == ("exact", None, None, True)
    assert v.explain() == "exact: 3 tokens agree"


def test_exact_needs_no_margins():
    assert compare([4, 5], [4, 5]).status == "exact"


def test_divergence_at_near_tie_is_excused():
    v = compare([1, 2, 3, 4], [1, 2, 9, 9], margins=[3.0, 2.0, 1e-4, 0.5])
    assert (v.status, v.position, v.margin) == ("near_tie", 2, pytest.approx(1e-4))
    assert (v.expected_token, v.actual_token) == (3, 9)
    assert v.ok
    assert "position 2" in v.explain() and "near_tie" in v.explain()


def test_divergence_at_confident_position_is_a_mismatch():
    v = compare([1, 2, 3], [1, 7, 3], margins=[3.0, 2.0, 1.0])
    assert (v.status, v.position, v.margin, v.ok) == ("mismatch", 1, 2.0, False)
    assert "expected token 2, got 7" in v.explain()


def test_only_the_first_divergence_counts():
    # After a near-tie flip the continuations legitimately differ: later confident positions are not judged.
    v = compare([1, 2, 3], [9, 8, 7], margins=[1e-5, 9.0, 9.0])
    assert (v.status, v.position) == ("near_tie", 0)


def test_margin_equal_to_tolerance_is_not_a_near_tie():
    v = compare([1], [2], margins=[0.5], tolerance=0.5)
    assert v.status == "mismatch"
    assert compare([1], [2], margins=[0.499], tolerance=0.5).status == "near_tie"


def test_unknown_margin_at_divergence_is_a_mismatch():
    assert compare([1, 2], [1, 3]).status == "mismatch"
    v = compare([1, 2], [1, 3], margins=[0.0])  # too short to cover position 1
    assert (v.status, v.position, v.margin) == ("mismatch", 1, None)
    assert "no ground-truth margin" in v.explain()


def test_length_difference_without_divergence_is_a_mismatch():
    v = compare([1, 2, 3], [1, 2], margins=[1.0, 1.0, 1.0],
                expected_finish_reason="length", actual_finish_reason="length")
    assert (v.status, v.position, v.cause) == ("mismatch", None, "truncated")
    assert "expected 3 tokens and got 2" in v.explain() and "(truncated)" in v.explain()
    # an EOS stop on one side only means the engines disagree on EOS handling
    assert compare([1, 2, 3], [1, 2], actual_finish_reason="stop").cause == "early_stop"
    assert compare([1, 2], [1, 2, 3], expected_finish_reason="stop").cause == "overrun"
    assert compare([1, 2, 3], [1, 2], actual_finish_reason="error").cause == "error"
    assert compare([1, 2, 3], [1, 2], actual_finish_reason=None).cause == "unexplained"


def test_requested_abort_explains_a_prefix():
    v = compare([1, 2, 3], [1, 2], actual_finish_reason="abort", abort_requested=True)
    assert (v.status, v.cause) == ("exact", "")
    assert "aborted, as asked" in v.explain()


@pytest.mark.parametrize(("reason", "cause", "words"), [
    ("abort", "unrequested_abort", "aborted by the engine, not asked for"),
    ("rejected", "rejected", "rejected by the engine"),
    ("length", "truncated", "finished 'length' short"),
])
def test_unrequested_abort_rejection_and_truncation_are_named_mismatches(reason, cause, words):
    v = compare([1, 2, 3], [1, 2], actual_finish_reason=reason)
    assert (v.status, v.cause, v.ok) == ("mismatch", cause, False)
    assert words in v.explain()


def test_asking_for_an_abort_excuses_nothing_else():
    # abort_requested explains an abort, not a rejection or a truncation of the same request
    assert compare([1, 2, 3], [], actual_finish_reason="rejected", abort_requested=True).cause == "rejected"
    assert compare([1, 2, 3], [1], actual_finish_reason="length", abort_requested=True).cause == "truncated"
    assert compare([1, 2, 3], [1, 2, 3], actual_finish_reason="abort", abort_requested=True).status == "exact"


def test_aborted_but_divergent_is_still_judged_on_tokens():
    v = compare([1, 2, 3], [1, 5], margins=[1, 1, 1], actual_finish_reason="abort", abort_requested=True)
    assert (v.status, v.cause) == ("mismatch", "divergence")


def test_compare_outputs_excuses_only_the_requests_the_check_aborted():
    from types import SimpleNamespace

    from kvbench.conformance.prove import compare_outputs
    from kvbench.core.requests import GenOutput, GenRequest, GenResult

    requests = [GenRequest("a", [1], 3), GenRequest("b", [1], 3)]
    truth = GenResult([GenOutput("a", [1, 2, 3], "length"), GenOutput("b", [4, 5, 6], "length")])
    got = GenResult([GenOutput("a", [1], "abort"), GenOutput("b", [4], "abort")])
    engine = SimpleNamespace(kind="reference", compute_dtype=lambda: "float32")
    comparison = compare_outputs(engine, got, truth, requests, None, "run", aborted={"a"})
    assert [(rid, v.status, v.cause) for rid, v in comparison.verdicts] == [
        ("a", "exact", ""), ("b", "mismatch", "unrequested_abort")]


def test_default_tolerance_and_validation():
    assert DEFAULT_TOLERANCE == 1e-3
    assert compare([1], [2], margins=[5e-4]).status == "near_tie"
    assert compare([1], [2], margins=[2e-3]).status == "mismatch"
    with pytest.raises(ValueError, match="tolerance"):
        compare([1], [1], tolerance=-1.0)


def test_verdict_is_a_frozen_dataclass():
    v = compare([1], [1])
    assert isinstance(v, Verdict)
    with pytest.raises(AttributeError):
        v.status = "mismatch"  # type: ignore[misc]
