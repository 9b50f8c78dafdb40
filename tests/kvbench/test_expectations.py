"""Expected failures: the TOML file is validated, entries match engine kind or family, check id and the
engine's versions, and in a pytest run they become strict xfails pinned to their failure message: another
failure of the same check is a failure, and a fix is reported as "now passes: the expectation is stale"."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.conformance.expectations import (
    SHIPPED,
    Expectation,
    ExpectationsError,
    load_expectations,
    matching,
    resolve,
)

pytest_plugins = ["pytester"]

ENTRY = '''
[[expected_failure]]
engine = "{engine}"
check = "{check}"
match = "{match}"
reason = "upstream bug {check}"
reproduction = "python repro.py {check}"
{extra}
'''


def write(tmp_path, *entries: dict[str, str]) -> str:
    path = tmp_path / "expect.toml"
    path.write_text("".join(ENTRY.format(**{"extra": "", "match": "the upstream bug", **e}) for e in entries))
    return str(path)


def test_entries_are_read_with_their_fields(tmp_path):
    path = write(tmp_path, {"engine": "hf-cb", "check": "over_long*", "extra": 'versions = { transformers = ">=5.0" }'})
    [e] = load_expectations(path)
    assert (e.engine, e.check, e.match, e.reason, e.reproduction, e.versions) == (
        "hf-cb", "over_long*", "the upstream bug", "upstream bug over_long*", "python repro.py over_long*",
        {"transformers": ">=5.0"})
    assert e.source == path


GOOD_ENTRY = '[[expected_failure]]\nengine = "x"\ncheck = "c"\nmatch = "m"\nreason = "r"\nreproduction = "p"\n'


@pytest.mark.parametrize(("text", "field"), [
    ('[[expected_failure]]\nengine = "x"\ncheck = "c"\nmatch = "m"\nreason = "r"\n', "reproduction"),
    (GOOD_ENTRY.replace('engine = "x"', 'engine = ""'), "engine"),
    (GOOD_ENTRY + "why = 1\n", "why"),
    (GOOD_ENTRY + 'versions = { transformers = "five" }\n', "versions.transformers"),
    (GOOD_ENTRY.replace('match = "m"\n', ""), "field 'match' must be a non-empty string.*pins what its failure"),
    (GOOD_ENTRY.replace('match = "m"', 'match = "("'), "field 'match' = '\\(' is not a valid regex"),
    ('[expected]\n', "expected"),
    ('not toml = = 1', "not valid TOML"),
])
def test_a_malformed_file_is_refused_naming_the_field(tmp_path, text, field):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ExpectationsError, match=field):
        load_expectations(path)


def test_matching_by_kind_check_variant_and_version():
    e = Expectation("hf-cb", "chunked_prefill_equivalence", "r", "p", {"transformers": ">=5.24,<5.26"})
    versions = {"transformers": "5.24.0"}.get
    assert e.applies("hf-cb", "chunked_prefill_equivalence[16]", versions)  # a bare name matches every variant
    assert not e.applies("reference", "chunked_prefill_equivalence[16]", versions)
    assert not e.applies("hf-cb", "recompute_preemption_equivalence", versions)
    assert not e.applies("hf-cb", "chunked_prefill_equivalence", {"transformers": "5.26.1"}.get)  # fixed upstream?
    assert not e.applies("hf-cb", "chunked_prefill_equivalence", {}.get)  # not installed
    assert matching([e], "hf-cb", "chunked_prefill_equivalence[64]", versions) is e


def test_an_entry_may_name_the_engine_family_behind_an_adapter():
    e = Expectation("vllm", "swap*", "r", "p", {"vllm": ">=0.11"})
    server_says = {"vllm": "0.11.2"}.get  # what the server runs, not what is installed here
    assert e.applies("openai", "swap_preemption_equivalence", server_says, family="vllm")
    assert not e.applies("openai", "swap_preemption_equivalence", server_says, family="sglang")
    assert not e.applies("openai", "swap_preemption_equivalence", {"vllm": "0.10.0"}.get, family="vllm")
    assert matching([e], "openai", "swap_preemption_equivalence", server_says, family="vllm") is e


def test_an_adapter_is_its_own_family_and_reports_installed_versions_by_default(tmp_path):
    from kvbench.engines.base import EngineAdapter

    class Plain(EngineAdapter):
        kind = "plain"

        def generate(self, requests, knobs=None):
            raise NotImplementedError

    adapter = Plain(str(tmp_path))
    assert adapter.family() == "plain"
    assert adapter.engine_version("pytest") == pytest.__version__
    assert adapter.engine_version("no-such-distribution-kvbench") is None


def test_the_failure_must_match_the_pin():
    e = Expectation("hf-cb", "c", "r", "p", match=r"prefix-cache hit .* did not happen")
    assert e.matches_failure("AssertionError: prefix-cache hit on resume did not happen on hf-cb")
    assert not e.matches_failure("Failed: hf-cb recompute: 3 of 24 requests differ from the ground truth")
    assert not Expectation("hf-cb", "c", "r", "p").matches_failure("anything")  # no pin: nothing is expected


def test_the_shipped_files_load_and_name_checks_that_exist_with_a_pin():
    suites = Path(__file__).parents[2] / "suites" / "conformance"
    sources = "".join(p.read_text() for p in suites.glob("test_*.py"))
    files = sorted(SHIPPED.glob("*.toml"))
    assert {f.stem for f in files} >= {"hf", "hf-cb", "vllm"}
    for f in files:
        for e in load_expectations(f):
            assert e.engine == f.stem
            name = e.check.split("[", 1)[0]  # a parametrized variant names its test function before the [
            assert f"def test_{name}(" in sources, f"{f.name}: no conformance test named {e.check}"
            assert e.match.strip(), f"{f.name}: {e.check} is not pinned to a failure message"


def test_a_bare_engine_kind_names_the_shipped_file(tmp_path, monkeypatch):
    assert resolve("hf-cb") == SHIPPED / "hf-cb.toml"
    assert load_expectations("hf-cb") == load_expectations(SHIPPED / "hf-cb.toml")
    with pytest.raises(ExpectationsError, match=r"'sglang': not a shipped file \(shipped: hf, hf-cb, llamacpp, vllm\)"):
        resolve("sglang")
    # anything that is a file, or looks like a path, is taken as given, never as a shipped name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").write_text(ENTRY.format(engine="hf", check="mine", extra="", match="x"))
    assert [e.check for e in load_expectations("hf")] == ["mine"]
    assert resolve("sub/hf-cb") == Path("sub/hf-cb")
    with pytest.raises(ExpectationsError, match=r"hf-cb\.toml: no such file"):
        load_expectations("hf-cb.toml")


SUITE = '''
import pytest
from kvbench.conformance.verdict import claim, record_proof, undecided
pytestmark = pytest.mark.conformance

def test_known_bug(engine_spec):
    assert False, "the upstream bug"

def test_new_bug(engine_spec):
    assert False, "something else broke"

def test_fixed_bug(engine_spec):
    pass

def test_needs_a_capability(engine_spec):
    pytest.skip("reference lacks capability teleport")

def test_healthy(engine_spec):
    record_proof("preemptions_recompute", 3)  # a pressured check that proved its mechanism: the run can be green

def test_pinned_then_leaks(engine_spec):
    claim(False, "aborts counter 0 but 8 requests were aborted")
    claim(False, "3 blocks are still held after every request finished")

def test_pinned_then_clean(engine_spec):
    claim(False, "aborts counter 0 but 8 requests were aborted")
    claim(True, "no block leaked")

def test_unprovable(engine_spec):
    undecided("no counter could prove it")

def test_pinned_then_unprovable(engine_spec):
    claim(False, "aborts counter 0 but 8 requests were aborted")
    undecided("no counter could prove the rest")
'''


def test_listed_failures_pass_the_run_and_are_printed(pytester, tmp_path):
    pytester.makepyfile(test_suite=SUITE)
    path = write(tmp_path, {"engine": "reference", "check": "known_bug"})
    result = pytester.runpytest_subprocess("--engine", "reference", "--kvbench-expectations", path, "-p",
                                           "no:cacheprovider", "-k", "known_bug or fixed_bug or healthy")
    result.assert_outcomes(passed=2, xfailed=1)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*kvbench expected failures*", "*expected failure*test_known_bug*upstream bug "
                                 "known_bug (reproduce: python repro.py known_bug)*"])


def test_a_pin_excuses_one_assertion_and_the_rest_of_the_check_still_runs(pytester, tmp_path):
    """The pinned abort-count failure holds in both checks; the one whose later assertion fails (a leak) is a
    failure, the one whose later assertions pass is the expected failure."""
    pytester.makepyfile(test_suite=SUITE)
    path = write(tmp_path, {"engine": "reference", "check": "pinned_then_*", "match": "aborts counter 0 but"})
    result = pytester.runpytest_subprocess("--engine", "reference", "--kvbench-expectations", path, "-p",
                                           "no:cacheprovider", "-rfx", "-k", "pinned_then or healthy")
    result.assert_outcomes(passed=1, xfailed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*FAILED BEYOND ITS EXPECTED FAILURE] the failure pinned in * held, and then: AssertionError: 3 blocks are "
        "still held*",
        "*expected failure*test_pinned_then_clean*(the rest of the check passed)*",
        "*expected failure*test_pinned_then_unprovable*(the rest of the check did not decide: no counter could prove "
        "the rest)*"])


def test_a_pin_whose_check_now_skips_or_is_undecided_is_stale(pytester, tmp_path):
    pytester.makepyfile(test_suite=SUITE)
    path = write(tmp_path, {"engine": "reference", "check": "needs_a_capability"},
                 {"engine": "reference", "check": "unprovable"})
    result = pytester.runpytest_subprocess("--engine", "reference", "--kvbench-expectations", path, "-p",
                                           "no:cacheprovider", "-rf", "-k",
                                           "needs_a_capability or test_unprovable or healthy")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*now skips (reference lacks capability teleport): the expectation is stale*",
                                 "*now undecided (no counter could prove it): the expectation is stale*"])


def test_a_finding_on_a_release_outside_its_range_still_reproduces_not_a_new_failure(pytester, tmp_path):
    """An entry pinned to releases before the one installed: the same failure is reported as "still
    reproduces on <release>" (the run stays green); another failure of the check is still a failure."""
    import pytest as installed

    pytester.makepyfile(test_suite=SUITE)
    extra = 'versions = { pytest = "<1" }'
    path = write(tmp_path, {"engine": "reference", "check": "known_bug", "extra": extra},
                 {"engine": "reference", "check": "new_bug", "extra": extra})
    result = pytester.runpytest_subprocess("--engine", "reference", "--kvbench-expectations", path, "-p",
                                           "no:cacheprovider", "-rfx", "-k", "bug or healthy")
    result.assert_outcomes(passed=2, xfailed=1, failed=1)
    result.stdout.fnmatch_lines([f"*STILL REPRODUCES*test_known_bug*still reproduces on pytest {installed.__version__} "
                                 "(the entry is pinned to pytest <1*",
                                 "*UNEXPECTED FAILURE*test_new_bug*"])


