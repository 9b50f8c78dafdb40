"""``kvbench demo``: a burst of requests on the tiny model under memory pressure, once per
preemption mode, printing what was preempted and what it cost. A quick look at the mechanisms the
suites check and measure; nothing is written to disk but the cached checkpoint.

torch runs with the benchmarks' thread policy (:mod:`kvbench.bench.threads`, printed first): with
torch's default of 2 threads on a shared 2-core machine the two modes' wall times differed 9x for
reasons that had nothing to do with preemption.
"""

from __future__ import annotations

import time
from typing import TextIO

MODES = ("recompute", "swap")


def run_demo(out: TextIO, num_requests: int = 32, num_gpu_blocks: int = 48, seed: int = 0) -> int:
    """Run the demo, printing to ``out``; returns 0 when both modes gave the same outputs, else 1."""
    from kvbench.bench.threads import describe, pinned_torch_threads

    with pinned_torch_threads("quick") as threads:
        print(describe(threads), file=out)
        return _run(out, num_requests, num_gpu_blocks, seed)


def _run(out: TextIO, num_requests: int, num_gpu_blocks: int, seed: int) -> int:
    import torch

    from kvbench.models.builtin import builtin_checkpoint
    from reference_engine import EngineConfig, LLMEngine, SamplingParams

    ckpt = builtin_checkpoint("tiny")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 300, (num_requests,), generator=g)]
    lengths = [int(n) for n in torch.randint(16, 100, (num_requests,), generator=g)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    need = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, lengths, strict=True))
    print(f"kvbench demo: {num_requests} requests arrive at once on the tiny model ({ckpt}).", file=out)
    print(f"They would need {need} KV blocks of 16 tokens together; the pool has {num_gpu_blocks}.\n", file=out)
    outputs_by_mode = {}
    for mode in MODES:
        engine = LLMEngine(EngineConfig(model=str(ckpt), num_gpu_blocks_override=num_gpu_blocks,
                                        num_cpu_blocks_override=512, preemption_mode=mode))
        t0 = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        outputs_by_mode[mode] = [o.token_ids for o in outputs]
        c = engine.counters()
        preempted = sorted(((o.num_preemptions, i) for i, o in enumerate(outputs) if o.num_preemptions),
                           reverse=True)
        print(f"== preemption_mode={mode}", file=out)
        print(f"   wall time {seconds:.2f} s, {c.generated_tokens / seconds:.0f} output tokens/s, "
              f"{c.steps} steps", file=out)
        print(f"   preemptions: {c.preemptions} ({c.preemptions_recompute} recompute, "
              f"{c.preemptions_swap} swap), {len(preempted)} of {num_requests} requests preempted, "
              f"most often {preempted[0][0] if preempted else 0}x", file=out)
        print(f"   recomputed tokens: {c.recomputed_tokens} of {c.computed_tokens} computed "
              f"({c.recomputed_tokens / max(c.computed_tokens, 1):.0%})", file=out)
        print(f"   swapped: {c.swapped_out_bytes / 2**20:.1f} MiB out, {c.swapped_in_bytes / 2**20:.1f} MiB in, "
              f"{c.swap_seconds * 1e3:.1f} ms copying", file=out)
        print("   most preempted: " + ", ".join(f"request {i} ({n}x)" for n, i in preempted[:5]) + "\n", file=out)
    same = outputs_by_mode["recompute"] == outputs_by_mode["swap"]
    print(f"Outputs identical in both modes: {same}. Next: `pytest suites/` (conformance) and "
          "`pytest suites/benchmarks --benchmark` (storms and the HTML report).", file=out)
    return 0 if same else 1
