"""The recommendation for operators (docs/benchmarks.md#the-recommendation): the preemption mode by
sequence length from the run's one crossover, the pool that would have kept preemptions within the budget
at a scenario's peak, the admission setting from the policies trade-off, each with its evidence, the link
to the capacity plan, and the toy-model caveat."""

from __future__ import annotations

import re

import pytest

from kvbench.bench import metrics
from kvbench.bench.results import Results
from kvbench.report import advice as operator_advice
from kvbench.report import figures
from kvbench.report.render import plan_href, render_report, write_report
from tests.kvbench.test_report_figures import page_text, with_repeats
from tests.kvbench.trace_factory import synthetic_results

# --------------------------------------------------------------------------------------------
# preemption mode


def crossover(swap: list[float], recompute: list[float],
              xs: tuple[float, ...] = (128, 256, 512, 1024)) -> figures.Crossover:
    return figures.Crossover("swap_vs_recompute", "eng", "cost_s", "sequence length", xs, tuple(swap), tuple(recompute),
                           metrics.crossover(list(xs), swap, recompute))


def test_mode_by_length_follows_the_crossover():
    cx = crossover([0.020, 0.021, 0.022, 0.024], [0.008, 0.016, 0.032, 0.064])
    advice = operator_advice.mode_advice(cx, "#scenario-2")
    assert advice.setting == "recompute from 128 then swap from 512 tokens"
    assert f"The curves cross near {cx.text} tokens." in advice.detail
    assert "128–256 tokens: recompute; 512–1,024 tokens: swap" in advice.detail
    assert advice.evidence[0].href == "#scenario-2" and "Swap vs recompute" in advice.evidence[0].text


def test_mode_one_mode_everywhere_and_within_the_noise():
    assert operator_advice.mode_advice(crossover([0.01] * 4, [0.02, 0.04, 0.08, 0.16]), "").setting == "swap"
    # both costs under the noise floor at the short lengths: "either" there, not a winner
    cx = crossover([0.0010, 0.0011, 0.004, 0.005], [0.0009, 0.0012, 0.009, 0.02])
    advice = operator_advice.mode_advice(cx, "")
    assert advice.setting == "swap from 512 tokens"
    assert "128–256 tokens: either (within the noise)" in advice.detail
    # a crossing inside the noise is no landmark: the advice does not name it (the headline's "within noise" and
    # the advice's "swap from 512" then say one thing, the chart's)
    assert "cross near" not in advice.detail and "swap 5 ms vs recompute 20 ms" in advice.detail


def test_no_mode_is_recommended_when_every_length_is_within_the_noise():
    advice = operator_advice.mode_advice(crossover([0.0010, 0.0011, 0.0012, 0.0013],
                                                   [0.0009, 0.0012, 0.0011, 0.0014]), "")
    assert advice.measured and not advice.earned and "recommends neither" in advice.detail


def test_mode_not_measured_without_a_crossover():
    advice = operator_advice.mode_advice(None, "")
    assert advice.setting == "not measured" and not advice.measured and not advice.evidence


def test_the_recommendation_states_the_facts_crossover_not_the_run_time_copy():
    """One number per fact: the crossover is Facts' (medians), whatever the judge recorded from one repeat."""
    res = with_repeats(synthetic_results())
    f = figures.Facts.of(res)
    recs = {r.engine: r for r in operator_advice.recommendations(res, f)}
    for engine, cx in f.crossovers.items():
        assert (f"cross near {cx.text} tokens" in recs[engine].mode.detail) != cx.within_noise
    text = page_text(render_report(res))
    stated = set(re.findall(r"cross near ([\d,.]+) tokens", text))
    assert stated <= {cx.text for cx in f.crossovers.values()}


# --------------------------------------------------------------------------------------------
# pool


def surge(preemptions: float = 10, *, pool: int = 48, running=(4, 6, 8), waiting=(2, 4, 6), swapped=(0, 1, 0),
          prompt: float = 100, output: float = 60) -> tuple[dict, dict]:
    res = {"engine": "eng", "mode": None,
           "metrics": {"preemptions": preemptions, "requests": 20, "prompt_len_mean": prompt,
                       "output_len_mean": output, "running_max": max(running), "waiting_max": max(waiting)},
           "series": {"t": [0, 1, 2], "num_running": list(running), "num_waiting": list(waiting),
                      "num_swapped": list(swapped)}}
    sc = {"name": "evening_surge", "parameters": {"num_gpu_blocks": pool, "block_size": 16, "model": "tiny"},
          "results": [res], "sweeps": []}
    return sc, res


def test_pool_for_the_peak_holds_every_request_in_flight():
    sc, res = surge()
    row = operator_advice.pool_row(sc, res, "#scenario-1", 512.0)
    # peak in flight 8 + 6 + 0 = 14; the mean request 160 tokens = 10 blocks of 16
    assert (row.peak_in_flight, row.per_request, row.within_budget) == (14, 0.5, False)
    assert row.needed_blocks == 140 and row.needed_bytes == 140 * 16 * 512
    advice = operator_advice.pool_advice([row], 512.0, "tiny", 16, plan_href="plan.html")
    assert advice.setting == "≈ 140 blocks (1.09 MiB)" and advice.earned
    assert advice.evidence[0].href == "#scenario-1" and advice.evidence[-1].href == "plan.html"


