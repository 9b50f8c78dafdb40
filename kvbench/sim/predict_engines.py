"""``kvbench predict``: the simulator against real engines: calibrate, predict, measure, compare.

For each engine (``reference`` in process, ``vllm``: vLLM V1's CPU server, ``server:preset=vllm``), on
the tiny model with head size 32 (the smallest vLLM's CPU attention takes) and the same knobs
(:data:`KNOBS`: block size 32, a 64-block pool, chunked prefill with a 512-token budget, 32 sequences):

1. **Calibrate**, one pass per engine in every measured round (so the profile sees the load the
   measurements see; fitted on all the passes at the end). The reference engine: ``kvbench calibrate``'s
   own fit to its served step intervals (:func:`kvbench.sim.calibration.calibrate`), and the client-side
   fit below as a cross-check. vLLM, whose steps are not visible: client-side spans
   (:mod:`kvbench.sim.client_calibration`: decode cells of batches of 1-12 at contexts 32-416, lone
   prompts' TTFT) fitted to the same cost model, with its ``/metrics`` telling how much of a lone TTFT
   the engine spent. vLLM's front end (its API server, where a stream's outputs merge into chunks when
   it falls behind) is fitted too (:func:`kvbench.sim.front_end.fit_front_end`); the per-request cost
   of a lone TTFT then moves from the engine's clock to the front end's intake.
2. **Predict.** ``sim:hardware=PROFILE,clock=cost`` serves the preemption storm's sweep and the evening
   surge (quick sizes) configured like the engine: its pool in blocks (vLLM keeps one block of its pool
   as the null block, so 63 usable; it admits a request only when its whole sequence fits the free
   blocks, ``admission_policy=full_prompt``), block size, ``max_num_seqs``, ``max_num_batched_tokens``,
   chunked prefill, recompute preemption.
3. **Measure.** The same jobs on the real engine, ``rounds`` rounds, engines interleaved (the order
   rotates every round), each engine's calibration pass right before its jobs; the vLLM server is
   started once and reused for everything.
4. **Compare** (:mod:`kvbench.sim.accuracy`). Per engine: the storm's preemptions and throughput at
   every sweep point and its knee, the surge's preemptions, TTFT p50/p99 and p99 inter-token gap:
   predicted, the median of the rounds [min-max], the error against that median and the rounds' spread
   beside it; the knee against the knee of the rounds' medians and the knees the rounds allow.

Why vLLM's counts can be predicted by the reference scheduler, and where the two differ:
docs/simulator.md#predicting-a-real-engine-vllm-the-reference-engine.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.bench import metrics
from kvbench.bench import scenarios as sc
from kvbench.bench.formatting import fmt_share
from kvbench.bench.results import commit_info
from kvbench.bench.scenarios.common import Job, Model, serve
from kvbench.bench.scenarios.storms import knee_within
from kvbench.core.knobs import Knobs
from kvbench.engines.http.presets import REFERENCE, VLLM_CPU_LAYOUT
from kvbench.engines.http.server import ServerAdapter
from kvbench.engines.inprocess.reference import ReferenceAdapter
from kvbench.engines.registry import make_adapter, parse_engine_spec
from kvbench.models.builtin import checkpoint_for
from kvbench.sim import accuracy as acc
from kvbench.sim.calibration import base_profile, calibrate
from kvbench.sim.client_calibration import ClientDesign, client_spans, fit_client
from kvbench.sim.front_end import cell_figures, fit_front_end
from reference_engine.costs import CostModel, load_model_shape
from reference_engine.sim.calibrate import Design, fit_error, fit_intervals

KNOBS = Knobs(block_size=32, num_gpu_blocks=64, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024,
              enable_chunked_prefill=True, enable_prefix_caching=False, preemption_mode="recompute")
#: blocks vLLM's pool gives requests: V1's BlockPool takes one as its null block
VLLM_USABLE_BLOCKS = KNOBS.num_gpu_blocks - 1
#: the engines this command knows how to calibrate, predict and measure
ENGINES = ("reference", "vllm")
FIGURES = ("output_throughput", "preemptions", "ttft_p50", "ttft_p99", "ttft_mean", "tbt_p99", "requests_finished")
#: vLLM's own TTFT (its front end's clock at the first token's output, before the stream delivers it)
SERVER_TTFT = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")
STORM, SURGE = "preemption_storm", "evening_surge"
#: the designs of ``small=True``: a few cells, short decodes (a quick look at the pipeline, not figures to publish)
SMALL_DESIGN = Design(contexts=(32, 192), decode_batches=(1, 4), prefills=(16, 96), repeats=1, rounds=1,
                      heldout_contexts=(192,), swap_blocks=(1, 4), swap_repeats=1, wake_gaps=(0.005, 0.05),
                      wake_repeats=1)
SMALL_CLIENT_DESIGN = ClientDesign(decode_cells=((32, 1), (32, 4), (160, 1), (160, 4)), decode_tokens=24,
                                   prefills=(32, 320), prefill_repeats=1, rounds=1)

Figures = dict[str, float | None]


@dataclasses.dataclass(frozen=True)
class PredictOptions:
    """What :func:`predict_engines` runs. ``cool_down_s``: quiet before each engine's round (vLLM's
    scheduler and worker spin on ``sched_yield`` for a second after their last message, where the next
    engine measured runs); ``vllm_helper_cores``: the server adapter's ``helper_cores`` (``engine``: vLLM's
    scheduler bound beside its worker; ``free``: as vLLM starts); ``small``: :data:`SMALL_DESIGN` and
    :data:`SMALL_CLIENT_DESIGN` instead of the full calibration designs."""

    engines: tuple[str, ...] = ENGINES
    rounds: int = 5
    client_fit_reference: bool = True
    front_end: bool = True
    vllm_helper_cores: str = "engine"
    log_dir: str | None = None
    cool_down_s: float = 0.0
    small: bool = False
    command: str = "kvbench predict"

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds} is invalid: expected >= 1")
        unknown = [e for e in self.engines if e not in ENGINES]
        if unknown or not self.engines:
            raise ValueError(f"engines={','.join(self.engines)!r} is invalid: expected one or more of "
                             f"{', '.join(ENGINES)}")
        if self.vllm_helper_cores not in ("engine", "free"):
            raise ValueError(f"vllm_helper_cores={self.vllm_helper_cores!r} is invalid: expected engine or free")
        if self.cool_down_s < 0:
            raise ValueError(f"cool_down_s={self.cool_down_s} is invalid: expected >= 0")


def jobs(model: Model) -> dict[str, list[Job]]:
    """The storm's sweep points and the surge, quick sizes, with :data:`KNOBS` (the scenarios' pools are
    128 blocks of 16: the same 2,048 tokens as 64 of 32)."""
    out = {}
    for name in (STORM, SURGE):
        planned = sc.SCENARIOS[name].plan("quick", model)
        for job in planned:
            if job.knobs.num_gpu_blocks * job.knobs.block_size != KNOBS.num_gpu_blocks * KNOBS.block_size:
                raise RuntimeError(f"{name}'s pool is no longer {KNOBS.num_gpu_blocks * KNOBS.block_size} tokens: "
                                   "KNOBS must follow it, or the engines see other pressure than the scenario")
        out[name] = [dataclasses.replace(job, knobs=KNOBS) for job in planned]
    return out


def figures(trace: Any) -> Figures:
    """The :data:`FIGURES` of one trace, with the tokens per stream chunk the client saw (1: every token
    on its own; more: the server merged them)."""
    m = metrics.summarize(trace)
    out = {k: m.get(k) for k in FIGURES}
    tokens = sum(len(r.token_times) for r in trace.requests.values())
    chunks = sum(len(set(r.token_times)) for r in trace.requests.values())
    out["tokens_per_chunk"] = tokens / chunks if chunks else None
    return out


def serve_scraped(adapter: Any, job: Job, name: str) -> Figures:
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


def run_all(adapter: Any, plan: dict[str, list[Job]], tag: str, say: Callable[[str], None]
            ) -> dict[str, list[Figures]]:
    """Every job of ``plan`` on ``adapter``: figures per job, per scenario."""
    out: dict[str, list[Figures]] = {}
    for name, js in plan.items():
        t0 = time.perf_counter()
        out[name] = [serve_scraped(adapter, job, name) for job in js]
        pre = [int(f["preemptions"] or 0) for f in out[name]]
        say(f"   {tag} {name}: {time.perf_counter() - t0:.1f} s, preemptions {pre}, tok/s "
            f"{[round(f['output_throughput'] or 0) for f in out[name]]} ({_load()})")
    return out


@dataclasses.dataclass
class _Material:
    """Calibration material gathered over the rounds, one pass per round per engine."""

    spans: dict[str, list] = dataclasses.field(default_factory=lambda: {"vllm": [], "reference/client-fit": []})
    totals: dict[str, list] = dataclasses.field(default_factory=lambda: {"vllm": [], "reference/client-fit": []})
    intervals: list = dataclasses.field(default_factory=list)
    wakes: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (wake_s, wake_tau_s) per pass
    reference_base: Any = None


def predict_engines(options: PredictOptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Calibrate, measure (interleaved), fit, predict; returns every figure (what ``--json`` writes and
    :func:`report` reads): ``predicted`` and ``measured`` per engine, per scenario, per job; the
    calibration summaries; the profiles; the sweep's ``xs``."""
    import torch

    torch.set_num_threads(1)  # vLLM's worker runs one OpenMP thread here (the other core is its API server's)
    started = datetime.datetime.now(datetime.UTC)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    say(f"kvbench predict: {started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, uptime: {uptime}")
    ckpt = checkpoint_for([REFERENCE.kv_layout, VLLM_CPU_LAYOUT], "tiny")
    model, shape = Model.from_dir(ckpt, "tiny-hd32"), load_model_shape(ckpt)
    plan = jobs(model)
    folder = Path(tempfile.mkdtemp(prefix="kvbench-predict-"))
    material = _Material()
    measured = _calibrate_and_measure(options, str(ckpt), shape, plan, folder, material, say)
    profiles, calib = _fit_profiles(options, str(ckpt), shape, folder, material)
    for name, text in calib.items():
        say(f"{name}: {text}")
    predicted: dict[str, dict[str, list[Figures]]] = {}
    for name in profiles:
        sim = make_adapter(parse_engine_spec(f"sim:hardware={profiles[name]},clock=cost,dtype=float32"), str(ckpt))
        blocks = VLLM_USABLE_BLOCKS if name.startswith("vllm") else KNOBS.num_gpu_blocks
        # vLLM 0.32 admits a request only when its whole sequence fits (scheduler_reserve_full_isl)
        admission = "full_prompt" if name.startswith("vllm") else "none"
        sim_knobs = dataclasses.replace(KNOBS, num_gpu_blocks=blocks, admission_policy=admission)
        sim_plan = {k: [dataclasses.replace(j, knobs=sim_knobs) for j in js] for k, js in plan.items()}
        predicted[name] = run_all(sim, sim_plan, f"sim({name})", say)
    return {"started": started.isoformat(timespec="seconds"), "uptime": uptime, "command": options.command,
            "commit": (commit_info(Path(__file__).parent)["id"] or "?")[:7], "knobs": KNOBS.as_dict(),
            "calibration": calib, "predicted": predicted, "measured": measured, "xs": [j.x for j in plan[STORM]],
            "end_load": os.getloadavg()[0],
            "profiles": {k: json.loads(Path(v).read_text()) for k, v in profiles.items()},
            "delivery_cells": [dataclasses.asdict(c) for t in material.totals["vllm"] for c in t.get("delivery", [])]}