def test_a_failure_that_does_not_match_its_pin_is_a_failure(pytester, tmp_path):
    # both fail; only the failure the entry pins is the expected one, the other names the entry it missed
    pytester.makepyfile(test_suite=SUITE)
    path = write(tmp_path, {"engine": "reference", "check": "*_bug", "match": "upstream bug"})
    result = pytester.runpytest_subprocess("--engine", "reference", "--kvbench-expectations", path, "-p",
                                           "no:cacheprovider", "-k", "known_bug or new_bug or healthy", "-rf")
    result.assert_outcomes(passed=1, xfailed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        f"*UNEXPECTED FAILURE] failed, but not as the expected failure in {path} (engine 'reference', check '*_bug') "
        "pins it (match 'upstream bug'): AssertionError: something else broke*",
        "*UNEXPECTED FAILURE*test_new_bug*does not match reference / *_bug*"])


def test_a_fixed_bug_fails_the_run_saying_the_expectation_is_stale(pytester, tmp_path):
    pytester.makepyfile(test_suite=SUITE)
    path = write(tmp_path, {"engine": "reference", "check": "fixed_bug"},
                 {"engine": "hf", "check": "known_bug"})  # another kind's entry does not apply
    result = pytester.runpytest_subprocess("--engine", "reference", "--kvbench-expectations", path, "-p",
                                           "no:cacheprovider", "-rf", "-k",
                                           "test_fixed_bug or test_known_bug or test_healthy")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([f"*now passes: the expectation is stale, remove it from {path}*",
                                 "*STALE*test_fixed_bug*now passes*"])


