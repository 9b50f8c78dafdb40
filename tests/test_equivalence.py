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
    assert (v.status, v.position) == ("mismatch", None)
    assert "expected 3 tokens and got 2" in v.explain()
    # an EOS stop on one side only means the engines disagree on EOS handling
    assert compare([1, 2, 3], [1, 2], actual_finish_reason="stop").status == "mismatch"
    assert compare([1, 2], [1, 2, 3], expected_finish_reason="stop").status == "mismatch"
    assert compare([1, 2, 3], [1, 2], actual_finish_reason="error").status == "mismatch"


def test_aborted_prefix_is_exact():
    v = compare([1, 2, 3], [1, 2], actual_finish_reason="abort")
    assert v.status == "exact"
    assert "aborted" in v.explain()


def test_aborted_but_divergent_is_still_judged_on_tokens():
    assert compare([1, 2, 3], [1, 5], margins=[1, 1, 1], actual_finish_reason="abort").status == "mismatch"


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