Rounds = dict[str, list[dict[str, list[Figures]]]]


def _calibrate_and_measure(options: PredictOptions, ckpt: str, shape: Any, plan: dict[str, list[Job]], folder: Path,
                           material: _Material, say: Callable[[str], None]) -> Rounds:
    """Every round: per engine (the order rotating), a calibration pass into ``material``, then its jobs."""
    design = SMALL_CLIENT_DESIGN if options.small else ClientDesign()
    design.check_fits(VLLM_USABLE_BLOCKS, KNOBS.block_size, KNOBS.max_model_len)
    served_design = dataclasses.replace(SMALL_DESIGN if options.small else Design(), rounds=1)
    rng = np.random.default_rng(0)
    engines = list(options.engines)
    adapters: dict[str, Any] = {}
    measured: Rounds = {n: [] for n in engines}
    try:
        if "vllm" in engines:
            vllm = ServerAdapter(ckpt, {"preset": "vllm", "args": "--dtype float32",
                                        "helper_cores": options.vllm_helper_cores,
                                        # no /metrics sampling during runs: each scrape held vLLM's API server
                                        # ~15 ms, every stream's gap with it (the counters are still read
                                        # before and after each run)
                                        "metrics_interval": "0",
                                        "log_dir": options.log_dir or str(folder)}, name="vllm")
            adapters["vllm"] = vllm
            t0 = time.perf_counter()
            first = plan[SURGE][0]
            serve(vllm, dataclasses.replace(first, workload=dataclasses.replace(
                first.workload, requests=first.workload.requests[:4])), "warmup")
            say(f"vllm: started and warmed up in {time.perf_counter() - t0:.0f} s ({_load()})")
        if "reference" in engines:
            adapters["reference"] = ReferenceAdapter(ckpt, {"dtype": "float32"}, name="reference")
        for r in range(options.rounds):
            for name in engines[r % len(engines):] + engines[:r % len(engines)]:
                time.sleep(options.cool_down_s)
                t0 = time.perf_counter()
                if name == "vllm":
                    got, t = client_spans(lambda w: serve(vllm, Job(w, KNOBS), "calibrate"),
                                          lambda: vllm.server_for(KNOBS).scrape(), shape.vocab_size,
                                          KNOBS.max_num_batched_tokens, design, rng, say)
                    material.spans["vllm"] += got
                    material.totals["vllm"].append(t)
                else:
                    cal = calibrate(ckpt, "reference-served-fit", served_design, seed=r, torch_threads=1)
                    material.reference_base = material.reference_base or cal.profile
                    material.wakes.append((cal.profile.coefficients.wake_s, cal.profile.coefficients.wake_tau_s))
                    material.intervals.extend(cal.train + cal.heldout)
                    if options.client_fit_reference:  # the method vLLM gets, on the reference engine: a cross-check
                        ref = adapters["reference"]
                        got, t = client_spans(lambda w, ref=ref: serve(ref, Job(w, KNOBS), "calibrate"), None,
                                              shape.vocab_size, KNOBS.max_num_batched_tokens, design, rng, say)
                        material.spans["reference/client-fit"] += got
                        material.totals["reference/client-fit"].append(t)
                say(f"   round {r + 1} {name} calibration pass: {time.perf_counter() - t0:.1f} s ({_load()})")
                measured[name].append(run_all(adapters[name], plan, f"round {r + 1} {name}", say))
    finally:
        for a in adapters.values():
            a.close()
    return measured


