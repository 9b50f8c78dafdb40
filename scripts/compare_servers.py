"""The reference engine against vLLM's CPU build on the same work, measured with kvbench itself (issue 21).

Three engines serve the same closed-loop workload (token-id prompts, greedy, EOS ignored, every request
``--prompt`` + ``--output`` tokens), built and timed by kvbench's own machinery:

* ``inproc``: ``reference`` in process (:class:`~kvbench.engines.inprocess.reference.ReferenceAdapter`,
  the storm benchmarks' driver loop);
* ``ref-server``: ``server:preset=reference`` (``python -m reference_engine.serve``: an HTTP process and
  an engine process), streamed by kvbench's HTTP driver;
* ``vllm``: ``server:preset=vllm`` (vLLM V1's OpenAI server, CPU build, ``--enforce-eager``), the same driver;
* ``vllm-pinned`` (not run unless named): the same with ``helper_cores=engine``: vLLM's ``EngineCore``
  scheduler, which vLLM leaves unbound and which spins while its worker computes, bound to the worker's
  core so that it cannot take its API server's (:mod:`kvbench.launch.placement`).

``--cool-down S`` (default 1.5) waits before each timed job: vLLM's scheduler and worker spin for 1 s after
their last step, on the core the reference engine is bound to, and a job started at once paid for it.

``--metrics-interval S`` is the servers' ``metrics_interval`` (default 0.1: kvbench's /metrics sampler at
10 Hz, as the suite runs; 0: none). vLLM's API server spent ~15 ms on each scrape here, every stream
waiting meanwhile.

Both servers get the same knobs: block size 32, the same pool, ``max_model_len``, ``max_num_seqs``
(``--max-num-seqs``) and ``max_num_batched_tokens`` (``--max-num-batched-tokens``), and the same dtype
(the reference engine's ``--dtype``/``dtype=`` option, vLLM's ``--dtype``). For each model x dtype the
servers are started once (a warm-up job each, untimed) and kept for every concurrency and round; the
rounds are interleaved (the engines' order rotates from round to round) and every ratio is taken within
a round, printed as median [min-max] over the rounds. Nothing here asserts a time.

``--knob ENGINE:KEY=VALUE`` sets one knob of one engine (or variant) apart from the others': with
``--variant ref512= --knob ref512:max_num_batched_tokens=512`` a second reference server runs at its own
default prefill budget (512) beside the matched one (2048, vLLM's CPU server default), side by side.

Models: ``small`` (8 layers x 512, head size 64) and ``tiny-hd32`` (the tiny preset with head size 32, the
smallest vLLM's CPU attention takes: :func:`kvbench.models.builtin.checkpoint_for`).

Threads (``--threads``): each server's defaults are recorded from its processes (thread counts, CPU
affinity, ``OMP_NUM_THREADS`` in their environment) and, for vLLM, its "OpenMP thread binding" log.

* ``default``: each side as it starts by itself: vLLM binds its worker's OpenMP threads to all cores but
  the ones it reserves for its front end (``VLLM_CPU_OMP_THREADS_BIND=auto``: on 2 cores, 1 thread on
  core 0, core 1 reserved); the reference server's engine process runs ``--engine-threads``' default (every
  core but one since this script was written; torch's default, one thread per core, before:
  ``--variant torch-default='--engine-threads 2'`` measures that), the in-process engine torch's default.
* ``matched``: the reference engine (server and in process) runs as many torch threads as vLLM's worker
  has OpenMP threads (``nproc - 1``, at least 1), vLLM unchanged.

    PYTHONPATH=$PWD python scripts/compare_servers.py --quick
    PYTHONPATH=$PWD python scripts/compare_servers.py [--models small,tiny-hd32] [--dtypes float32,bfloat16]
        [--concurrency 16,64] [--rounds 2] [--requests 128] [--prompt 128] [--output 64]
        [--engines inproc,ref-server,vllm] [--variant NAME=FLAGS ...] [--knob ENGINE:KEY=VALUE ...]
        [--threads default|matched]
        [--json OUT.json]

``--quick``: tiny-hd32, float32, concurrency 64, 2 rounds (a few minutes, most of it vLLM's start-up).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvbench.bench import metrics
from kvbench.bench.results import commit_info
from kvbench.bench.scenarios.common import Job, Model, build_workload, serve
from kvbench.bench.workloads import ClosedLoop, Fixed, WorkloadSpec
from kvbench.engines.base import EngineAdapter, Knobs
from kvbench.engines.http.presets import REFERENCE, VLLM_CPU_LAYOUT
from kvbench.engines.http.server import ServerAdapter
from kvbench.engines.inprocess.reference import ReferenceAdapter
from kvbench.launch.placement import SPIN_QUIET_S
from kvbench.models.builtin import builtin_checkpoint, checkpoint_for

ENGINES = ("inproc", "ref-server", "vllm")
KNOWN_ENGINES = (*ENGINES, "vllm-pinned")
#: seconds of quiet before each timed job: vLLM's scheduler and worker spin on ``sched_yield`` for 1 s after
#: their last message (``SpinCondition``, ``busy_loop_s``), where the next engine measured runs
COOL_DOWN_S = SPIN_QUIET_S
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32


@dataclass
class Cell:
    """One model x dtype x concurrency: per engine, each round's output tok/s and TTFT p50 (s)."""

    model: str
    dtype: str
    concurrency: int
    tok_s: dict[str, list[float]] = field(default_factory=dict)
    ttft_p50: dict[str, list[float]] = field(default_factory=dict)
    finished: dict[str, list[int]] = field(default_factory=dict)

    def add(self, engine: str, m: dict[str, float | None]) -> None:
        self.tok_s.setdefault(engine, []).append(float(m["output_throughput"] or 0.0))
        self.ttft_p50.setdefault(engine, []).append(float(m["ttft_p50"] or float("nan")))
        self.finished.setdefault(engine, []).append(int(m["requests_finished"] or 0))