def test_no_pool_size_without_its_cost_curve():
    """"≈ 140 blocks" only beside the curve of preemptions against pool size (the capacity plan)."""
    sc, res = surge()
    row = operator_advice.pool_row(sc, res, "#scenario-1", 512.0)
    advice = operator_advice.pool_advice([row], 512.0, "tiny", 16)
    assert not advice.earned and advice.setting == "no size earned"
    assert "140" not in advice.setting + advice.detail and "cost curve" in advice.detail


def test_pool_within_budget_needs_nothing_more():
    sc, res = surge(preemptions=0)
    row = operator_advice.pool_row(sc, res, "", 512.0)
    assert row.within_budget and row.needed_blocks is None
    assert operator_advice.pool_advice([row], 512.0, "", 16).setting == "48 blocks (384 KiB) suffice"


def test_pool_estimate_below_the_pool_that_preempted_is_not_offered():
    sc, res = surge(pool=400)  # 140 blocks < 400, yet it preempted: the mean request understates the workload
    row = operator_advice.pool_row(sc, res, "", 512.0)
    assert row.needed_blocks is None and "understates" in row.note
    assert operator_advice.pool_advice([row], 512.0, "", 16).setting == "no estimate"


def test_pool_not_measured_without_a_storm_or_surge():
    assert operator_advice.pool_advice([], None, "", None).setting == "not measured"


def test_kv_bytes_per_token_of_the_builtin_models_and_dtypes():
    res = Results()
    res.add_engine({"name": "a", "kind": "reference", "options": {}})
    res.add_engine({"name": "b", "kind": "reference", "options": {"dtype": "bfloat16"}})
    res.add_engine({"name": "sim", "kind": "sim", "options": {}, "simulated": True, "model": "llama-3-8b"})
    res.add_engine({"name": "decl", "kind": "x", "options": {}, "kv_bytes_per_token": 131072})
    res.scenario("evening_surge", create=True, parameters={"model": "tiny"})
    assert operator_advice.kv_bytes_per_token(res, "a")[0] == 512
    assert operator_advice.kv_bytes_per_token(res, "b")[0] == 256
    assert operator_advice.kv_bytes_per_token(res, "sim")[0] is None
    assert operator_advice.kv_bytes_per_token(res, "decl")[0] == 131072
    res.scenario("evening_surge")["parameters"]["model"] = "custom"
    assert operator_advice.kv_bytes_per_token(res, "a") == (None, "the results do not record the model's KV size")


@pytest.mark.parametrize("preset", sorted(operator_advice.BUILTIN_KV_VALUES_PER_TOKEN))
def test_the_builtin_kv_sizes_match_the_checkpoints(preset):
    """The report may not import the engine, so it keeps a copy of the presets' KV shape: held to them here."""
    from kvbench.models.random_llama import build_config

    cfg = build_config(preset)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert operator_advice.BUILTIN_KV_VALUES_PER_TOKEN[preset] == (
        2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim)


# --------------------------------------------------------------------------------------------
# admission


def policies_scenario(**modes: tuple[float, ...]) -> dict:
    """A policies scenario with the evening surge's modes: {variant: (preemptions, output throughput[, p99 TBT])}
    (p99 TBT 30 ms by default)."""
    results = [{"engine": "eng", "mode": f"evening_surge/{variant.replace('_', '-')}",
                "metrics": {"preemptions": v[0], "output_throughput": v[1], "tbt_p99": v[2] if len(v) > 2 else 0.03}}
               for variant, v in modes.items()]
    for r in results:
        r["mode"] = r["mode"].replace("plus", "+")
    return {"name": "preemption_policies", "parameters": {}, "results": results, "sweeps": []}


def admission(sc: dict) -> operator_advice.Advice:
    res = Results()
    res.add_engine("eng")
    res.data["scenarios"].append(sc)
    return operator_advice.admission_advice(res, "eng", {"preemption_policies": "#scenario-9"})


def test_admission_fewest_preemptions_among_those_that_keep_throughput():
    advice = admission(policies_scenario(static=(10, 100, 0.06), watermark=(2, 97), watermark_headroom_0_2=(0, 80),
                                         watermarkpluspacing=(1, 96)))
    assert advice.setting == "admission_policy=watermark, admission_headroom=0.05, prefill_pacing_tokens=1"
    assert "1 preemptions against static's 10, at 96%" in advice.detail
    assert advice.evidence[0].href == "#scenario-9"


def test_admission_ties_go_to_the_smallest_headroom():
    sc = policies_scenario(static=(10, 100, 0.06), watermark=(2, 97))
    sc["results"].append({"engine": "eng", "mode": "evening_surge/watermark-headroom-0.2",
                          "metrics": {"preemptions": 2, "output_throughput": 99, "tbt_p99": 0.03}})
    assert admission(sc).setting == "admission_policy=watermark, admission_headroom=0.05"