def _fit_profiles(options: PredictOptions, ckpt: str, shape: Any, folder: Path, material: _Material
                  ) -> tuple[dict[str, Path], dict[str, str]]:
    """The profile of each engine (and each cross-check) fitted on every round's pass: (paths, summaries)."""
    profiles: dict[str, Path] = {}
    calib: dict[str, str] = {}
    if "reference" in options.engines:
        ref_base = material.reference_base
        cost = CostModel(shape, ref_base)
        # waking up after idle, timed in every pass: the median of the passes' fits
        wake_s, wake_tau_s = (float(np.median([w[i] for w in material.wakes])) for i in (0, 1))
        profile = ref_base.with_coefficients(dataclasses.replace(
            fit_intervals(cost, material.intervals), wake_s=wake_s, wake_tau_s=wake_tau_s if wake_s > 0 else 0.0))
        err = fit_error(CostModel(shape, profile), material.intervals)
        c = profile.coefficients
        calib["reference"] = (f"served-interval fit ({err['intervals']} intervals, {options.rounds} passes): fixed "
                              f"{c.fixed_s * 1e3:.2f} ms, per seq {c.per_seq_s * 1e6:.0f} us, per request "
                              f"{c.per_request_s * 1e6:.0f} us, dense x{c.dense:.2f}, attention x{c.attention:.2f}, "
                              f"memory x{c.memory:.2f}, waking up +{c.wake_s * 1e3:.2f} ms (63% after "
                              f"{c.wake_tau_s * 1e3:.0f} ms idle); median interval error "
                              f"{err['median_rel_error']:.0%}, R² {err['r2']:.2f}, "
                              f"sum {err['total_rel_error']:.1%} off")
        profiles["reference"] = profile.save(folder / "reference.json")
        if options.client_fit_reference:
            cal = fit_client(profile, shape, material.spans["reference/client-fit"],
                             material.totals["reference/client-fit"], "reference-client-fit")
            profiles["reference/client-fit"] = cal.profile.save(folder / "reference-client.json")
            calib["reference/client-fit"] = cal.summary()
    if "vllm" in options.engines:
        vbase = material.reference_base or base_profile(ckpt, Design(), "vllm-client-fit")
        # waking up after idle was timed on the reference engine's steps, which vLLM's are not: not assumed
        vbase = vbase.with_coefficients(dataclasses.replace(vbase.coefficients, wake_s=0.0, wake_tau_s=0.0))
        cal = fit_client(vbase, shape, material.spans["vllm"], material.totals["vllm"], "vllm-client-fit")
        calib["vllm"] = cal.summary()
        vprofile = cal.profile
        cells = [c for t in material.totals["vllm"] for c in t.get("delivery", [])]
        if options.front_end and cells:
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
    return profiles, calib