def spread(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    """Median [min-max]."""
    s = sorted(values)
    return f"{fmt.format(statistics.median(s))} [{fmt.format(s[0])}-{fmt.format(s[-1])}]"


def ratio(a: Sequence[float], b: Sequence[float]) -> str:
    """Median [min-max] of the round-by-round ratios a/b."""
    return spread([x / y for x, y in zip(a, b, strict=True)], "{:.2f}x")


def model_dir(name: str) -> Path:
    if name == "tiny-hd32":
        return checkpoint_for([REFERENCE.kv_layout, VLLM_CPU_LAYOUT], "tiny")
    if name in ("tiny", "small"):
        return builtin_checkpoint(name)
    raise SystemExit(f"--models: unknown model {name!r}; expected small, tiny-hd32 or tiny")


def make_engines(names: Sequence[str], ckpt: Path, dtype: str, ref_threads: int | None,
                 log_dir: Path, variants: dict[str, str] | None = None,
                 metrics_interval: float = 0.1) -> dict[str, EngineAdapter]:
    """The adapters for ``names``; ``ref_threads``: torch threads of the reference server's engine
    process (None: the server's own default); ``variants``: more
    reference servers, name -> the flags they are started with on top; ``metrics_interval``: every
    server's /metrics sampling period (0: none)."""
    engines: dict[str, EngineAdapter] = {}
    common = {"log_dir": str(log_dir), "metrics_interval": f"{metrics_interval:g}"}
    for name, flags in (variants or {}).items():
        adapter = ServerAdapter(str(ckpt), {"preset": "reference", "args": f"--dtype {dtype} {flags}",
                                            **common}, name=name)
        adapter.env_overrides["OMP_NUM_THREADS"] = None if ref_threads is None else str(ref_threads)
        engines[name] = adapter
    for name in names:
        if name == "inproc":
            engines[name] = ReferenceAdapter(str(ckpt), {"dtype": dtype}, name=name)
        elif name == "ref-server":
            adapter = ServerAdapter(str(ckpt), {"preset": "reference", "args": f"--dtype {dtype}", **common},
                                    name=name)
            # matched: the threads asked; default: the server's own choice, not this process's count
            adapter.env_overrides["OMP_NUM_THREADS"] = None if ref_threads is None else str(ref_threads)
            engines[name] = adapter
        elif name in ("vllm", "vllm-pinned"):
            helpers = "engine" if name == "vllm-pinned" else "free"
            engines[name] = ServerAdapter(str(ckpt), {"preset": "vllm", "args": f"--dtype {dtype}",
                                                      "helper_cores": helpers, **common}, name=name)
        else:
            raise SystemExit(f"--engines: unknown engine {name!r}; expected some of {', '.join(KNOWN_ENGINES)}")
    return engines


def workload(model: Model, n: int, prompt: int, output: int, concurrency: int, seed: int = 21):
    spec = WorkloadSpec("compare", n, Fixed(prompt), Fixed(output), ClosedLoop(concurrency), seed=seed)
    return build_workload(spec, model)


# -- thread defaults, read from the running processes --------------------------------------------------


def process_threads(pgid: int) -> list[dict[str, Any]]:
    """Every process of group ``pgid``: name, threads, CPUs it may run on, OMP settings in its environment."""
    rows = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.getpgid(pid) != pgid:
                continue
            status = (entry / "status").read_text()
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").strip()
            rows.append({
                "pid": pid, "comm": (entry / "comm").read_text().strip(), "cmd": cmd[:100],
                "threads": int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1)),  # type: ignore[union-attr]
                "cpus": sorted(os.sched_getaffinity(pid)),
                "omp": {k: v for k, v in env.items() if k.startswith(("OMP_", "KMP_", "GOMP_", "VLLM_CPU"))},
            })
        except (OSError, ProcessLookupError, AttributeError):
            continue
    return sorted(rows, key=lambda r: r["pid"])


