"""The pytest plugin, tested as users meet it: through pytester in a subprocess."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]


def test_help_lists_the_kvbench_options(pytester: pytest.Pytester):
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*kvbench*", "*--engine=KIND*", "*--benchmark *", "*--benchmark-scale*",
                                 "*--report-dir*", "*--baseline*", "*--threshold*", "*--slo*"])


def _last_line(result: pytest.RunResult) -> str:
    return [line for line in result.stderr.lines if line.strip()][-1]


def test_unknown_engine_kind_is_a_one_line_usage_error_pointing_at_the_kinds(pytester: pytest.Pytester):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess("--engine", "warp-drive")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    # the error alone, last: the kinds and their keys are a request away (kvbench engines [KIND])
    assert "unknown engine kind 'warp-drive'" in _last_line(result)
    assert "kvbench engines [KIND]" in _last_line(result)
    assert "Kinds and their keys" not in result.stderr.str()


@pytest.mark.parametrize(("spec", "message"), [
    ("reference:nope=1", "*reference has no option 'nope'*allowed:*block_size*"),
    ("reference:block_size", "*is not KEY=VALUE*"),
    # option values, checked by the engine's own validation before any test runs
    ("reference:num_gpu_blocks_override=-3",
     "*EngineConfig.num_gpu_blocks_override=-3 is invalid: expected None or an integer >= 1*"),
    ("reference:preemption_mode=swapp", "*EngineConfig.preemption_mode='swapp' is invalid: expected one of "
                                        "'recompute', 'swap'*"),
])
def test_bad_engine_option_is_a_one_line_usage_error(pytester: pytest.Pytester, spec, message):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess("--engine", spec)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    from fnmatch import fnmatch

    assert fnmatch(_last_line(result), message), f"the error is not the last line: {result.stderr.str()}"
    assert "test_nothing" not in result.stdout.str() and "passed" not in result.stdout.str()


def test_tests_are_parametrised_over_every_engine(pytester: pytest.Pytester):
    pytester.makepyfile("""
        def test_spec(engine_spec):
            assert engine_spec.kind == "reference"
    """)
    result = pytester.runpytest_subprocess("-v", "--engine", "reference", "--engine",
                                           "reference:preemption_mode=swap")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_spec?reference? PASSED*", "*test_spec?reference:preemption_mode=swap? PASSED*"])


def test_the_same_engine_twice_is_refused(pytester: pytest.Pytester):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess("--engine", "reference", "--engine", "reference")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_benchmarks_skip_without_the_flag_and_gpu_tests_skip_without_cuda(pytester: pytest.Pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.benchmark
        def test_storm():
            pass

        @pytest.mark.gpu
        def test_cuda():
            pass
    """)
    result = pytester.runpytest_subprocess("-rs", "-p", "no:benchmark")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*storm benchmark: run with --benchmark*", "*needs a CUDA device*"])


def test_require_skips_naming_engine_and_capability(pytester: pytest.Pytester):
    pytester.makepyfile("""
        from types import SimpleNamespace
        from kvbench.plugin import require

        def test_swap_check():
            require(SimpleNamespace(name="toy", capabilities=frozenset({"recompute"})), "recompute", "swap")
    """)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*toy lacks capability swap*"])