def rows_and_knees(result: dict[str, Any]) -> tuple[list[acc.Row], list[list[str]], list[str]]:
    """:func:`predict_engines`'s result as accuracy rows, knee rows and warnings (an engine that never
    preempted tells nothing about preemption)."""
    rows, knees, warnings = [], [], []
    xs = result["xs"]
    for name, pred in result["predicted"].items():
        rounds = result["measured"][name.split("/")[0]]
        for i, x in enumerate(xs):
            for metric, kind in (("preemptions", "count"), ("output_throughput", "time")):
                rows.append(acc.Row(name, f"storm c={x:g}", metric, kind, pred[STORM][i][metric],
                                    tuple(rd[STORM][i][metric] for rd in rounds)))
        for metric, kind in (("preemptions", "count"), ("ttft_p50", "time"), ("ttft_p99", "time"),
                             ("tbt_p99", "time"), ("output_throughput", "time"), ("ttft_mean", "time")):
            rows.append(acc.Row(name, "evening surge", metric, kind, pred[SURGE][0][metric],
                                tuple(rd[SURGE][0][metric] for rd in rounds)))
        if any(rd[SURGE][0].get("ttft_mean_server") is not None for rd in rounds):
            rows.append(acc.Row(name, "evening surge", "ttft_mean (server /metrics)", "time",
                                pred[SURGE][0]["ttft_mean"],
                                tuple(rd[SURGE][0].get("ttft_mean_server") for rd in rounds)))
        medians = [statistics.median(rd[STORM][i]["output_throughput"] or 0 for rd in rounds) for i in range(len(xs))]
        knees.append(acc.knee_row(
            name, knee_within(xs, [p["output_throughput"] for p in pred[STORM]]),
            [knee_within(xs, [p["output_throughput"] for p in rd[STORM]]) for rd in rounds],
            knee_within(xs, medians),
            acc.knee_range(xs, [[p["output_throughput"] for p in rd[STORM]] for rd in rounds])))
        top = [rd[STORM][-1]["preemptions"] or 0 for rd in rounds] + [rd[SURGE][0]["preemptions"] or 0 for rd in rounds]
        if not any(top) and "/" not in name:
            warnings.append(f"WARNING: {name}: no preemption measured at the storm's top nor in the surge")
    return rows, knees, warnings


