"""Where vLLM's round-to-round spread on a 2-core CPU machine comes from: its front end on its worker's core.

vLLM's CPU server, left at its defaults (``VLLM_CPU_OMP_THREADS_BIND=auto``), binds its worker process
(``VLLM::Worker``, one OpenMP thread) to core 0 and reserves core 1 for the rest, but it does not bind the
rest: the API server and ``VLLM::EngineCore`` (the scheduler) float over both cores, so at times the
scheduler runs on the worker's core and the two take turns there. This script serves one closed-loop
workload (128 requests x 128 prompt + 64 output tokens, concurrency 16, tiny-hd32, float32) on one vLLM
server five times as vLLM starts, samples which core each of its threads runs on while it does, then
binds every thread of the front-end processes to core 1 (the core vLLM reserved for them) and serves it
five times more, and prints each round's throughput and the medians with their spread.

    bash scripts/peers.sh vllm && PYTHONPATH=$PWD python scripts/findings/vllm_front_end_cores.py

Seen here, two runs (docs/results.md, "Predicting real engines"): as started, 429-2,690 and 460-2,134
tok/s over five rounds (6.3x and 4.6x; medians 649 and 804), the engine core sampled on core 0 in most
rounds; with the front end bound to core 1, 997-1,359 and 700-1,185 tok/s (1.4x and 1.7x; medians 1,287
and 800). Binding narrows the spread; it does not make vLLM faster, and its fast rounds (2,100-2,700
tok/s, with the API server sampled on core 0) go with it. What vLLM's slow rounds wait on is not
settled (their TTFT p50 is 2.3-2.7 s against 0.05 s in the fast ones). Not filed upstream.
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
from kvbench.checkpoints import checkpoint_for
from kvbench.engines.base import Knobs
from kvbench.engines.http.placement import group_pids, thread_ids
from kvbench.engines.http.presets import VLLM_CPU_LAYOUT
from kvbench.engines.http.server import ServerAdapter

ROUNDS = 5
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
    adapter = ServerAdapter(str(ckpt), {"preset": "vllm", "args": "--dtype float32"}, name="vllm")
    try:
        serve(adapter, Job(_workload(model, 8, 8, 8, seed=1), KNOBS), "warm-up")
        pids = group_pids(adapter.process.pgid)
        print("vLLM's processes (pid, name, cores):", [(p, _name(p), sorted(os.sched_getaffinity(p))) for p in pids])
        for phase in ("as started", "front end bound to core 1"):
            if phase != "as started":
                for pid in pids:
                    if sorted(os.sched_getaffinity(pid)) != [0]:  # all but the worker, which vLLM bound
                        for tid in thread_ids(pid):
                            os.sched_setaffinity(tid, {1})
            rates = []
            for r in range(ROUNDS):
                seen: collections.Counter = collections.Counter()
                stop = threading.Event()
                sampler = threading.Thread(target=_sample_running, args=(pids, stop, seen))
                sampler.start()
                try:
                    m = metrics.summarize(serve(adapter, Job(_workload(model, 128, 64, 16), KNOBS), "front-end-cores"))
                finally:
                    stop.set()
                    sampler.join()
                rates.append(m["output_throughput"])
                print(f"  {phase}, round {r + 1}: {m['output_throughput']:,.0f} tok/s, TTFT p50 {m['ttft_p50']:.3f} s; "
                      f"threads seen running (process, core): {dict(seen.most_common(6))}", flush=True)
            print(f"{phase}: median {statistics.median(rates):,.0f} tok/s, rounds {min(rates):,.0f}-{max(rates):,.0f} "
                  f"({max(rates) / min(rates):.1f}x)", flush=True)
    finally:
        adapter.close()


if __name__ == "__main__":
    main()