def test_a_bad_expectations_file_is_a_usage_error(pytester, tmp_path):
    pytester.makepyfile(test_suite=SUITE)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[expected_failure]]\nengine = "reference"\n')
    result = pytester.runpytest_subprocess("--kvbench-expectations", str(bad))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvbench-expectations*field 'check' must be a non-empty string*"])


# ------------------------------------------------------------------ a missing prerequisite is a skip
@pytest.mark.parametrize("kind", ["hf", "hf-cb"])
def test_an_engine_with_no_length_limit_skips_the_over_long_check_saying_why(kind):
    """hf and hf-cb declare no_length_limit, so check 8's over-long prompt skips (not xfail, not fail); the
    declaration is true: each runs a prompt past the model's positions without refusing it."""
    from _pytest.outcomes import Skipped

    from kvbench.conformance.prove import model_vocab
    from kvbench.engines.base import GenRequest, Knobs
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from kvbench.models.builtin import builtin_checkpoint
    from suites.conformance.test_bad_input import test_over_long_prompt_is_refused_and_others_are_served as check

    model_dir = str(builtin_checkpoint("tiny"))
    engine = make_adapter(parse_engine_spec(kind), model_dir)
    try:
        with pytest.raises(Skipped, match=f"{kind} has no per-request length limit to enforce: .*no"):
            check(engine=engine, model_dir=model_dir, requests_greedy=[], truth=None, truth_engine=None,
                  near_ties=[], tolerance=1e-3)
        _, max_len = model_vocab(model_dir)
        knobs = Knobs() if kind == "hf" else Knobs(block_size=16, num_gpu_blocks=128)
        [out] = engine.generate([GenRequest("too-long", [5] * (max_len + 10), 2)], knobs).outputs
        assert (out.finish_reason, len(out.token_ids)) == ("length", 2), "it refused: remove no_length_limit"
    finally:
        engine.close()


