"""Engines keep the order the user gave on the command line: in test ids and in the terminal summary."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_engines_keep_the_order_given(pytester: pytest.Pytester):
    pytester.makepyfile("""
        import pytest
        from kvbench.conformance.verdict import record_proof

        @pytest.mark.conformance
        def test_proves(engine_spec):
            record_proof("preemptions_recompute", 1)
    """)
    engines = ["reference:preemption_mode=swap", "reference", "reference:preemption_mode=auto"]
    args = [a for e in engines for a in ("--engine", e)]
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"*test_proves?{e}? PASSED*" for e in engines])
    summary = result.stdout.str().split("kvbench conformance", 1)[1]
    lines = [line.rsplit(": ", 1)[0] for line in summary.splitlines()
             if line.startswith("reference") and line.endswith(" passed")]
    assert lines == engines, summary
