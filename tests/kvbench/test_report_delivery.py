"""Issue 34 point 5, what made a storm report of the reference server and vLLM unpublishable, each rule shown
holding and shown failing where its mechanism is taken away:

* bursty delivery is detected (:mod:`kvbench.core.delivery`) and the gap figures of a bursty engine are marked
  "not comparable", never ranked nor crowned on (first screen, scoreboard, headline, side-by-side ratios);
* missing data never reads as zero ("not exposed", never "0 swaps" or "no fallback" beside counters that
  counted some);
* timelines of polled samples break at polling gaps rather than drawing straight lines across them;
* a benchmark session stops the servers of the engines no later test needs (:mod:`kvbench.bench.server_release`).
"""

from __future__ import annotations

import re

import pytest

from kvbench.bench import repeats
from kvbench.bench.results import Results, validate
from kvbench.bench.server_release import Planned, ServerRelease, engines_needed, function_of
from kvbench.core import delivery
from kvbench.core.trace import RequestTrace, Trace
from kvbench.report import charts as rc
from kvbench.report import figures, first_screen, scoreboard, side_by_side
from kvbench.report.render import render_report

CHUNKED = "chunked_prefill_stalls"  # its declared score: the p99 inter-token gap in mode "chunked"


def _streams(per_chunk: int, streams: int = 4, tokens: int = 24, step: float = 0.01) -> list[list[float]]:
    """Token arrival times of ``streams`` streams, ``per_chunk`` tokens at each arrival."""
    return [[round(s * 0.003 + step * (i // per_chunk), 6) for i in range(tokens)] for s in range(streams)]


def _result(res: Results, scenario: str, engine: str, tbt: list[float], *, mode: str | None = None,
            per_chunk: float | None = None, extra: dict | None = None) -> dict:
    reps = [{"tbt_p99": t, "tbt_p50": t / 4, "output_throughput": 100.0, "ttft_p99": 0.2, "preemptions": 3.0,
             **(extra or {})} for t in tbt]
    medians, spreads = repeats.aggregate(reps)
    entry = res.add_scenario_result(scenario, engine, medians, mode=mode, repeats=reps, spread=spreads,
                                    clock={"clock": "wall", "interleaved": []})
    if per_chunk is not None:
        entry["delivery"] = delivery.describe(_streams(int(per_chunk)))
    return entry


def _chunked(vllm_chunk: float | None) -> Results:
    """The chunked-prefill scenario on two servers: vLLM's p99 gap looks 3x better than the reference's."""
    res = Results()
    for mode in ("chunked", "unchunked"):
        _result(res, CHUNKED, "server:preset=reference", [0.030, 0.030, 0.030], mode=mode, per_chunk=1)
        _result(res, CHUNKED, "server:preset=vllm", [0.010, 0.010, 0.010], mode=mode, per_chunk=vllm_chunk)
    return res


# --------------------------------------------------------------------------------------------
# the measure


def test_tokens_per_chunk_tells_one_token_per_write_from_bursts():
    one = delivery.describe(_streams(1))
    assert one is not None and one["tokens_per_chunk"] == 1.0 and not one["bursty"]
    bursts = delivery.describe(_streams(4))
    assert bursts is not None and bursts["tokens_per_chunk"] == 4.0 and bursts["bursty"]
    assert "bursts" in bursts["why"] and "4.0 tokens per chunk" in bursts["why"]
    # the threshold is the conformance side's: two per chunk is not yet bursty, above it is
    assert not delivery.describe(_streams(2))["bursty"]  # type: ignore[index]
    assert delivery.describe([]) is None


def test_victims_seen_reads_the_same_threshold():
    from kvbench.conformance import victims_seen

    assert victims_seen.MAX_TOKENS_PER_CHUNK is delivery.MAX_TOKENS_PER_CHUNK


def test_add_trace_records_how_tokens_were_delivered_and_validates():
    trace = Trace("server:preset=vllm", "preemption_storm")
    for i, times in enumerate(_streams(6)):
        trace.requests[f"r{i}"] = RequestTrace(f"r{i}", 0.0, 10, 24, token_times=times, finished=times[-1],
                                               finish_reason="length")
    res = Results()
    entry = res.add_trace(trace)
    assert entry["delivery"]["bursty"] and entry["delivery"]["tokens_per_chunk"] == 6.0
    validate(Results.from_dict(res.to_dict()).to_dict())


def test_an_in_process_engine_is_never_bursty():
    """The reference engine run in process records one token per request per step: 1 per chunk."""
    from kvbench.bench import scenarios as sc
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from kvbench.models.builtin import builtin_checkpoint

    path = str(builtin_checkpoint("tiny"))
    adapter = make_adapter(parse_engine_spec("reference"), path)
    try:
        job = sc.PREEMPTION_STORM.plan("quick", sc.Model.from_dir(path, "tiny"))[0]
        from kvbench.core.trace import TraceRecorder

        recorder = TraceRecorder("reference", "preemption_storm")
        adapter.serve(job.workload, recorder, job.knobs)
        how = delivery.of_traces([recorder.trace])
    finally:
        adapter.close()
    assert how is not None and how["tokens_per_chunk"] == 1.0 and not how["bursty"]


# --------------------------------------------------------------------------------------------
# the report


def test_a_gap_score_is_not_ranked_where_an_engine_delivered_in_bursts():
    row = next(v for v in first_screen.verdicts(_chunked(4)) if v["scenario"] == CHUNKED)
    assert row["status"] == first_screen.NOT_RANKED and not row["crowned"] and not row["winner"]
    assert "not comparable: tokens delivered in bursts (4.0 per chunk)" in row["margin"]
    assert "server:preset=vllm" in row["margin"]
    # the same figures without bursts crown vLLM: the rule fires on the delivery, not on the values
    row = next(v for v in first_screen.verdicts(_chunked(1)) if v["scenario"] == CHUNKED)
    assert row["crowned"] and row["winner"] == "server:preset=vllm"
    # a file from before delivery was recorded: unknown, so ranked as before
    row = next(v for v in first_screen.verdicts(_chunked(None)) if v["scenario"] == CHUNKED)
    assert row["crowned"]


def test_the_scoreboard_and_the_headline_never_crown_on_a_bursty_gap():
    row = next(r for r in scoreboard.scoreboard(_chunked(4), None) if r["scenario"] == CHUNKED)
    assert not row["leader"] and row["note"].startswith("not ranked: server:preset=vllm: not comparable")
    assert next(r for r in scoreboard.scoreboard(_chunked(1), None) if r["scenario"] == CHUNKED)["leader"]
    card = next(c for c in scoreboard.headlines(_chunked(4), None) if c["scenario"] == CHUNKED)
    assert card["value"] == "not compared" and "bursts" in card["caption"]
    assert next(c for c in scoreboard.headlines(_chunked(1), None) if c["scenario"] == CHUNKED)["value"] != \
        "not compared"


def test_side_by_side_gives_no_gap_ratio_with_a_bursty_engine_and_keeps_the_others():
    (table,) = side_by_side.tables(_chunked(4))
    rows = {r["label"]: r["ratios"][0] for r in table["groups"][0]["rows"]}
    assert rows["p99 TBT"]["text"] == "not compared" and "bursts" in rows["p99 TBT"]["tip"]
    assert not rows["p99 TBT"]["counts"]
    assert rows["output tok/s"]["text"] != "not compared"  # throughput is not a gap figure
    (table,) = side_by_side.tables(_chunked(1))
    assert {r["label"]: r["ratios"][0] for r in table["groups"][0]["rows"]}["p99 TBT"]["counts"]


def test_gap_values_are_marked_wherever_the_page_shows_them():
    res = _chunked(4)
    vllm = next(r for r in res.scenario(CHUNKED)["results"] if r["engine"] == "server:preset=vllm")
    assert figures.fmt_value("tbt_p99", vllm) == "10 ms, not comparable: tokens delivered in bursts (4.0 per chunk)"
    assert figures.fmt_value("output_throughput", vllm) == figures.fmt_value("output_throughput", {
        "metrics": vllm["metrics"]})  # only gap figures are marked
    html = render_report(Results.from_dict(res.to_dict()))
    assert "not comparable: tokens delivered in bursts (4.0 per chunk)" in html
    assert "not comparable" not in render_report(_chunked(1)).split("<body", 1)[1].replace(
        "not comparable with the other clock", "")


def test_an_engine_bursty_in_one_scenario_has_its_gaps_marked_in_every_scenario():
    """A burst is the server's writer: vLLM's 1.2 per chunk on a light storm does not make its gaps there
    comparable when it wrote in bursts of 8 in another scenario of the same run."""
    res = Results()
    _result(res, "preemption_storm", "server:preset=reference", [0.02] * 3, per_chunk=1)
    light = _result(res, "preemption_storm", "server:preset=vllm", [0.01] * 3, per_chunk=1)
    light["delivery"]["tokens_per_chunk"] = 1.2
    _result(res, "flash_crowd", "server:preset=vllm", [0.01] * 3, per_chunk=8)
    delivery.annotate(res.data)
    assert delivery.not_comparable("tbt_p99", light) == (
        "not comparable: tokens delivered in bursts (1.2 per chunk here, 8.0 in flash crowd)")
    assert figures.compare("tbt_p99", light, res.result("preemption_storm", "server:preset=reference")).not_comparable


# --------------------------------------------------------------------------------------------
# missing data never reads as zero


def test_a_count_an_engine_does_not_expose_is_never_none_or_zero_on_the_page():
    res = Results()
    _result(res, "evening_surge", "server:preset=reference", [0.02] * 3, extra={"ttft_p99_wave": 0.5})
    _result(res, "evening_surge", "server:preset=llamacpp", [0.02] * 3,
            extra={"ttft_p99_wave": 1.5, "preemptions": None})
    costs = {c["engine"]: c["text"] for c in scoreboard.preemption_costs(res)}
    assert costs["server:preset=llamacpp"] == "preemptions not exposed"  # was "never preempted (or ...)"
    row = next(v for v in first_screen.verdicts(res) if v["scenario"] == "evening_surge")
    assert "preemptions 3 vs not exposed" in row["cost"]  # was left out: a price read as nothing paid


def test_swap_exhaustion_headline_reads_the_counters_when_the_records_saw_no_fallback():
    """Over HTTP no request records its preemptions: the headline said "no fallback, 0 swaps" beside counters of
    19 swaps and 4 fallbacks."""
    from kvbench.bench import scenarios as sc

    def recorded(**small) -> dict:
        return {"name": "swap_space_exhaustion", "results": [
            {"engine": "server:preset=reference", "mode": "exhausted_swap_space", "metrics": small}]}

    h = sc.SCENARIOS["swap_space_exhaustion"].headline(recorded(
        first_fallback_s=None, swaps_before_first_fallback=None, swap_fallbacks=4.0, swap_outs=19.0), None)
    assert h.value == "4 fallbacks" and "19 swaps out" in h.detail and "no fallback" not in h.value
    h = sc.SCENARIOS["swap_space_exhaustion"].headline(recorded(
        first_fallback_s=None, swaps_before_first_fallback=None, swap_fallbacks=None, swap_outs=None), None)
    assert h.value is None and "not exposed" in h.caption and "0 swaps" not in h.detail
    # the counter at zero while the records are unknown: no fallback, the swaps from the counter
    h = sc.SCENARIOS["swap_space_exhaustion"].headline(recorded(
        first_fallback_s=None, swaps_before_first_fallback=None, swap_fallbacks=0.0, swap_outs=19.0), None)
    assert h.value == "no fallback" and h.detail == "19 swaps out"
    # an engine whose records saw every swap and no fallback, with its counter at zero: "no fallback" stands
    h = sc.SCENARIOS["swap_space_exhaustion"].headline(recorded(
        first_fallback_s=None, swaps_before_first_fallback=12.0, swap_fallbacks=0.0, swap_outs=12.0), None)
    assert h.value == "no fallback" and h.detail == "12 swaps"


def test_first_fallback_and_class_preemptions_are_unknown_when_records_miss_counted_preemptions():
    from kvbench.bench.scenarios.mechanisms import class_figures
    from kvbench.bench.scenarios.storms import first_fallback

    trace = Trace("server:preset=reference", "x", counters={"preemptions_swap": 19, "preemptions_recompute": 4})
    trace.requests["a"] = RequestTrace("a", 0.0, 10, 4, token_times=[0.1, 0.2, 0.3, 0.4], finished=0.4,
                                       finish_reason="length")
    assert first_fallback(trace) == {"first_fallback_s": None, "swaps_before_first_fallback": None,
                                     "cpu_kv_usage_at_first_fallback": None}
    assert class_figures(trace)["preemptions_high"] is None
    trace.counters = type(trace.counters).from_dict({"preemptions_swap": 0, "preemptions_recompute": 0})
    assert class_figures(trace)["preemptions_high"] == 0.0  # records complete: a zero is a zero


def test_the_pool_table_has_no_row_for_an_engine_that_does_not_expose_preemptions():
    from kvbench.report.advice import pool_row

    sc_ = {"name": "evening_surge", "parameters": {"num_gpu_blocks": 64, "block_size": 16}}
    assert pool_row(sc_, {"metrics": {"preemptions": None, "requests": 10.0}}, "#", None) is None
    assert pool_row(sc_, {"metrics": {"preemptions": 0.0, "requests": 10.0}}, "#", None) is not None


# --------------------------------------------------------------------------------------------
# timelines break at polling gaps


def test_a_polling_gap_breaks_the_line():
    xs = [0.0, 0.1, 0.2, 0.3, 2.5, 2.6, 2.7]  # 10 Hz, then 2.2 s without a sample
    gaps, limit = rc.polling_gaps(xs)
    assert gaps == [(0.3, 2.5)] and limit == pytest.approx(0.5)
    bx, by, n = rc.break_at_gaps(xs, [1, 2, 3, 4, 9, 9, 9])
    assert n == 1 and by.count(None) == 1
    drawn = str(rc.render(rc.Chart("t", "s", "q", lines=[rc.Line("a", bx, by)])))
    assert drawn.count("<polyline") == 2  # two segments, nothing across the gap
    whole = str(rc.render(rc.Chart("t", "s", "q", lines=[rc.Line("a", xs, [1, 2, 3, 4, 9, 9, 9])])))
    assert whole.count("<polyline") == 1  # the old drawing: one straight line across 2.2 s
    # jitter of two or three intervals is no gap
    assert rc.polling_gaps([0.0, 0.1, 0.2, 0.45, 0.55, 0.65])[0] == []
    assert rc.gap_note(1).startswith("the line breaks at 1 polling gap ")


def test_a_server_timeline_on_the_page_breaks_and_says_so():
    res = Results()
    t = [0.1 * i for i in range(10)] + [3.0 + 0.1 * i for i in range(10)]
    series = {"t": t, "kv_usage": [0.5] * 20, "num_waiting": [1] * 20, "server_t": t, "server_running": [2] * 20}
    res.add_scenario_result("preemption_storm", "server:preset=reference", {"output_throughput": 1.0},
                            series=series, clock={"clock": "wall"})
    html = render_report(res)
    assert "the line breaks at 1 polling gap" in html
    series.update(t=[0.1 * i for i in range(20)], server_t=[0.1 * i for i in range(20)])
    res.add_scenario_result("preemption_storm", "server:preset=reference", {"output_throughput": 1.0},
                            series=series, clock={"clock": "wall"})
    assert "polling gap" not in render_report(res)


# --------------------------------------------------------------------------------------------
# a benchmark session stops what no later test needs


class FakeServer:
    def __init__(self):
        self.up = True
        self.stops = 0

    def running_servers(self) -> list:
        return ["server"] if self.up else []

    def stop_server(self) -> None:
        self.up, self.stops = False, self.stops + 1


def _plan(names: list[str]) -> list[tuple[str, Planned]]:
    return [(n, Planned(function_of(n), re.search(r"\[(.*)\]", n).group(1) if "[" in n else None)) for n in names]


ORDER = [f"s.py::test_{f}[{e}]" for e in ("ref", "vllm") for f in ("surge", "storm")]  # pytest's order


def test_engines_needed_follows_unserved_scenarios():
    later = [p for _, p in _plan(ORDER)]
    assert engines_needed(later, set()) == {"ref", "vllm"}
    assert engines_needed(later, {"s.py::test_surge", "s.py::test_storm"}) == set()
    # the storm yet to be served, by vLLM's own test (the reference engine's was skipped): vLLM only
    assert engines_needed(later[2:], {"s.py::test_surge"}) == {"vllm"}
    assert engines_needed(later[1:], {"s.py::test_surge"}) == {"ref", "vllm"}


def test_servers_stop_after_the_last_test_that_serves_on_them():
    """Every scenario is served in the first engine's tests (on both engines): once the last is served, both
    engines' servers go, long before the second engine's tests, which only record."""
    release = ServerRelease(_plan(ORDER))
    adapters = {"ref": FakeServer(), "vllm": FakeServer()}
    release.mark_served(ORDER[0])
    assert release.after(ORDER[0], adapters) == [] and adapters["vllm"].up  # the storm still needs both
    release.mark_served(ORDER[1])
    assert sorted(release.after(ORDER[1], adapters)) == ["ref", "vllm"]
    assert not adapters["ref"].up and not adapters["vllm"].up
    assert release.after(ORDER[2], adapters) == []  # nothing left up: nothing stopped twice
    assert adapters["ref"].stops == adapters["vllm"].stops == 1


def test_a_skipped_first_test_leaves_its_scenario_to_the_next_engine():
    """The reference engine skips the storm (a capability): vLLM's own test serves it later, so vLLM's servers
    stay up until then, while the reference's, needed by no later test, go at once."""
    release = ServerRelease(_plan(ORDER))
    adapters = {"ref": FakeServer(), "vllm": FakeServer()}
    release.mark_served(ORDER[0])
    assert release.after(ORDER[1], adapters) == ["ref"] and adapters["vllm"].up
    assert release.after(ORDER[2], adapters) == []  # vLLM's surge test only records; its storm test is next
    release.mark_served(ORDER[3])
    assert release.after(ORDER[3], adapters) == ["vllm"]



def test_the_benchmark_scheduler_stops_an_engines_servers_once_no_later_test_needs_them(monkeypatch):
    """The session's own scheduler (suites/benchmarks/conftest.py), two engines, two scenarios, pytest's order
    (every test of the first engine, then the second's): the first engine's tests serve both scenarios on both
    engines; after the last of them both engines' servers are stopped, and the second engine's tests, which only
    record, start none."""
    from types import SimpleNamespace

    import suites.benchmarks.conftest as bench
    from kvbench.engines.registry import parse_engine_spec
    from tests.kvbench.test_gate_interleave import MODEL, FakeAdapter, TwoJobs, _Item

    class ServerLike(FakeAdapter):
        up = False

        def serve(self, workload, recorder, knobs=None, step_seconds=None) -> None:
            self.up = True  # a run starts (or reuses) a server
            super().serve(workload, recorder, step_seconds=step_seconds)

        def running_servers(self) -> list:
            return ["server"] if self.up else []

        def stop_server(self) -> None:
            self.log.append(f"stop {self.name}")
            self.up = False

    log: list[str] = []
    monkeypatch.setattr(bench, "make_adapter", lambda spec, path: ServerLike(spec.name, log))
    specs = [parse_engine_spec("reference"), parse_engine_spec("reference:preemption_mode=swap")]
    scheduler = bench.StormScheduler(SimpleNamespace(engine_specs=specs, scale="quick", repeats=1, liveness=None),
                                     MODEL)
    session = SimpleNamespace(items=[])
    session.items = [_Item(s, session, name) for s in specs for name in ("test_surge", "test_storm")]
    for item in session.items:
        item.config = SimpleNamespace()  # not an xdist worker
    stops = []
    for item in session.items:
        spec = item.callspec.params["engine_spec"]
        scheduler.outcome(item, spec, TwoJobs(), lambda total, desc: _nullcontext())
        stops.append(scheduler.release_after(item, ran=True))
    assert stops[0] == []  # the storm, still to be served on both engines, needs them
    assert sorted(stops[1]) == [s.name for s in specs]  # both served: every server goes
    assert stops[2:] == [[], []]  # the second engine's tests only record: nothing started, nothing to stop
    assert not any(a.up for a in scheduler._adapters.values())
    assert [line for line in log if line.startswith("stop")] == [f"stop {s.name}" for s in specs]


def _nullcontext():
    import contextlib

    return contextlib.nullcontext(None)


def test_tables_mark_gap_cells_compactly_and_say_why_beneath():
    """A table cell carries a footnote mark (the summary table fits at 1400 px), the note under the table the
    reason."""
    from kvbench.report.render import summary_table

    table = summary_table(_chunked(4))
    col = table["columns"].index("p99 TBT")
    cells = [r["cells"][col] for r in table["rows"] if r["engine"] == "server:preset=vllm"]
    assert cells and all(c == "10 ms †" for c in cells)
    assert table["bursts"].startswith("† not comparable: gaps between tokens of server:preset=vllm, tokens "
                                      "delivered in bursts (4.0 per chunk)")
    plain = summary_table(_chunked(1))
    assert not plain["bursts"] and "†" not in str(plain["rows"])


def test_admission_control_earns_no_setting_on_a_bursty_servers_gaps():
    """Its goal includes a lower p99 TBT: met on the figures, but the gaps are a bursty server's writer."""
    from kvbench.bench.scenarios import policies
    from kvbench.report.advice import goal_met_beyond_noise

    met = policies.GoalCheck(fewer_preemptions=10.0, lower_tbt=10.0, throughput_kept=1.0)
    static = {"engine": "e", "metrics": {"tbt_p99": 0.1, "output_throughput": 100.0}}
    gated = {"engine": "e", "metrics": {"tbt_p99": 0.01, "output_throughput": 100.0}}
    assert goal_met_beyond_noise(met, gated, static)
    bursty = {**gated, "delivery": delivery.describe(_streams(4))}
    assert not goal_met_beyond_noise(met, bursty, static)
