"""What kvbench's own /metrics sampler costs an engine's streams (kvbench.bench.sampler_cost), and where the report
shows it.

What each test would catch: a split of gaps into "across a scrape" and "clear" that is off at an edge (a gap that
only touches a scrape, a zero gap inside one); a cost that a stalling sampler does not show, or that a harmless
one shows because long gaps meet scrapes more often (length bias); missing data read as a cost of zero; a scrape's
times on another clock than the tokens'; a report that does not say it beside the p99 gap.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbench.bench import sampler_cost
from kvbench.bench.results import Results
from kvbench.core.requests import WorkloadRequest
from kvbench.core.trace import StepRecord, Trace, TraceRecorder
from kvbench.engines.http.openai import OpenAIAdapter
from kvbench.launch.process import ServerProcess, free_port
from kvbench.models.builtin import builtin_checkpoint
from kvbench.report.render import render_report


def _trace(streams: dict[str, list[float]], scrapes: list[tuple[float, float]] | None) -> Trace:
    rec = TraceRecorder("e", "s")
    for rid, times in streams.items():
        rec.arrived(rid, 0.0, 1, len(times))
        for t in times:
            rec.tokens(rid, t)
        rec.finished(rid, times[-1], "length")
    for a, b in scrapes or []:
        rec.scraped(a, b)
    trace = rec.finish()
    if scrapes == []:
        trace.scrapes = []
    return trace


# --------------------------------------------------------------------------------------------
# the split, exact on a hand-made trace


def test_the_split_is_exact_on_a_hand_made_trace():
    scrapes = [(0.12, 0.15), (0.32, 0.33)]
    trace = _trace({
        "a": [0.0, 0.1, 0.2, 0.35, 0.4],  # (0.1, 0.2) and (0.2, 0.35) across; (0, 0.1) and (0.35, 0.4) clear
        "b": [0.05, 0.05, 0.3],  # a zero gap outside any scrape: clear; (0.05, 0.3) across the first
        "c": [0.25, 0.32, 0.33],  # ends where a scrape begins: clear; (0.32, 0.33) is the second scrape: across
        "d": [0.15, 0.17],  # begins where a scrape ended: clear
        "e": [0.13, 0.13],  # a zero gap inside a scrape: across
    }, scrapes)
    m = sampler_cost.measure(trace)
    clear = [0.1, 0.05, 0.0, 0.07, 0.02]
    across = [0.1, 0.15, 0.25, 0.01, 0.0]
    assert m["status"] == sampler_cost.MEASURED and m["scrapes"] == 2
    assert (m["gaps"], m["gaps_clear"], m["gaps_across_scrapes"]) == (10, 5, 5)
    assert m["tbt_p99_clear"] == pytest.approx(np.percentile(clear, 99))
    assert m["tbt_p50_clear"] == pytest.approx(0.05)
    assert m["tbt_p99"] == pytest.approx(np.percentile(clear + across, 99))
    assert m["tbt_p99_across_scrapes"] == pytest.approx(np.percentile(across, 99))
    # each gap across a scrape is charged what lies beyond the clear median (50 ms), at most its overlap:
    # a (0.1, 0.2) 30 ms, a (0.2, 0.35) 10 ms, b (0.05, 0.3) 30 ms, the short ones nothing
    assert m["stall_s"] == pytest.approx(0.07)
    # one control window fits between the scrapes, 30 ms midway (0.22, 0.25): a and b overlap it 30 ms each,
    # counted twice (two scrapes, one window); c's gap only begins at its end. Both also meet a scrape, so neither
    # side of the p99 comparison holds them: no gap lies across the control window alone, undecided
    assert m["control_stall_s"] == pytest.approx(0.12)
    assert m["gaps_across_control"] == 0 and m["tbt_p99_control_only"] is None
    assert m["tbt_p99_scrapes_only"] == pytest.approx(np.percentile([0.1, 0.01, 0.0], 99))
    assert m["moved"] is None and "undecided" in m["why"]
    assert m["stream_s"] == pytest.approx(sum(clear + across))
    assert m["stall_share"] == pytest.approx((0.07 - 0.12) / 0.75)


def test_meeting_and_overlap_agree_with_a_brute_force_count():
    rng = random.Random(3)
    spans = [(a, a + rng.uniform(0.001, 0.05)) for a in sorted(rng.uniform(0, 2) for _ in range(40))]
    windows = sampler_cost.Windows.union(spans)
    t0 = np.asarray([rng.uniform(0, 2) for _ in range(500)])
    t1 = t0 + np.asarray([rng.choice([0.0, rng.uniform(0, 0.2)]) for _ in range(500)])
    merged = list(zip(windows.starts, windows.ends, strict=True))
    pairs = list(zip(t0, t1, strict=True))
    meets = [any(max(a, s) < min(b, e) or (a == b and s < a < e) for s, e in merged) for a, b in pairs]
    overlap = [sum(max(0.0, min(b, e) - max(a, s)) for s, e in merged) for a, b in pairs]
    assert windows.meets(t0, t1).tolist() == meets
    assert windows.overlap(t0, t1) == pytest.approx(overlap, abs=1e-12)
    for (s, e), (s2, e2) in itertools.pairwise(merged):
        assert s < e < s2 < e2, "the union is sorted and disjoint"


def _stalled_streams(streams: int, until: float, spacing: float, scrapes: list[tuple[float, float]],
                     pauses: dict[str, list[tuple[float, float]]] | None = None) -> dict[str, list[float]]:
    """Token times of streams that emit every ``spacing`` s; a token due inside one of ``scrapes`` comes when it
    ends (the server's loop was held), and one due inside a stream's pause when the pause ends."""
    out = {}
    for i in range(streams):
        rid, t, times = f"r{i}", i * spacing / streams, []
        holds = sorted([*scrapes, *(pauses or {}).get(f"r{i}", [])])
        while t < until:
            t += spacing
            for a, b in holds:
                if a <= t < b:
                    t = b
            times.append(t)
        out[rid] = times
    return out


def _scrapes(until: float, every: float, lasting: float, first: float = 0.0555) -> list[tuple[float, float]]:
    return [(s, s + lasting) for s in np.arange(first, until, every)]


def test_scrapes_that_hold_the_streams_show_a_cost_and_move_the_p99():
    scrapes = _scrapes(3.0, 0.1, 0.015)
    m = sampler_cost.measure(_trace(_stalled_streams(8, 3.0, 0.01, scrapes), scrapes))
    assert m["moved"] is True
    assert m["tbt_p99_clear"] == pytest.approx(0.01, abs=1e-6)
    assert m["tbt_p99"] > 0.015 and m["tbt_p99_across_scrapes"] > 0.015
    assert m["tbt_p99_control_only"] == pytest.approx(0.01, abs=1e-6)
    # every scrape charged its streams more than the control window after it did
    assert m["pairs_scrape_longer"] == m["window_pairs"] >= 25 and m["sign_p"] < 1e-6
    # a token held by a 15 ms scrape waits 5-15 ms beyond its 10 ms (when it was due inside the scrape)
    held = 8 * len(scrapes) * 0.015
    assert 0.3 * held < m["stall_s"] - m["control_stall_s"] <= held
    assert m["stall_share"] > 0.05
    result = {"engine": "stub", "sampler_cost": m, "metrics": {"tbt_p99": m["tbt_p99"]}}
    assert sampler_cost.aside(result) == f"10 ms clear of /metrics scrapes; {len(scrapes)} scrapes"
    assert "moved this figure" in sampler_cost.note(result) and "stalled by them" in sampler_cost.note(result)
    assert sampler_cost.table_note([result]).startswith("moved by kvbench's own /metrics sampler for stub (p99 ")


def test_scrapes_that_hold_nothing_cost_nothing_although_long_gaps_meet_them_more_often():
    """Streams with 200 ms pauses (preempted) and 5 ms gaps otherwise: every pause meets scrapes and hardly any
    5 ms gap does, so the p99 over every gap is far above the p99 of the gaps clear of scrapes with no scrape
    holding anything. Comparing with the control windows between scrapes says so: not moved, no cost."""
    rng = random.Random(7)
    scrapes = _scrapes(8.0, 0.1, 0.015)
    pauses = {f"r{i}": [(s, s + 0.2) for s in sorted(rng.uniform(0, 7.5) for _ in range(20))] for i in range(8)}
    m = sampler_cost.measure(_trace(_stalled_streams(8, 8.0, 0.005, [], pauses), scrapes))
    assert m["tbt_p99"] > 10 * m["tbt_p99_clear"], "the length bias this test is about is there"
    assert m["moved"] is False and m["window_pairs"] > 50 and m["sign_p"] > 0.05
    assert abs(m["stall_share"]) < 0.01, m
    result = {"engine": "stub", "sampler_cost": m, "metrics": {}}
    assert sampler_cost.note(result) == "" and sampler_cost.table_note([result]) == ""


def test_a_few_long_gaps_across_a_few_scrapes_leave_it_undecided():
    """Five scrapes, each met by one long gap: p99s over a handful of gaps, and five pairs of windows, which a
    sign test cannot tell from chance (1/32 > MOVED_P): undecided, not "moved"."""
    scrapes = [(0.1 + 0.1 * k, 0.115 + 0.1 * k) for k in range(5)]
    streams = {f"r{i}": [0.0005 * i + 0.005 * j for j in range(120)] for i in range(4)}
    streams["long"] = [0.0, 0.09, *[0.13 + 0.1 * k for k in range(5)]]
    m = sampler_cost.measure(_trace(streams, scrapes))
    assert m["window_pairs"] <= 5 and m["moved"] is None and "undecided" in m["why"]
    assert sampler_cost.note({"sampler_cost": m}) == ""


def test_missing_data_is_not_measured_never_a_zero_cost():
    streams = {"a": [0.0, 0.1, 0.2]}
    assert sampler_cost.measure(_trace(streams, None))["status"] == sampler_cost.NO_SAMPLER
    sampled = _trace(streams, None)
    sampled.steps.append(StepRecord(t=0.1, duration=0.1, num_running=1, num_waiting=0, sampled=True))
    m = sampler_cost.measure(sampled)
    assert m["status"] == sampler_cost.NOT_MEASURED and "scrapes' times" in m["why"] and "stall_share" not in m
    no_gap = sampler_cost.measure(_trace({"a": [0.1]}, [(0.0, 0.2)]))
    assert no_gap["status"] == sampler_cost.NOT_MEASURED and "no inter-token gap" in no_gap["why"]
    assert sampler_cost.aside({"engine": "old", "metrics": {}}) == "sampler cost not measured"
    assert sampler_cost.aside({"sampler_cost": sampler_cost.measure(_trace(streams, None))}) == "no sampler"
    none_made = sampler_cost.measure(_trace(streams, []))
    assert none_made["status"] == sampler_cost.MEASURED and none_made["scrapes"] == 0
    assert none_made["stall_s"] == 0 and none_made["moved"] is False


def test_repeats_take_medians_and_a_repeat_without_data_makes_the_result_not_measured():
    scrapes = _scrapes(3.0, 0.1, 0.015)
    stalled = _trace(_stalled_streams(4, 3.0, 0.01, scrapes), scrapes)
    clean = _trace(_stalled_streams(4, 3.0, 0.01, []), scrapes)
    both = sampler_cost.of_traces([stalled, clean, stalled])
    assert both["repeats"] == 3 and both["tbt_p99"] == sampler_cost.measure(stalled)["tbt_p99"]
    assert both["moved"] is True
    half = sampler_cost.of_traces([stalled, _trace({"a": [0.0, 0.1]}, None)])
    assert half["status"] == sampler_cost.NOT_MEASURED


def test_a_trace_keeps_its_scrapes_through_a_dict():
    trace = _trace({"a": [0.0, 0.1]}, [(0.01, 0.02)])
    again = Trace.from_dict(trace.to_dict())
    assert again.scrapes == [(0.01, 0.02)]
    assert Trace.from_dict({**trace.to_dict(), "scrapes": None}).scrapes is None


# --------------------------------------------------------------------------------------------
# the report


def test_the_report_shows_the_sampler_beside_each_engines_p99_gap(tmp_path: Path):
    scrapes = _scrapes(3.0, 0.1, 0.015)
    stalled = _trace(_stalled_streams(8, 3.0, 0.01, scrapes), scrapes)
    stalled.engine = "server:preset=vllm"
    in_process = _trace(_stalled_streams(8, 3.0, 0.01, []), None)
    in_process.engine = "reference"
    results = Results()
    results.add_trace(stalled)
    results.add_trace(in_process)
    recorded = {r["engine"]: r for r in results.data["scenarios"][0]["results"]}
    assert recorded["server:preset=vllm"]["sampler_cost"]["moved"] is True
    assert recorded["reference"]["sampler_cost"]["status"] == "no sampler"
    html = render_report(Results(results.to_dict()))
    assert f"(10 ms clear of /metrics scrapes; {len(scrapes)} scrapes)" in html
    assert "kvbench&#39;s /metrics sampler moved this figure" in html or "kvbench's /metrics sampler moved" in html
    assert "(no sampler)" in html
    assert "TBT ratios moved by kvbench" in html, "the side-by-side ratios of its gaps say so too"
    unmoved = Results()
    unmoved.add_trace(in_process)
    assert "sampler moved" not in render_report(unmoved) and "TBT ratios moved" not in render_report(unmoved)


# --------------------------------------------------------------------------------------------
# the driver, against the stub server


def _serve_stub(tmp_path: Path, metrics_block: str, interval: str) -> Trace:
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "kvbench.testing.stub_server", "--port", str(port),
                            "--token-delay", "0.02", "--per-token-writes", "--metrics-block", metrics_block],
                           tmp_path / f"stub-{port}.log")
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        server.wait_healthy(url, timeout=60)
        adapter = OpenAIAdapter(str(builtin_checkpoint("tiny")), {"url": url, "metrics_interval": interval})
        recorder = TraceRecorder("stub", "serve")
        adapter.serve([WorkloadRequest(f"m{i}", [3, i + 3], 100, arrival_time=0.0) for i in range(3)], recorder)
        return recorder.finish()
    finally:
        server.stop()


@pytest.mark.server
@pytest.mark.parametrize("block, moved", [("0.06", True), ("0", False)])
def test_the_driver_times_every_scrape_on_the_token_clock_and_a_stalling_stub_shows_its_cost(
        tmp_path, block: str, moved: bool):
    """A stub whose /metrics holds its loop for 60 ms (20 ms between tokens, sampled every 0.1 s) moves the p99
    gap; the same stub answering at once does not, and its gaps across scrapes stay far from 60 ms."""
    trace = _serve_stub(tmp_path, block, "0.1")
    assert trace.scrapes and len(trace.scrapes) >= sum(s.sampled for s in trace.steps) >= 5
    first_token = min(r.token_times[0] for r in trace.requests.values())
    assert all(a <= b for a, b in trace.scrapes) and trace.scrapes[0][0] < first_token, \
        "the scrapes are on the clock of the token times (the first came before the first token)"
    m = sampler_cost.measure(trace)
    assert m["moved"] is moved, m
    assert (m["sign_p"] < 0.001) is moved, m
    if moved:
        assert m["tbt_p99_across_scrapes"] >= 0.05 and m["stall_share"] > 0.05
    else:  # not the stall share: a client held off the shared CPU while a scrape is out stretches both (an upper
        # bound, as documented); the gaps a scrape alone met stay short
        assert m["tbt_p99_scrapes_only"] < 0.05


@pytest.mark.server
def test_metrics_interval_0_is_no_sampler(tmp_path):
    trace = _serve_stub(tmp_path, "0.06", "0")
    assert trace.scrapes is None and sampler_cost.measure(trace)["status"] == sampler_cost.NO_SAMPLER
