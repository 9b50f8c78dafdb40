"""Measurements of reference_engine's CUDA paths, for a lent GPU machine (run by scripts/gpu_check.sh).

    python scripts/gpu_measure.py --out DIR            # on a CUDA machine: ~1B bf16 model, < 8 minutes
    python scripts/gpu_measure.py --out DIR --dry-run  # the same steps on CPU, tiny sizes (tests use it)

What it measures, and how:

1. **HBM bandwidth**: a device-to-device copy of ``--copy-mib`` MiB, timed over repeats; bandwidth
   counts the bytes read plus the bytes written (how the device's datasheet figure is usually matched).
2. **Decode step vs the HBM roofline**: a random Llama checkpoint (``--model 1b``: Llama-3.2-1B's shape
   with a 32k vocabulary, bf16) is written with ``kvbench.models.random_llama.build_config`` and seeded
   random weights (the generator's margin repair is skipped: it runs the whole vocabulary through the
   model on CPU, far too slow at this size, and timing does not need greedy margins). For each batch
   size B, B requests with ``--context`` prompt tokens are prefilled, then ``--decode-steps`` decode
   steps are timed one by one (``engine.step()``, which ends with the sampled tokens on the host, so
   each step is synchronous). The roofline is the bytes a step must read, weights (every matrix and
   norm; the embedding table only for its B rows, so it is left out) plus the KV cache of every
   sequence (layers x 2 x kv_heads x head_dim x dtype bytes per token), over the measured bandwidth.
   ``efficiency = roofline seconds / measured seconds`` (1.0 = at the memory-bandwidth bound).
3. **Triton decode kernel vs the torch path**: the same decode steps with ``attention_backend`` set to
   ``triton`` and to ``torch`` on identical engines and requests; ratio = torch time / triton time.
4. **Swap copies vs a plain pinned copy**: ``KVCache.swap_out``/``swap_in`` of ``--swap-blocks``
   scattered blocks against one ``copy_`` of the same bytes between a pinned host tensor and the
   device (the bound a swap could reach); ratio = swap seconds / plain seconds.
5. **One storm on the GPU**: the preemption storm (kvbench's ``quick`` scale, tiny model) on the
   reference engine on this device, recorded and judged as in ``pytest suites/benchmarks``
   (``--dry-run``: cut to 6 requests at concurrency 2 and 8).

Everything lands in ``OUT/results.json`` (kvbench's results schema: one scenario per measurement, so
``kvbench report``/``compare`` read it), ``OUT/report.html``, and ``OUT/gpu_measure.json`` (raw
figures). Nothing here asserts a time: the script fails only if something does not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: model shapes (overrides of kvbench.models.random_llama's "small" preset); "1b" ~ Llama-3.2-1B with a
#: 32k vocabulary: 16 layers, hidden 2048, GQA 32/8 heads of 64, MLP 8192 -> 1.10e9 parameters
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024},
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
BLOCK_SIZE = 16
MIB = 2**20


# --------------------------------------------------------------------------------------------
# arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_measure.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"), help="output folder (default: $OUT)")
    p.add_argument("--dry-run", action="store_true", help="run every step on CPU at tiny sizes (no GPU needed)")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --dry-run")
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default=None, help="default: 1b, or tiny with --dry-run")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="default: bfloat16, or float32 with --dry-run")
    p.add_argument("--batches", type=_int_list, default=None, help="decode batch sizes (default 1,16,64; dry: 1,4)")
    p.add_argument("--context", type=_positive(int), default=None, help="prompt tokens per request (1024; dry: 48)")
    p.add_argument("--decode-steps", type=_positive(int), default=None, help="timed decode steps (20; dry: 3)")
    p.add_argument("--copy-mib", type=_positive(int), default=None, help="bandwidth copy size (2048; dry: 16)")
    p.add_argument("--swap-blocks", type=_positive(int), default=None, help="blocks per swap copy (512; dry: 16)")
    p.add_argument("--no-storm", action="store_true", help="skip the storm scenario")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and fill the defaults that depend on --dry-run."""
    args = build_parser().parse_args(argv)
    full = {"device": "cuda", "model": "1b", "dtype": "bfloat16", "batches": [1, 16, 64], "context": 1024,
            "decode_steps": 20, "copy_mib": 2048, "swap_blocks": 512}
    dry = {"device": "cpu", "model": "tiny", "dtype": "float32", "batches": [1, 4], "context": 48,
           "decode_steps": 3, "copy_mib": 16, "swap_blocks": 16}
    for key, value in (dry if args.dry_run else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.context + args.decode_steps + 8 > MODEL_SHAPES[args.model]["max_position_embeddings"]:
        build_parser().error(f"--context {args.context} + --decode-steps {args.decode_steps} does not fit the "
                             f"{args.model} model's {MODEL_SHAPES[args.model]['max_position_embeddings']} positions")
    return args


# --------------------------------------------------------------------------------------------
# the roofline arithmetic


def head_dim(shape: dict[str, Any]) -> int:
    return int(shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"])


def parameter_count(shape: dict[str, Any], tied: bool = False) -> int:
    """Parameters of a Llama model of this shape (embedding and lm_head included)."""
    h, inter, layers, vocab = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], \
        shape["vocab_size"]
    q_dim, kv_dim = shape["num_attention_heads"] * head_dim(shape), shape["num_key_value_heads"] * head_dim(shape)
    per_layer = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * inter + 2 * h
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def weight_bytes_per_step(shape: dict[str, Any], dtype: str, tied: bool = False) -> int:
    """Weight bytes one decode step reads: every parameter except the embedding table (a decode reads
    only its batch's rows of it; with tied embeddings the table is lm_head and is read whole)."""
    params = parameter_count(shape, tied)
    if not tied:
        params -= shape["vocab_size"] * shape["hidden_size"]
    return params * DTYPE_BYTES[dtype]


def kv_bytes_per_token(shape: dict[str, Any], dtype: str) -> int:
    """KV bytes one token holds: layers x (K and V) x kv_heads x head_dim x dtype bytes."""
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim(shape) * DTYPE_BYTES[dtype]


def decode_step_bytes(shape: dict[str, Any], dtype: str, batch: int, context: int) -> int:
    """Bytes a decode step of ``batch`` sequences of ``context`` tokens (the new one included) reads."""
    return weight_bytes_per_step(shape, dtype) + batch * context * kv_bytes_per_token(shape, dtype)


def roofline_seconds(nbytes: int, bandwidth: float) -> float:
    """The memory-bandwidth bound: ``nbytes`` over ``bandwidth`` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    return nbytes / bandwidth


# --------------------------------------------------------------------------------------------
# measuring


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_s": statistics.median(ordered), "min_s": ordered[0], "max_s": ordered[-1], "n": len(ordered)}


def measure_bandwidth(device: str, mib: int) -> dict[str, Any]:
    """Device-to-device copy; bandwidth counts bytes read + bytes written."""
    import torch

    src = torch.empty(mib * MIB, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = _timed(lambda: dst.copy_(src), device, repeats=10)
    best = min(times)
    return {"bytes": src.numel(), **_summary(times), "bandwidth_bytes_s": 2 * src.numel() / best,
            "note": "2 x bytes / best time (read + write)"}


def write_random_checkpoint(out_dir: Path, model: str, dtype: str, seed: int = 0) -> Path:
    """config.json from kvbench.models.random_llama.build_config, seeded random weights (variance
    preserving, the generator's names), in ``dtype``; no margin repair (module docstring)."""
    import torch
    from safetensors.torch import save_file

    from kvbench.models.random_llama import build_config

    config = build_config("small", seed, **MODEL_SHAPES[model])
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    torch_dtype = getattr(torch, dtype)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(torch_dtype)

    weights = {"model.embed_tokens.weight": linear(vocab, h), "model.norm.weight": torch.ones(h, dtype=torch_dtype),
               "lm_head.weight": linear(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({p + "input_layernorm.weight": torch.ones(h, dtype=torch_dtype),
                        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch_dtype),
                        p + "self_attn.q_proj.weight": linear(q_dim, h),
                        p + "self_attn.k_proj.weight": linear(kv_dim, h),
                        p + "self_attn.v_proj.weight": linear(kv_dim, h),
                        p + "self_attn.o_proj.weight": linear(h, q_dim),
                        p + "mlp.gate_proj.weight": linear(inter, h), p + "mlp.up_proj.weight": linear(inter, h),
                        p + "mlp.down_proj.weight": linear(h, inter)})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def measure_decode(model_dir: Path, args: argparse.Namespace, backend: str, bandwidth: float) -> list[dict]:
    """Decode-step times per batch size on one engine with ``attention_backend=backend``."""
    import random

    from reference_engine import EngineConfig, LLMEngine, SamplingParams

    shape = MODEL_SHAPES[args.model]
    max_batch = max(args.batches)
    budget = max(4096, args.context)  # prefill tokens per step
    # Requests prefilled early decode while later ones prefill: room for those tokens too, so that no
    # request finishes (or runs out of blocks) inside the timed window.
    max_tokens = args.decode_steps + 2 + -(-max_batch * args.context // budget) + 2
    blocks = max_batch * -(-(args.context + max_tokens) // BLOCK_SIZE) + 8
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE,
                                    num_gpu_blocks_override=blocks, max_num_seqs=max_batch,
                                    max_num_batched_tokens=budget, attention_backend=backend))
    rng = random.Random(0)
    rows = []
    for batch in args.batches:
        ids = [f"{backend}-b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(3, shape["vocab_size"]) for _ in range(args.context)],
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for _ in range(max_tokens):  # prefill until every request decodes
            if engine.step().record.num_prefill_tokens == 0:
                break
        engine.step()  # one decode step as warm-up (kernel compilation, allocator)
        kv_tokens_before = sum(engine.scheduler.requests[rid].num_tokens for rid in ids)
        times = []
        for _ in range(args.decode_steps):
            t0 = time.perf_counter()
            record = engine.step().record
            times.append(time.perf_counter() - t0)
            assert record.num_decode_tokens == batch, record
        kv_tokens_after = sum(engine.scheduler.requests[rid].num_tokens for rid in ids)
        for rid in ids:
            engine.abort_request(rid)
        engine.step()
        # KV read per step: every sequence's tokens so far, averaged over the timed steps
        kv_tokens = (kv_tokens_before + kv_tokens_after) // 2
        nbytes = weight_bytes_per_step(shape, args.dtype) + kv_tokens * kv_bytes_per_token(shape, args.dtype)
        summary = _summary(times)
        roof = roofline_seconds(nbytes, bandwidth)
        rows.append({"backend": backend, "batch": batch, "context": args.context, **summary, "bytes_read": nbytes,
                     "mean_kv_tokens_per_seq": kv_tokens / batch, "roofline_s": roof,
                     "efficiency": roof / summary["median_s"], "tokens_per_s": batch / summary["median_s"]})
    del engine
    return rows


def measure_swap(args: argparse.Namespace) -> dict[str, Any]:
    """KVCache swap copies of scattered blocks vs one plain copy of the same bytes (pinned host on CUDA)."""
    import torch

    from reference_engine.kv_cache import KVCache

    shape = MODEL_SHAPES[args.model]
    n = args.swap_blocks
    cache = KVCache(2 * n, 2 * n, shape["num_hidden_layers"], BLOCK_SIZE, shape["num_key_value_heads"],
                    head_dim(shape), getattr(torch, args.dtype), torch.device(args.device))
    rng = torch.Generator().manual_seed(0)
    device_ids = torch.randperm(2 * n, generator=rng)[:n].tolist()
    host_ids = torch.randperm(2 * n, generator=rng)[:n].tolist()
    mapping_out = list(zip(device_ids, host_ids, strict=True))
    mapping_in = [(h, d) for d, h in mapping_out]
    nbytes = n * cache.block_bytes
    pinned = args.device != "cpu"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    figures = {"blocks": n, "block_bytes": cache.block_bytes, "bytes": nbytes, "pinned_host": pinned}
    for name, fn in (("swap_out", lambda: cache.swap_out(mapping_out)), ("swap_in", lambda: cache.swap_in(mapping_in)),
                     ("plain_d2h", lambda: host.copy_(dev, non_blocking=pinned)),
                     ("plain_h2d", lambda: dev.copy_(host, non_blocking=pinned))):
        s = _summary(_timed(fn, args.device, repeats=10))
        figures[name] = {**s, "bytes_per_s": nbytes / s["median_s"]}
    figures["swap_out_vs_plain"] = figures["swap_out"]["median_s"] / figures["plain_d2h"]["median_s"]
    figures["swap_in_vs_plain"] = figures["swap_in"]["median_s"] / figures["plain_h2d"]["median_s"]
    return figures


def run_storm(args: argparse.Namespace, results: Any) -> dict[str, Any]:
    """The preemption storm at quick scale on the reference engine on this device, recorded into results."""
    from kvbench.bench import scenarios as sc
    from kvbench.bench.scenarios.common import STEP_SECONDS
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from kvbench.models.builtin import builtin_checkpoint

    scenario = _dry_run_storm() if args.dry_run else sc.PREEMPTION_STORM
    model = sc.Model.from_dir(builtin_checkpoint("tiny"), "tiny")
    adapter = make_adapter(parse_engine_spec(f"reference:device={args.device}"), model.path)
    try:
        started = time.perf_counter()
        outcome = sc.run(scenario, adapter, model, "quick", None, repeats=1,
                         step_seconds=STEP_SECONDS["quick"])
        seconds = time.perf_counter() - started
        sc.record(outcome, results, adapter.describe())
    finally:
        adapter.close()
    return {"scenario": scenario.name, "seconds": seconds, "failures": outcome.failures()}


def _dry_run_storm() -> Any:
    """The preemption storm cut to 6 requests at concurrency 2 and 8 (a rehearsal takes seconds, not minutes)."""
    import dataclasses

    from kvbench.bench.scenarios.storms import PreemptionStorm, StormSize
    from kvbench.bench.workloads import Fixed, Uniform

    spec = dataclasses.replace(PreemptionStorm.sizes["quick"].spec, num_requests=6, input_len=Uniform(16, 48),
                               output_len=Fixed(24))
    small = StormSize(spec, concurrencies=(2, 8), num_gpu_blocks=12)

    class DryRunStorm(PreemptionStorm):
        sizes = {"quick": small, "full": small}  # noqa: RUF012

    return DryRunStorm()


# --------------------------------------------------------------------------------------------
# main


def _device_name(device: str) -> str:
    import torch

    if torch.device(device).type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_measure: CUDA is not available here; use --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    from kvbench.bench.results import Results
    from kvbench.report.render import write_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:  # one thread: on a shared CPU, OpenMP threads spinning against each other dominate tiny copies
        torch.set_num_threads(1)
    t_start = time.perf_counter()
    raw: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "device": _device_name(args.device),
                           "torch": torch.__version__}
    results = Results(device=raw["device"])
    params = {"scale": "gpu", "model": args.model, "dtype": args.dtype, "device": raw["device"]}

    def step(name: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {name}", flush=True)

    step("bandwidth")
    raw["bandwidth"] = bw = measure_bandwidth(args.device, args.copy_mib)
    results.add_scenario_result("gpu_bandwidth", "device", {"bandwidth_gb_s": bw["bandwidth_bytes_s"] / 1e9},
                                parameters={**params, "copy_mib": args.copy_mib}, notes=[bw["note"]])

    step(f"checkpoint ({args.model}, {args.dtype})")
    model_dir = write_random_checkpoint(out / "model", args.model, args.dtype)
    raw["parameters"] = parameter_count(MODEL_SHAPES[args.model])

    from reference_engine.triton_attention import triton_available

    backends = ["torch"] + (["triton"] if triton_available(args.device) else [])
    raw["decode"] = []
    for backend in backends:
        step(f"decode steps, attention_backend={backend}")
        raw["decode"] += measure_decode(model_dir, args, backend, bw["bandwidth_bytes_s"])
    if "triton" not in backends:
        raw["triton_skipped"] = f"triton cannot run on {args.device} in this process"
    for row in raw["decode"]:
        results.add_scenario_result("gpu_decode_roofline", f"reference[{row['backend']}]",
                                    {"step_s": row["median_s"], "roofline_s": row["roofline_s"],
                                     "efficiency": row["efficiency"], "tokens_per_s": row["tokens_per_s"]},
                                    mode=f"batch={row['batch']}", parameters={**params, "context": args.context})
    by_key = {(r["backend"], r["batch"]): r for r in raw["decode"]}
    raw["triton_vs_torch"] = {str(b): by_key[("torch", b)]["median_s"] / by_key[("triton", b)]["median_s"]
                              for b in args.batches if ("triton", b) in by_key}
    if raw["triton_vs_torch"]:
        results.add_scenario_result("gpu_triton_vs_torch", "reference",
                                    {f"speedup_batch_{b}": v for b, v in raw["triton_vs_torch"].items()},
                                    parameters=params, notes=["torch decode step time / triton decode step time"])
    shutil.rmtree(model_dir, ignore_errors=True)  # GBs at full size, and random: not worth keeping
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    step("swap copies vs a plain copy")
    raw["swap"] = sw = measure_swap(args)
    results.add_scenario_result("gpu_swap_copies", "reference",
                                {"swap_out_gb_s": sw["swap_out"]["bytes_per_s"] / 1e9,
                                 "swap_in_gb_s": sw["swap_in"]["bytes_per_s"] / 1e9,
                                 "plain_d2h_gb_s": sw["plain_d2h"]["bytes_per_s"] / 1e9,
                                 "plain_h2d_gb_s": sw["plain_h2d"]["bytes_per_s"] / 1e9,
                                 "swap_out_vs_plain": sw["swap_out_vs_plain"],
                                 "swap_in_vs_plain": sw["swap_in_vs_plain"]},
                                parameters={**params, "blocks": sw["blocks"], "pinned_host": sw["pinned_host"]})
    if not args.no_storm:
        step("preemption storm (quick scale, tiny model)")
        raw["storm"] = run_storm(args, results)
    raw["seconds"] = time.perf_counter() - t_start
    (out / "gpu_measure.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    report = write_report(results, out)
    step(f"done: {out / 'results.json'}, {report}, {out / 'gpu_measure.json'}")
    _print_summary(raw)
    return 0 if not (raw.get("storm") or {}).get("failures") else 1


def _print_summary(raw: dict[str, Any]) -> None:
    print(f"\n{raw['device']}, torch {raw['torch']}, {raw['parameters'] / 1e9:.2f}e9 parameters")
    print(f"HBM copy bandwidth: {raw['bandwidth']['bandwidth_bytes_s'] / 1e9:,.0f} GB/s")
    for r in raw["decode"]:
        print(f"decode {r['backend']:6s} batch {r['batch']:3d}: {1e3 * r['median_s']:8.2f} ms/step, roofline "
              f"{1e3 * r['roofline_s']:7.2f} ms, efficiency {100 * r['efficiency']:5.1f}%")
    for b, v in raw["triton_vs_torch"].items():
        print(f"triton vs torch, batch {b}: {v:.2f}x")
    if raw.get("triton_skipped"):
        print(f"triton: skipped ({raw['triton_skipped']})")
    sw = raw["swap"]
    gb = {k: sw[k]["bytes_per_s"] / 1e9 for k in ("swap_out", "swap_in", "plain_d2h", "plain_h2d")}
    print(f"swap out {gb['swap_out']:.1f} GB/s vs plain {gb['plain_d2h']:.1f}; "
          f"swap in {gb['swap_in']:.1f} GB/s vs plain {gb['plain_h2d']:.1f}")
    if raw.get("storm"):
        print(f"storm: {raw['storm']['scenario']} in {raw['storm']['seconds']:.1f} s, claims not shown: "
              f"{raw['storm']['failures'] or 'none'}")
    print(f"total {raw['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