@pytest.mark.parametrize(("args", "message"), [
    (["--baseline", "missing.json"], "*--baseline missing.json: no such file*"),
    (["--threshold", "throughput"], "*--threshold*"),
    (["--benchmark-scale", "huge"], "*invalid choice*"),
])
def test_bad_options_are_usage_errors(pytester: pytest.Pytester, args, message):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize(("args", "repeats"), [
    ([], 3),
    (["--benchmark-scale", "full"], 1),
    (["--benchmark-scale", "full", "--benchmark-repeats", "2"], 2),
    (["--benchmark-repeats", "1"], 1),
])
def test_repeats_default_to_three_at_quick_scale_and_one_at_full(pytester: pytest.Pytester, args, repeats):
    pytester.makepyfile("def test_repeats(kvbench_session): print('REPEATS', kvbench_session.repeats)")
    result = pytester.runpytest_subprocess("-s", *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*REPEATS {repeats}*"])


_RESULT_TEST = """
    import pytest

    @pytest.mark.benchmark
    def test_scenario(kvbench_results):
        kvbench_results.add_scenario_result("storm", "reference", {{"output_throughput": {throughput},
                                                                     "tbt_p99": 0.05}})
"""


def test_benchmark_run_writes_results_report_and_index_then_gates_on_a_baseline(pytester: pytest.Pytester):
    pytester.makepyfile(_RESULT_TEST.format(throughput=100.0))
    first = pytester.runpytest_subprocess("--benchmark", "--report-dir", "out", "-p", "no:benchmark")
    first.assert_outcomes(passed=1)
    assert first.ret == 0
    runs = [p for p in (pytester.path / "out").iterdir() if p.is_dir()]
    assert len(runs) == 1
    results = runs[0] / "results.json"
    data = json.loads(results.read_text())
    assert data["schema_version"] == 1 and data["scenarios"][0]["name"] == "storm"
    assert (runs[0] / "report.html").stat().st_size > 1000
    assert (pytester.path / "out" / "index.html").is_file()
    first.stdout.fnmatch_lines(["*kvbench*", "*report:*report.html*"])

    # same run against itself: no regression (absolute times: with one engine and no counts, the default
    # same-run ratios would compare nothing, and a gate that compares nothing fails rather than pass silently)
    same = pytester.runpytest_subprocess("--benchmark", "--report-dir", "out2", "--baseline", str(results),
                                         "--gate-absolute", "-p", "no:benchmark")
    assert same.ret == 0
    same.stdout.fnmatch_lines(["*no regression*against*"])

    # a 30% throughput drop crosses the default -10% threshold: the session fails, naming it
    pytester.makepyfile(_RESULT_TEST.format(throughput=70.0))
    # (one engine: no same-run ratio to gate, so its absolute times are gated on request)
    worse = pytester.runpytest_subprocess("--benchmark", "--report-dir", "out3", "--baseline", str(results),
                                          "--gate-absolute", "-p", "no:benchmark")
    worse.assert_outcomes(passed=1, failed=1)  # the gate counts as a failed item
    assert worse.ret == pytest.ExitCode.TESTS_FAILED
    worse.stdout.fnmatch_lines(["*REGRESSION*storm*reference*output_throughput*"])

    # a looser threshold given on the command line lets it through
    loose = pytester.runpytest_subprocess("--benchmark", "--report-dir", "out4", "--baseline", str(results),
                                          "--gate-absolute", "--threshold", "throughput:-50%", "-p", "no:benchmark")
    assert loose.ret == 0


# ------------------------------------------------------------------------------ conformance as data
_CONFORMANCE_TESTS = """
    import pytest
    from kvbench.conformance.prove import prove
    from kvbench.engines.base import GenResult

    pytestmark = pytest.mark.conformance


    class Engine:
        name = "toy"


    def test_proved(engine_spec):
        prove(GenResult([], {"preemptions_recompute": 5}), Engine(), "preemptions_recompute", "recompute preemption")


    def test_not_exposed(engine_spec):
        prove(GenResult([]), Engine(), "swap_ins", "a swap-in")


    def test_did_not_fire(engine_spec):
        prove(GenResult([], {"prefix_cache_hits": 0}), Engine(), "prefix_cache_hits", "a prefix-cache hit")


    @pytest.mark.xfail(reason="known upstream bug", strict=True)
    def test_expected_failure(engine_spec):
        assert False


    @pytest.mark.xfail(reason="fixed upstream", strict=True)
    def test_expected_failure_now_passes(engine_spec):
        pass


    @pytest.mark.parametrize("budget", [16, 64])
    def test_chunked(budget, engine_spec):
        pass


    @pytest.mark.conformance(check="named_check")
    def test_with_a_name(engine_spec, kvbench_session):
        kvbench_session.near_ties.append("toy: r1: diverged at a near-tie")


    @pytest.fixture
    def broken():
        raise RuntimeError("setup broke")


    def test_setup_error(engine_spec, broken):
        pass


    @pytest.mark.conformance
    def test_without_an_engine():
        pass
"""


def _run_dir(root) -> object:
    runs = [p for p in root.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_conformance_outcomes_are_written_to_results_json_without_benchmark(pytester: pytest.Pytester):
    pytester.makepyfile(test_checks=_CONFORMANCE_TESTS)
    result = pytester.runpytest_subprocess("--report-dir", "out", "--junitxml", "junit.xml", "-p", "no:benchmark",
                                           "--kvbench-model", str(pytester.path))
    # pytest counts the strict XPASS as failed; the record says what it is
    result.assert_outcomes(passed=5, failed=2, skipped=1, xfailed=1, errors=1)
    run = _run_dir(pytester.path / "out")
    data = json.loads((run / "results.json").read_text())
    assert not (run / "report.html").exists()  # no benchmark: results only
    records = {r["check"]: r for r in data["conformance"]}
    assert sorted(records) == ["chunked[16]", "chunked[64]", "did_not_fire", "expected_failure",
                               "expected_failure_now_passes", "named_check", "not_exposed", "proved", "setup_error"]
    assert all(r["engine"] == "reference" and r["kind"] == "reference" for r in records.values())
    assert records["proved"]["outcome"] == "passed"
    assert records["proved"]["evidence"] == {"preemptions_recompute": 5}
    assert records["proved"]["proven"] == ["preemptions_recompute"] and records["did_not_fire"]["proven"] == []
    assert records["proved"]["nodeid"] == "test_checks.py::test_proved[reference]"
    # an unprovable mechanism is undecided, never passed
    assert records["not_exposed"]["outcome"] == "undecided"
    assert records["not_exposed"]["reason"].startswith("toy exposes no 'swap_ins' counter, so nothing could prove "
                                                       "that a swap-in happened")
    assert records["did_not_fire"]["outcome"] == "failed"
    assert records["did_not_fire"]["evidence"] == {"prefix_cache_hits": 0}  # what was seen, though it failed
    assert "a prefix-cache hit did not happen on toy" in records["did_not_fire"]["reason"]
    assert records["expected_failure"] == {**records["expected_failure"], "outcome": "xfailed",
                                           "reason": "known upstream bug"}
    assert records["expected_failure_now_passes"]["outcome"] == "xpassed"
    assert "fixed upstream" in records["expected_failure_now_passes"]["reason"]
    assert records["named_check"]["near_ties"] == 1 and records["proved"]["near_ties"] == 0
    assert records["setup_error"]["outcome"] == "error" and "setup broke" in records["setup_error"]["reason"]
    assert data["engines"][0]["name"] == "reference" and "swap" in data["engines"][0]["capabilities"]

    result.stdout.fnmatch_lines(["*kvbench conformance*",
                                 "reference: 1 error, 1 failed, 4 passed, 1 undecided, 1 xfailed, 1 xpassed "
                                 "(1 near-ties)", f"conformance results: out?{run.name}?results.json*"])
    # --junitxml carries the evidence as properties of the test case
    junit = (pytester.path / "junit.xml").read_text()
    assert '<property name="kvbench.evidence.preemptions_recompute" value="5"' in junit
    assert '<property name="kvbench.check" value="proved"' in junit


def test_a_run_without_conformance_tests_writes_no_results(pytester: pytest.Pytester):
    pytester.makepyfile("def test_plain(): pass")
    result = pytester.runpytest_subprocess("--report-dir", "out", "-p", "no:benchmark")
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "out").exists()
    assert "kvbench conformance" not in result.stdout.str()


_UNDECIDED_TESTS = """
    import pytest
    from kvbench.conformance.verdict import record_proof

    pytestmark = pytest.mark.conformance


    def test_swap(engine_spec):
        if engine_spec.name != "reference":
            pytest.skip(f"{engine_spec.name} lacks capability swap")
        record_proof("preemptions_swap", 2)


    def test_priority(engine_spec):
        pytest.skip(f"{engine_spec.name} lacks capability priority")


    @pytest.mark.conformance(pressured=False)
    def test_bad_input(engine_spec):
        pass
"""


def test_a_run_that_proved_no_mechanism_for_an_engine_fails_naming_it(pytester: pytest.Pytester):
    """hf decides only the unpressured bad-input check: that proves nothing about preemption, so its run is
    not green (decided means proven); reference proved swap preemption."""
    pytester.makepyfile(test_checks=_UNDECIDED_TESTS)
    result = pytester.runpytest_subprocess("--engine", "reference", "--engine", "hf", "--report-dir", "out",
                                           "-p", "no:benchmark", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3, skipped=3, failed=1)  # the failure is the synthetic kvbench::undecided[hf]
    result.stdout.fnmatch_lines(["*no check under pressure proved its mechanism on hf: 1 of 3 checks decided "
                                 "(bad_input)*", "*1 x skipped: hf lacks capability swap*",
                                 "*1 x skipped: hf lacks capability priority*", "hf: NOTHING PROVEN*"])
    assert "undecided[reference]" not in result.stdout.str()


def test_a_run_that_decided_nothing_fails_saying_so(pytester: pytest.Pytester):
    pytester.makepyfile(test_checks=_UNDECIDED_TESTS)
    result = pytester.runpytest_subprocess("--engine", "hf", "--report-dir", "out", "-k", "not bad_input",
                                           "-p", "no:benchmark", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*no conformance check was decided for hf: all 2 skipped or undecided*"])


def test_a_run_of_unpressured_checks_alone_is_judged_on_what_it_decided(pytester: pytest.Pytester):
    """A run that selected no pressured check (``-k bad_input``) asked nothing of preemption: green when it
    decided something."""
    pytester.makepyfile(test_checks=_UNDECIDED_TESTS)
    result = pytester.runpytest_subprocess("--engine", "hf", "--report-dir", "out", "-k", "bad_input",
                                           "-p", "no:benchmark", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()


def test_a_run_that_decided_something_and_a_simulator_stay_green(pytester: pytest.Pytester):
    """A simulator's checks are skipped by design (placeholder tokens prove nothing): not a run that failed."""
    pytester.makepyfile(test_checks=_UNDECIDED_TESTS)
    result = pytester.runpytest_subprocess("--engine", "reference", "--engine", "sim", "--report-dir", "out",
                                           "-p", "no:benchmark", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=2, skipped=4)
    assert "NOTHING" not in result.stdout.str()


_ECHO_ADAPTER = """
    from kvbench.engines.base import DEFAULT_KNOBS, EngineAdapter, GenOutput, GenResult


    class EchoAdapter(EngineAdapter):
        '''Echoes prompts back.'''

        kind = "echo"
        option_keys = {"preemption_mode": "recompute or swap"}

        def generate(self, requests, knobs=DEFAULT_KNOBS):
            return GenResult([GenOutput(r.request_id, list(r.prompt_token_ids), "length", 0) for r in requests],
                             {"preemptions_recompute": 3})
"""

_OVERRIDING_TEST = """
    import pytest
    from kvbench.conformance.prove import prove
    from kvbench.engines.base import GenRequest, Knobs

    pytestmark = pytest.mark.conformance


    def test_forces_recompute(engine):
        result = engine.generate([GenRequest("r", [1, 2], 1)], Knobs(preemption_mode="recompute"))
        prove(result, engine, "preemptions_recompute", "recompute preemption")


    def test_keeps_the_engine_mode(engine):
        engine.generate([GenRequest("r", [1, 2], 1)], Knobs(block_size=16))
"""


def test_knobs_that_override_an_engine_option_are_recorded_and_reported(pytester: pytest.Pytester):
    pytester.makepyfile(echo_adapter=_ECHO_ADAPTER, test_override=_OVERRIDING_TEST)
    result = pytester.runpytest_subprocess("--engine", "echo_adapter:EchoAdapter:preemption_mode=swap",
                                           "--report-dir", "out", "-p", "no:benchmark",
                                           "--kvbench-model", str(pytester.path))
    result.assert_outcomes(passed=2)
    data = json.loads((_run_dir(pytester.path / "out") / "results.json").read_text())
    records = {r["check"]: r for r in data["conformance"]}
    assert records["forces_recompute"]["knob_overrides"] == {"preemption_mode": ["swap", "recompute"]}
    assert records["forces_recompute"]["engine"] == "echo_adapter:EchoAdapter:preemption_mode=swap"
    assert records["forces_recompute"]["kind"] == "echo"
    assert records["keeps_the_engine_mode"]["knob_overrides"] == {}
    result.stdout.fnmatch_lines(["*echo_adapter:EchoAdapter:preemption_mode=swap: the checks' knob preemption_mode "
                                 "replaced the option value swap in 1 check(s): forces_recompute (recompute)*"])


def test_conformance_records_survive_xdist(pytester: pytest.Pytester):
    """Workers run the tests; the controller rebuilds the records from the reports they send."""
    pytest.importorskip("xdist")
    pytester.makepyfile(test_checks=_CONFORMANCE_TESTS)
    result = pytester.runpytest_subprocess("-n", "2", "--report-dir", "out", "-p", "no:benchmark",
                                           "--kvbench-model", str(pytester.path))
    result.assert_outcomes(passed=5, failed=2, skipped=1, xfailed=1, errors=1)
    records = {r["check"]: r for r in json.loads((_run_dir(pytester.path / "out") / "results.json").read_text())
               ["conformance"]}
    assert len(records) == 9
    assert records["proved"]["evidence"] == {"preemptions_recompute": 5}
    assert records["proved"]["proven"] == ["preemptions_recompute"] and records["did_not_fire"]["proven"] == []
    assert records["named_check"]["near_ties"] == 1
    assert records["expected_failure_now_passes"]["outcome"] == "xpassed"
    assert records["setup_error"]["outcome"] == "error"


def test_two_sessions_started_in_the_same_second_write_two_run_folders(tmp_path):
    """A conformance run beside a benchmark run used to share reports/<second>/ and overwrite each other."""
    from kvbench.plugin.session_end import claim_run_dir as _claim_run_dir

    names = [_claim_run_dir(tmp_path, "20261201-070603") for _ in range(3)]
    assert names == ["20261201-070603", "20261201-070603-2", "20261201-070603-3"]
    assert all((tmp_path / n).is_dir() for n in names)
