"""The head-to-head scenario (kvbench.bench.scenarios.closed_loop) on in-process engines: it records each
concurrency with its rounds, its output-token-count claim fails on an engine that returns one token fewer, and
its cross-check of greedy outputs reports a divergence on an engine that changes one token.

Tiny model, a few requests: what is checked is what was recorded and claimed, never a time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbench.bench import scenarios as sc
from kvbench.bench.interleaved_rounds import Setup
from kvbench.bench.results import Results
from kvbench.bench.scenarios.closed_loop import (
    COUNTS_CLAIM,
    HeadToHead,
    agreement_decision,
    cross_check,
    mode_of,
    run_head_to_head,
)
from kvbench.conformance.faults import FaultyReferenceAdapter
from kvbench.core.trace import RequestTrace, Trace
from kvbench.engines.inprocess.reference import DEFAULT_KNOBS, ReferenceAdapter

#: 16-token prompts and 40 output tokens: the 48th position of a sequence is its 32nd output token, where
#: the miscomputes_one_position fault changes one token
SMALL = Setup(concurrency=(2, 4), rounds=2, requests=4, prompt=16, output=40, max_num_seqs=4, cool_down=0.0)


class Small(HeadToHead):
    sizes = {"quick": SMALL, "full": SMALL}  # noqa: RUF012


class OneTokenShort(ReferenceAdapter):
    """The reference engine giving every request one output token fewer than it asked for."""

    def build_engine(self, knobs=DEFAULT_KNOBS):
        engine = super().build_engine(knobs)
        FaultyReferenceAdapter._wrap_intake(
            engine, lambda prompt, params: (prompt, replace(params, max_tokens=params.max_tokens - 1)))
        return engine


@pytest.fixture(scope="module")
def model(tiny_ckpt: str) -> sc.Model:
    return sc.Model.from_dir(tiny_ckpt, "tiny")


def _run(model: sc.Model, *adapters) -> dict:
    try:
        return run_head_to_head({a.name: a for a in adapters}, model, "quick", cool_down=0.0, scenario=Small())
    finally:
        for a in adapters:
            a.close()


def test_runs_every_engine_and_records_each_concurrency_with_its_rounds(model):
    ref = ReferenceAdapter(model.path, {}, name="reference")
    bf16 = ReferenceAdapter(model.path, {"dtype": "bfloat16"}, name="reference:dtype=bfloat16")
    outcomes = _run(model, ref, bf16)
    results = Results()
    for name, outcome in outcomes.items():
        assert not isinstance(outcome, Exception), outcome
        assert outcome.claims[COUNTS_CLAIM] is True and not outcome.failures(), outcome.explain()
        assert len(outcome.repeats) == SMALL.rounds and outcome.interleaved == ("reference", "reference:dtype=bfloat16")
        sc.record(outcome, results, name)
    recorded = results.scenario("head_to_head")
    rows = {(r["engine"], r["mode"]): r for r in recorded["results"]}
    assert set(rows) == {(e, mode_of(c)) for e in outcomes for c in SMALL.concurrency}
    for (engine, _), r in rows.items():
        assert len(r["repeats"]) == SMALL.rounds and r["metrics"]["output_throughput"] > 0
        assert r["metrics"]["requests_finished"] == SMALL.requests and r["metrics"]["ttft_p99"] is not None
        # the ratio to the first engine, taken within each round, on the others only
        assert (r["repeats"][0].get("ratio_output_throughput") is not None) == (engine != "reference")
    # two dtypes: nothing to compare outputs with
    assert recorded["parameters"]["cross_check"] == []
    assert recorded["parameters"]["knobs_by_engine"]["reference"]["knobs"]["enable_prefix_caching"] is False
    tables = Small().tables(recorded)
    by_title = {t["title"]: t for t in tables}
    for c in SMALL.concurrency:
        table = by_title[f"Head-to-head at {mode_of(c)}"]
        assert [row[0] for row in table["rows"]] == ["reference", "reference:dtype=bfloat16"]
        assert "[" in table["rows"][0][1] and table["rows"][0][4] == "1 (base)" and table["rows"][1][4].endswith("x]")


def test_the_count_claim_fails_on_an_engine_that_returns_one_token_fewer(model):
    outcomes = _run(model, ReferenceAdapter(model.path, {}, name="reference"),
                    OneTokenShort(model.path, {}, name="one-short"))
    good, short = outcomes["reference"], outcomes["one-short"]
    assert good.claims[COUNTS_CLAIM] is True
    assert short.claims[COUNTS_CLAIM] is False
    why = short.explain()
    assert "one-short" in why and f"got {SMALL.output - 1} of {SMALL.output}" in why, why


def test_the_cross_check_reports_a_divergence_on_an_engine_that_changes_one_token(model):
    faulty = FaultyReferenceAdapter(model.path, {"fault": "miscomputes_one_position"}, name="miscomputes")
    outcomes = _run(model, ReferenceAdapter(model.path, {}, name="reference"), faulty)
    results = Results()
    for name, outcome in outcomes.items():
        sc.record(outcome, results, name)
    (check,) = results.scenario("head_to_head")["parameters"]["cross_check"]
    compared = SMALL.requests * len(SMALL.concurrency)
    # position 48 of a 16-token prompt's sequence: output token 31 (0-based)
    assert check["engines"] == ["reference", "miscomputes"] and check["compared"] == compared
    assert check["identical"] == 0 and check["first_divergence"] == 48 - SMALL.prompt - 1, check
    assert check["words"] == f"0 of {compared} identical, first divergence at token 31"
    # every request diverged on a float32 pair: wholesale, so the later engine's claim fails
    claim = "greedy outputs agree with reference's (at least half identical in float32)"
    assert outcomes["miscomputes"].claims[claim] is False
    assert outcomes["miscomputes"].claims[COUNTS_CLAIM] is True  # the counts were right: only the tokens moved
    table = {t["title"]: t for t in HeadToHead().tables(results.scenario("head_to_head"))}
    assert table["Greedy outputs cross-checked"]["rows"] == [["miscomputes vs reference", "float32", check["words"]]]


def _trace(engine: str, outputs: dict[str, list[int]]) -> Trace:
    trace = Trace(engine=engine, scenario="head_to_head")
    for rid, ids in outputs.items():
        trace.requests[rid] = RequestTrace(rid, 0.0, 4, len(ids), output_token_ids=ids)
    return trace


def test_divergences_are_findings_and_fail_only_wholesale_in_float32():
    base = _trace("a", {"r1": [1, 2, 3], "r2": [4, 5, 6], "r3": [7, 8, 9]})
    one_off = _trace("b", {"r1": [1, 2, 3], "r2": [4, 9, 6], "r3": [7, 8, 9]})
    all_off = _trace("c", {"r1": [2, 2, 3], "r2": [5, 5, 6], "r3": [7, 8, 1]})
    checks = cross_check({"a": [base], "b": [one_off], "c": [all_off], "d": [all_off]},
                         {"a": "float32", "b": "float32", "c": "float32", "d": "bfloat16"})
    words = {(x.a, x.b): x.words for x in checks}
    # d is alone in its dtype: compared with no one
    assert words == {("a", "b"): "2 of 3 identical, first divergence at token 1",
                     ("a", "c"): "0 of 3 identical, first divergence at token 0"}
    assert [agreement_decision(x).held for x in checks] == [True, False]
    bf16 = cross_check({"a": [base], "c": [all_off]}, {"a": "bfloat16", "c": "bfloat16"})
    assert agreement_decision(bf16[0]).held is True  # lower precision: a finding, not a failure
    # an engine whose driver keeps no token ids: nothing compared, so undecided (never "agreed")
    blind = _trace("e", {"r1": [1, 2, 3]})
    blind.requests["r1"].output_token_ids = None
    (unseen,) = cross_check({"a": [base], "e": [blind]}, {"a": "float32", "e": None})
    assert unseen.compared == 0 and agreement_decision(unseen).held is None


def test_the_command_shares_the_checks_and_fails_on_a_wholesale_divergence():
    """``kvbench head-to-head`` serves through the same rounds and checks: the changed token is reported, and
    a float32 engine that agrees on no request makes the command exit 1, naming it."""
    import io

    from kvbench.cli import main

    out = io.StringIO()
    code = main(["head-to-head", "--engine", "reference", "--engine",
                 "bad=kvbench.conformance.faults:FaultyReferenceAdapter:fault=miscomputes_one_position",
                 "--model", "tiny", "--concurrency", "2", "--rounds", "1", "--requests", "2", "--prompt", "16",
                 "--output", "40", "--cool-down", "0"], out=out)
    text = out.getvalue()
    assert code == 1, text
    assert "bad vs reference (float32): 0 of 2 identical, first divergence at token 31" in text
    assert "FAILED: bad at tiny, c=2: greedy outputs against reference's: 0 of 2 identical" in text


def test_a_count_read_from_text_chunks_is_not_exposed_and_a_count_of_returned_ids_is_held():
    """A server that returns no token ids (transformers serve) has its tokens counted from its stream's text chunks,
    where a token with empty text (EOS, with ignore_eos) arrives in no chunk: a short count there is not exposed;
    the same short count of ids the server returned fails."""
    from kvbench.bench.scenarios.closed_loop import token_counts

    returned = _trace("ids", {"r1": [5, 6, 7], "r2": [5, 6]})
    for r in returned.requests.values():
        r.max_tokens = 3
    assert token_counts([returned]).held is False
    chunks = _trace("text", {"r1": [5, 6, 7], "r2": [5, 6]})
    for r in chunks.requests.values():
        r.max_tokens = 3
        r.token_times = [0.1] * len(r.output_token_ids)
        r.output_token_ids = None
    decision = token_counts([chunks])
    assert decision.held is None and "text chunks" in decision.why and "r2 got 2 of 3" in decision.why
    chunks.requests["r2"].token_times.append(0.2)
    assert token_counts([chunks]).held is True
