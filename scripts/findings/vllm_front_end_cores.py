"""Where vLLM's round-to-round spread on a 2-core CPU machine comes from: its scheduler, which spins.

vLLM's CPU server, left at its defaults (``VLLM_CPU_OMP_THREADS_BIND=auto``), binds its worker process
(``VLLM::Worker``, one OpenMP thread) to core 0 and reserves core 1 for "the scheduler proc", but binds
nothing there: the API server and ``VLLM::EngineCore`` (the scheduler) float over both cores. The
scheduler does not sleep while its worker computes: it spins on ``sched_yield`` (``SpinCondition.wait``,
``busy_loop_s`` 1 s, ``vllm/distributed/device_communicators/shm_broadcast.py``; "TODO: make scheduler
proc sleep when idle" in ``vllm/utils/ompmultiprocessing.py``). Where the OS puts it on the API server's
core, the API server is held off the CPU and a stream's tokens reach the client in lumps (192 tokens in
one chunk), throughput falling to ~640 tok/s.

This script serves one closed-loop workload (128 requests x 128 prompt + 64 output tokens, concurrency
16, tiny-hd32, float32; kvbench's /metrics sampler off, ``metrics_interval=0``, so that only placement
differs) five times on each of three fresh vLLM servers:

1. as started (``helper_cores=free``);
2. every process but the worker bound to core 1, the core vLLM reserves (what a first look tried);
3. the scheduler bound to the worker's core 0 (``helper_cores=engine``), the API server left free.

and prints each round's throughput and tokens per chunk, the median and spread, and which core each
process was sampled running on.

    bash scripts/peers.sh vllm && PYTHONPATH=$PWD python scripts/findings/vllm_front_end_cores.py

Seen here (docs/journal/simulator.md, "2026-12-03, late"): the figures of the last run are in
docs/journal/measurements.md#predicting-real-engines. Not filed upstream.
"""

from __future__ import annotations

import collections
import os
import statistics
import threading
import time

import torch

from kvbench.bench import metrics
from kvbench.bench.scenarios.common import Job, Model, build_workload, serve
from kvbench.bench.workloads import ClosedLoop, Fixed, WorkloadSpec
from kvbench.engines.base import Knobs
from kvbench.engines.http.presets import VLLM_CPU_LAYOUT
from kvbench.engines.http.server import ServerAdapter
from kvbench.launch.placement import group_pids, thread_ids
from kvbench.models.builtin import checkpoint_for
from kvbench.sim.front_end import tokens_per_chunk

ROUNDS = 5
PHASES = ("as started", "all but the worker bound to core 1", "the scheduler bound to the worker's core")
KNOBS = Knobs(block_size=32, num_gpu_blocks=64 * 6 + 8, max_num_seqs=64, max_model_len=192, max_num_batched_tokens=2048)


def _workload(model: Model, n: int, output: int, concurrency: int, seed: int = 21):
    return build_workload(WorkloadSpec("front-end-cores", n, Fixed(128), Fixed(output), ClosedLoop(concurrency),
                                       seed=seed), model)


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _sample_running(pids: list[int], stop: threading.Event, seen: collections.Counter) -> None:
    """Count (process name, core) for every thread of ``pids`` found running, every 2 ms, until ``stop``."""
    while not stop.is_set():
        for pid in pids:
            for tid in thread_ids(pid):
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if fields[0] == "R":
                    seen[(_name(pid), int(fields[36]))] += 1  # field 39 of stat: the CPU it last ran on
        time.sleep(0.002)


def main() -> None:
    torch.set_num_threads(1)
    ckpt = checkpoint_for([VLLM_CPU_LAYOUT], "tiny")  # the tiny preset at the smallest head size vLLM takes
    model = Model.from_dir(ckpt, "tiny-hd32")
    for phase in PHASES:
        _phase(phase, ckpt, model)


def _phase(phase: str, ckpt, model: Model) -> None:
    helpers = "engine" if phase == PHASES[2] else "free"
    adapter = ServerAdapter(str(ckpt), {"preset": "vllm", "args": "--dtype float32", "helper_cores": helpers,
                                        "metrics_interval": "0"}, name="vllm")
    try:
        serve(adapter, Job(_workload(model, 8, 8, 8, seed=1), KNOBS), "warm-up")
        pids = group_pids(adapter.process.pgid)
        if phase == PHASES[1]:
            for pid in pids:
                if sorted(os.sched_getaffinity(pid)) != [0]:  # all but the worker, which vLLM bound
                    for tid in thread_ids(pid):
                        os.sched_setaffinity(tid, {1})
        print(f"{phase}: vLLM's processes (pid, name, cores):",
              [(p, _name(p), sorted(os.sched_getaffinity(p))) for p in pids], flush=True)
        rates = []
        for r in range(ROUNDS):
            seen: collections.Counter = collections.Counter()
            stop = threading.Event()
            sampler = threading.Thread(target=_sample_running, args=(pids, stop, seen))
            sampler.start()
            try:
                trace = serve(adapter, Job(_workload(model, 128, 64, 16), KNOBS), "front-end-cores")
                m = metrics.summarize(trace)
            finally:
                stop.set()
                sampler.join()
            rates.append(m["output_throughput"])
            per_chunk = tokens_per_chunk([q.token_times for q in trace.requests.values()])
            print(f"  {phase}, round {r + 1}: {m['output_throughput']:,.0f} tok/s, TTFT p50 {m['ttft_p50']:.3f} s, "
                  f"{per_chunk:.2f} tokens per chunk; "
                  f"threads seen running (process, core): {dict(seen.most_common(6))}", flush=True)
        print(f"{phase}: median {statistics.median(rates):,.0f} tok/s, rounds {min(rates):,.0f}-{max(rates):,.0f} "
              f"({max(rates) / min(rates):.1f}x)", flush=True)
    finally:
        adapter.close()


if __name__ == "__main__":
    main()