def test_an_engine_with_a_length_limit_is_held_to_it():
    """The skip is not a blanket: an engine that declares no missing limit and runs the over-long prompt fails."""
    from types import SimpleNamespace

    from kvbench.core.requests import GenOutput, GenResult
    from suites.conformance.test_bad_input import test_over_long_prompt_is_refused_and_others_are_served as check

    class Accepts:
        name, kind, no_length_limit = "accepts-everything", "fake", None

        def pool_knobs(self, budget, block_size=None):
            from kvbench.core.kv_budget import pool_knobs

            return pool_knobs(budget, block_size=block_size)

        def generate(self, requests, knobs):
            return GenResult([GenOutput(r.request_id, [1], "length") for r in requests])

    from kvbench.models.builtin import builtin_checkpoint

    with pytest.raises(pytest.fail.Exception, match="the bad request was not refused"):
        check(engine=Accepts(), model_dir=str(builtin_checkpoint("tiny")), requests_greedy=[], truth=GenResult([]),
              truth_engine=SimpleNamespace(top2_margins=None, logit_gap=None), near_ties=[], tolerance=1e-3)


def test_a_variant_is_named_by_its_exact_id():
    """A parametrized check's id has brackets; named exactly it matches (fnmatch alone would read a class)."""
    e = Expectation("vllm", "invalid_configuration_names_the_field[num_gpu_blocks--1]", "r", "p", match="x")
    assert e.matches_check("invalid_configuration_names_the_field[num_gpu_blocks--1]")
    assert not e.matches_check("invalid_configuration_names_the_field[block_size-3]")