def test_admission_static_when_nothing_to_gain_or_every_watermark_costs_throughput():
    assert admission(policies_scenario(static=(0, 100), watermark=(0, 100))).setting == "admission_policy=none"
    costly = admission(policies_scenario(static=(10, 100, 0.06), watermark=(0, 80)))
    assert not costly.earned and "no admission-controlled setting met the goal" in costly.detail


def test_no_admission_setting_where_every_row_misses_the_goal():
    """The issue's case: watermark kept the throughput and preempted less, but p99 TBT was not 2x lower, so the
    trade-off table says "goal met: no" on every row; the advice recommends nothing."""
    advice = admission(policies_scenario(static=(5, 100, 0.021), watermark=(0, 114, 0.0184),
                                         watermark_headroom_0_2=(0, 101, 0.02)))
    assert not advice.earned and advice.setting == "no setting earned"
    assert "watermark" not in advice.setting


def test_admission_not_measured_without_the_policies_scenario():
    assert admission({"name": "x", "parameters": {}, "results": [], "sweeps": []}).setting == "not measured"


# --------------------------------------------------------------------------------------------
# caveat, page and plan link


def test_caveat_for_a_toy_model_on_cpu_and_none_for_a_real_model_on_a_gpu():
    res = Results(device="cpu")
    res.scenario("evening_surge", create=True, parameters={"model": "tiny"})
    text = operator_advice.caveat(res)
    assert "built-in tiny model" in text and "on CPU" in text and "do not carry over to a real model on a GPU" in text
    real = Results(device="cuda:0 (NVIDIA H200)")
    real.scenario("evening_surge", create=True, parameters={"model": "custom"})
    assert operator_advice.caveat(real) == ""


@pytest.fixture(scope="module")
def results() -> Results:
    return synthetic_results()


def test_page_has_a_recommendation_per_engine_with_working_evidence_links(results):
    page = render_report(results)
    section = page[page.index('<section id="recommendation">'):page.index('<section id="scenarios">')]
    for engine in results.engine_names():
        assert f"<h3>{engine}" in section
    links = set(re.findall(r'href="(#scenario-\d+)"', section))
    assert links and all(f'id="{h[1:]}"' in page for h in links)
    assert "on CPU" in section  # the synthetic run's device is "cpu (synthetic)"
    assert "plan.html" not in section.replace("--report DIR writes one", "")


def test_the_plan_is_linked_when_one_was_made(tmp_path, results):
    run = tmp_path / "reports" / "run1"
    assert plan_href(run) is None
    (tmp_path / "reports" / "plan").mkdir(parents=True)
    (tmp_path / "reports" / "plan" / "plan.html").write_text("<html></html>")
    assert plan_href(run) == "../plan/plan.html"
    page = write_report(results, run, compare_previous=False).read_text()
    assert '<a href="../plan/plan.html">plan.html</a>' in page
    (run / "plan.html").write_text("<html></html>")
    assert plan_href(run) == "plan.html"


def test_a_crossing_inside_the_noise_is_named_nowhere():
    """The headline's "within noise", the advice and the cost chart say one thing: where both costs sit under the
    noise floor, no page element names the crossing as a landmark."""
    res = synthetic_results()
    sc = res.scenario("swap_vs_recompute")
    for p in sc["sweeps"][0]["points"]:  # every cost under a millisecond: any crossing is jitter
        p["metrics"] = {k: (v / 1000 if isinstance(v, float) else v) for k, v in p["metrics"].items()}
        p.pop("repeats", None)
    cx = figures.Facts.of(res).crossovers["reference"]
    assert cx.x is not None and cx.within_noise
    text = page_text(render_report(res))
    assert f"crossover {cx.text} (reference)" not in text  # not on the cost chart
    rec = next(r for r in operator_advice.recommendations(res) if r.engine == "reference")
    assert "cross near" not in rec.mode.detail


def test_lower_max_num_seqs_toward_the_knee_only_where_the_sweep_has_one():
    """The diagnosis' knob names the knee only for an engine whose concurrency sweep found one."""
    from kvbench.report.diagnosis import concurrency_knee, diagnose

    res = synthetic_results()
    for sc in res.scenarios:  # the storm's structural problem: preemptions before a surge, so the knob is shown
        for r in sc["results"]:
            r["metrics"]["preemptions_before_surge"] = 3
    knobs = {d["engine"]: d["checks"][0]["knob"] for d in diagnose(res)}
    for engine, knob in knobs.items():
        knee, _ = concurrency_knee(res, engine)
        assert ("toward the knee" in knob) == (knee is not None), (engine, knob)
    assert any("toward the knee" in k for k in knobs.values())  # the synthetic storm has a knee
    storm = res.scenario("preemption_storm")
    for p in storm["sweeps"][0]["points"]:  # throughput rising to the top of the sweep: no knee
        p["metrics"]["output_throughput"] = 100.0 * p["x"]
        p.pop("repeats", None)
    knobs = {d["engine"]: d["checks"][0]["knob"] for d in diagnose(res)}
    assert knobs and all("knee" not in k and k.startswith("Give the KV pool") for k in knobs.values()), knobs
