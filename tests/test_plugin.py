"""The pytest plugin, tested as users meet it: through pytester in a subprocess."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]


def test_help_lists_the_kvbench_options(pytester: pytest.Pytester):
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*kvbench*", "*--engine=KIND*", "*--benchmark *", "*--benchmark-scale*",
                                 "*--report-dir*", "*--baseline*", "*--threshold*", "*--slo*"])


def test_unknown_engine_kind_is_a_usage_error_listing_kinds_and_keys(pytester: pytest.Pytester):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess("--engine", "warp-drive")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown engine kind 'warp-drive'*", "*MODULE:CLASS*", "*Kinds and their keys:*",
                                 "*reference:*", "*hf-cb:*"])


@pytest.mark.parametrize(("spec", "message"), [
    ("reference:nope=1", "*reference has no option 'nope'*allowed:*block_size*"),
    ("reference:block_size", "*is not KEY=VALUE*"),
    # option values, checked by the engine's own validation before any test runs
    ("reference:num_gpu_blocks_override=-3",
     "*EngineConfig.num_gpu_blocks_override=-3 is invalid: expected None or an integer >= 1*"),
    ("reference:preemption_mode=swapp", "*EngineConfig.preemption_mode='swapp' is invalid: expected one of "
                                        "'recompute', 'swap'*"),
])
def test_bad_engine_option_is_a_usage_error_listing_the_kinds_keys(pytester: pytest.Pytester, spec, message):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess("--engine", spec)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message, "*Its keys:*", "*reference:*", "*num_gpu_blocks_override:*"])
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

    # same run against itself: no regression
    same = pytester.runpytest_subprocess("--benchmark", "--report-dir", "out2", "--baseline", str(results),
                                         "-p", "no:benchmark")
    assert same.ret == 0
    same.stdout.fnmatch_lines(["*no regression against*"])

    # a 30% throughput drop crosses the default -10% threshold: the session fails, naming it
    pytester.makepyfile(_RESULT_TEST.format(throughput=70.0))
    worse = pytester.runpytest_subprocess("--benchmark", "--report-dir", "out3", "--baseline", str(results),
                                          "-p", "no:benchmark")
    worse.assert_outcomes(passed=1)
    assert worse.ret == pytest.ExitCode.TESTS_FAILED
    worse.stdout.fnmatch_lines(["*REGRESSION*storm*reference*output_throughput*"])

    # a looser threshold given on the command line lets it through
    loose = pytester.runpytest_subprocess("--benchmark", "--report-dir", "out4", "--baseline", str(results),
                                          "--threshold", "throughput:-50%", "-p", "no:benchmark")
    assert loose.ret == 0