def server_threads(adapter: ServerAdapter) -> dict[str, Any]:
    """The running server's processes and, from its log, what it said about threads."""
    process = adapter.process
    if process is None:
        return {}
    said = []
    if adapter.logs:
        text = Path(adapter.logs[-1]).read_text(errors="replace")
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if "OpenMP thread binding info" in line:
                said += [line.strip()] + [x.strip() for x in lines[i + 1:i + 5]]
            elif re.search(r"max_num_batched_tokens|torch threads|num_threads", line):
                said.append(line.strip()[-200:])
    return {"processes": process_threads(process.pgid), "log": said[:12]}


def describe_threads(name: str, info: dict[str, Any]) -> list[str]:
    out = [f"  {name}:"]
    for p in info.get("processes", []):
        out.append(f"    pid {p['pid']} {p['comm']:<16} threads {p['threads']:>3}  cpus {p['cpus']}  "
                   f"{' '.join(f'{k}={v}' for k, v in sorted(p['omp'].items())) or '(no OMP_* set)'}")
    out += [f"    log: {line}" for line in info.get("log", [])]
    return out


# -- the run ------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    started = datetime.datetime.now(datetime.UTC)
    ref_threads: int | None = None
    if args.threads == "matched":
        ref_threads = max(1, (os.cpu_count() or 2) - 1)  # vLLM's auto binding: every core but one reserved
        torch.set_num_threads(ref_threads)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="compare-servers-"))
    print(f"compare_servers: {started:%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}, threads={args.threads} (this process: {torch.get_num_threads()} "
          f"torch threads), server logs in {log_dir}", flush=True)
    cells: list[Cell] = []
    threads_seen: dict[str, Any] = {}
    for model_name in args.models:
        ckpt = model_dir(model_name)
        model = Model.from_dir(ckpt, model_name)
        max_len = args.prompt + args.output
        blocks = args.max_num_seqs * -(-max_len // BLOCK_SIZE) + 8  # every running request's KV, no preemption
        knobs = Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=blocks, max_num_seqs=args.max_num_seqs,
                      max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens)
        for dtype in args.dtypes:
            engines = make_engines(args.engines, ckpt, dtype, ref_threads, log_dir, args.variant,
                                   args.metrics_interval)
            try:
                print(f"\n== {model_name} ({ckpt.name}), {dtype}: {args.requests} requests x {args.prompt} prompt + "
                      f"{args.output} output, knobs {knobs.as_dict()}", flush=True)
                warm = workload(model, 8, args.prompt, 8, 8, seed=1)
                engine_knobs = {name: knobs.merged(Knobs(**args.knob.get(name, {}))) for name in engines}
                for name, adapter in engines.items():
                    t0 = time.perf_counter()
                    serve(adapter, Job(warm, engine_knobs[name]), "compare-warmup")
                    print(f"   {name}: started and warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
                    if isinstance(adapter, ServerAdapter):
                        threads_seen[f"{name} ({model_name}, {dtype})"] = server_threads(adapter)
                group = {c: Cell(model_name, dtype, c) for c in args.concurrency}
                names = list(engines)
                for r in range(args.rounds):
                    for ci, c in enumerate(args.concurrency):
                        requests = workload(model, args.requests, args.prompt, args.output, c)
                        k = (r + ci) % len(names)
                        for name in names[k:] + names[:k]:
                            time.sleep(args.cool_down)  # the last engine's spinning waiters gone idle
                            trace = serve(engines[name], Job(requests, engine_knobs[name]), "compare")
                            m = metrics.summarize(trace)
                            group[c].add(name, m)
                            print(f"   round {r + 1} c={c:<3} {name:<10} {m['output_throughput'] or 0:8,.0f} tok/s  "
                                  f"TTFT p50 {m['ttft_p50'] or float('nan'):6.3f} s  "
                                  f"finished {int(m['requests_finished'] or 0)}/{args.requests}", flush=True)
                cells += group.values()
            finally:
                for adapter in engines.values():
                    adapter.close()
    return {"started": started.isoformat(timespec="seconds"), "command": " ".join(sys.argv),
            "commit": _commit(), "threads_mode": args.threads, "client_torch_threads": torch.get_num_threads(),
            "cells": [c.__dict__ for c in cells], "threads": threads_seen, "cores": os.cpu_count(),
            "variants": dict(args.variant), "knob_overrides": args.knob, "metrics_interval": args.metrics_interval,
            "cool_down_s": args.cool_down}


def report(result: dict[str, Any]) -> str:
    cells = [Cell(**c) for c in result["cells"]]
    lines = [f"\n# compare_servers: {result['started']}, commit {result['commit']}, threads={result['threads_mode']}",
             f"# {result['command']}",
             f"# /metrics sampled every {result.get('metrics_interval', 0.1):g} s during runs (0: not at all); "
             f"{result.get('cool_down_s', 0):g} s of quiet before each timed job", "",
             "| model | dtype | conc. | engine | output tok/s | TTFT p50 s | tok/s vs vLLM | TTFT vs vLLM |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        base = "vllm" if "vllm" in c.tok_s else None
        for engine in c.tok_s:
            vs_tok = ratio(c.tok_s[engine], c.tok_s[base]) if base and engine != base else ""
            vs_ttft = ratio(c.ttft_p50[engine], c.ttft_p50[base]) if base and engine != base else ""
            lines.append(f"| {c.model} | {c.dtype} | {c.concurrency} | {engine} | {spread(c.tok_s[engine])} | "
                         f"{spread(c.ttft_p50[engine], '{:.2f}')} | {vs_tok} | {vs_ttft} |")
        if "vllm-pinned" in c.tok_s and "ref-server" in c.tok_s:
            lines.append(f"| {c.model} | {c.dtype} | {c.concurrency} | ref-server / vllm-pinned | "
                         f"{ratio(c.tok_s['ref-server'], c.tok_s['vllm-pinned'])} | "
                         f"{ratio(c.ttft_p50['ref-server'], c.ttft_p50['vllm-pinned'])} | | |")
        if "inproc" in c.tok_s and "ref-server" in c.tok_s:
            lines.append(f"| {c.model} | {c.dtype} | {c.concurrency} | ref-server / inproc | "
                         f"{ratio(c.tok_s['ref-server'], c.tok_s['inproc'])} | | | |")
        for variant in result.get("variants", {}):  # what the flags of a variant change, side by side
            if variant in c.tok_s and "ref-server" in c.tok_s:
                lines.append(f"| {c.model} | {c.dtype} | {c.concurrency} | ref-server / {variant} | "
                             f"{ratio(c.tok_s['ref-server'], c.tok_s[variant])} | "
                             f"{ratio(c.ttft_p50['ref-server'], c.ttft_p50[variant])} | | |")
    for name, overrides in result.get("knob_overrides", {}).items():
        lines.append(f"\n{name} ran with " + ", ".join(f"{k}={v}" for k, v in overrides.items())
                     + " (the others with the knobs above)")
    lines += ["", "ratios: within each round, median [min-max] over the rounds; TTFT vs vLLM below 1 means the "
              "reference engine answered first. Thread settings seen:"]
    for name, info in result["threads"].items():
        lines += describe_threads(name, info)
    return "\n".join(lines)


def parse_knob_overrides(parser: argparse.ArgumentParser, items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["ENGINE:KEY=VALUE", ...]`` -> ``{engine: {knob: value}}``, values read as JSON where they parse
    (numbers, true/false) and as strings otherwise; an unknown knob is an error naming it."""
    names = {f.name for f in fields(Knobs)}
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        engine, sep, setting = item.partition(":")
        key, eq, value = setting.partition("=")
        if not (sep and eq and engine and key):
            parser.error(f"--knob: expected ENGINE:KEY=VALUE, got {item!r}")
        if key not in names:
            parser.error(f"--knob {item!r}: unknown knob {key!r}; expected one of {', '.join(sorted(names))}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(engine, {})[key] = parsed
    return out


def _commit() -> str:
    """The checkout's commit, short (kvbench's own results record it the same way)."""
    return (commit_info(Path(__file__).parent)["id"] or "?")[:7]


def _list(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-hd32, float32, concurrency 64, 2 rounds")
    parser.add_argument("--models", type=_list(str), default=["small", "tiny-hd32"])
    parser.add_argument("--dtypes", type=_list(str), default=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=_list(int), default=[16, 64])
    parser.add_argument("--engines", type=_list(str), default=list(ENGINES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the same prefill budget on every engine (default 2048)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more reference server, started with FLAGS on top (e.g. sliced='--attention-backend "
                             "sliced'); repeatable: a change measured side by side with what it changes")
    parser.add_argument("--knob", action="append", default=[], metavar="ENGINE:KEY=VALUE",
                        help="a knob of one engine (or variant) set apart from the others' "
                             "(e.g. ref512:max_num_batched_tokens=512: the reference engine's own default "
                             "budget); repeatable")
    parser.add_argument("--metrics-interval", type=float, default=0.1,
                        help="seconds between each server's /metrics samples during a run (0: none; default 0.1)")
    parser.add_argument("--cool-down", type=float, default=COOL_DOWN_S,
                        help=f"seconds of quiet before each timed job (default {COOL_DOWN_S:g}: longer than the 1 s "
                             "vLLM's scheduler and worker spin after their last step, on the cores the next engine "
                             "uses)")
    parser.add_argument("--threads", choices=("default", "matched"), default="default")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", default=None, help="write the figures and thread settings here")
    parser.add_argument("--report", default=None, metavar="JSON", help="only print the table of an earlier --json")
    args = parser.parse_args(argv)
    try:
        args.variant = dict(v.split("=", 1) for v in args.variant)
    except ValueError:
        parser.error(f"--variant: expected NAME=FLAGS, got {args.variant}")
    args.knob = parse_knob_overrides(parser, args.knob)
    if unknown := sorted(set(args.knob) - set(args.engines) - set(args.variant)):
        parser.error(f"--knob: no engine or variant named {', '.join(map(repr, unknown))} in this run "
                     f"(engines: {', '.join(args.engines)}; variants: {', '.join(args.variant) or 'none'})")
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    if args.quick:
        args.models, args.dtypes, args.concurrency, args.rounds = ["tiny-hd32"], ["float32"], [64], 2
    result = measure(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