def report(result: dict[str, Any]) -> str:
    """The comparison as text: the accuracy table, the knees, tokens per chunk, the median errors."""
    rows, knees, warnings = rows_and_knees(result)
    n = len(next(iter(result["measured"].values())))
    lines = [f"\n# kvbench predict: {result['started']}, commit {result['commit']}, {n} measured rounds",
             f"# {result['command']}", f"# uptime at start: {result['uptime']}; load at the end "
             f"{result['end_load']:.1f}", "", acc.table(rows), "",
             "| engine | knee predicted | knee of the rounds' medians | each round's knee | verdict | knees the "
             "rounds allow | verdict (rounds) |",
             "|---|---|---|---|---|---|---|", *("| " + " | ".join(k) + " |" for k in knees), ""]
    for name, rounds in result["measured"].items():
        per_chunk = [v for rd in rounds for k in (STORM, SURGE) for f in rd[k]
                     if (v := f.get("tokens_per_chunk")) is not None]
        if per_chunk:
            lines.append(f"{name}: tokens per stream chunk as the client saw them: median "
                         f"{statistics.median(per_chunk):.2f}, max {max(per_chunk):.2f} (1 = every token on its own)")
    for name, pred in result["predicted"].items():
        per_chunk = [v for k in (STORM, SURGE) for f in pred[k] if (v := f.get("tokens_per_chunk")) is not None]
        if per_chunk:
            lines.append(f"sim({name}): tokens per stream chunk predicted: median {statistics.median(per_chunk):.2f}, "
                         f"max {max(per_chunk):.2f}")
    for name in result["predicted"]:
        mine = [r for r in rows if r.engine == name]
        for kind in ("count", "time"):
            e, s = acc.median_error(mine, kind)
            bar = acc.COUNT_BAR if kind == "count" else acc.TIME_BAR
            lines.append(f"{name}: median {kind} error {fmt_share(e, '-')} (bar {bar:.0%}), rounds' median spread "
                         f"{fmt_share(s, '-')}")
    return "\n".join(lines + warnings)


def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms"
