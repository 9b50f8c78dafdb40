"""Figures for the engine issues, each measured side by side in one run (not asserted anywhere):

1. a batch-64 decode step of the ``small`` preset: paged attention on the torch path (the oracle), on
   the sliced path (``attention_backend=sliced``) and in the compiled CPU kernel (``cpp``), vs the same
   model with a dense
   (contiguous, non-paged) KV cache; rounds interleaved, ratios taken round by round;
2. swap-out + swap-in of 1,000 blocks vs a plain torch copy of the same bytes;
3. recomputed tokens with and without prefix caching on the same overloaded workload;
4. ``reference`` in process (``LLMEngine.generate``) vs Hugging Face ``generate`` on one uniform batch
   (every prompt the same length, so HF needs no padding: the dense upper bound), greedy, rounds
   interleaved; the two outputs compared token by token.

    python scripts/measure_engine.py [--context 256] [--repeats 20] [--threads N] [--only 1,4]
        [--hf-model tiny] [--hf-batch 64] [--hf-prompt 128] [--hf-output 64] [--hf-rounds 5]

On a shared machine the times move by 2x between rounds; the ratios are taken within a round (the
variants run back to back, in rotating order) and printed as median [min-max] over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvbench.models.builtin import builtin_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.engine_counters import EngineCounters
from reference_engine.kv_cache import KVCache


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_seconds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each function once per round, the order rotating from round to round, after one warm-up
    each: ``{name: [seconds per round]}``, so that ratios can be taken within a round."""
    names = list(fns)
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def backends() -> list[str]:
    """The decode attention paths to compare: torch (the oracle, first), sliced, and cpp where it builds."""
    from reference_engine.cpu_attention import cpu_kernel_available

    return ["torch", "sliced"] + (["cpp"] if cpu_kernel_available() else [])


def ratio_text(a: list[float], b: list[float]) -> str:
    """Median [min-max] of the round-by-round ratios a/b."""
    ratios = sorted(x / y for x, y in zip(a, b, strict=True))
    return f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]"


@torch.inference_mode()
def paged_vs_dense(context: int, repeats: int, batch: int = 64) -> dict[str, list[float]]:
    """Seconds per round of one batch-``batch`` decode step at ``context`` tokens: ``paged BACKEND`` for each
    of :func:`backends` (the same step, input preparation included) and ``dense``."""
    ckpt = builtin_checkpoint("small")
    engine = LLMEngine(EngineConfig(model=str(ckpt), num_gpu_blocks_override=batch * (context // 16 + 2),
                                    max_num_seqs=batch))
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(3, 4000, (context,), generator=g).tolist(),
                           SamplingParams(max_tokens=1000, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    out = engine.scheduler.schedule()  # the decode step of all 64, without running it
    assert len(out.chunks) == batch and all(c.num_tokens == 1 for c in out.chunks)
    model, cache = engine.model, engine.kv_cache.device_cache

    def paged(backend: str):
        def run():
            engine.runner.attention_backend = backend
            ids, pos, meta, last = engine.runner.prepare(out.chunks)
            return model.compute_logits(model(ids, pos, cache, meta)[last])
        return run

    # Dense baseline: the same weights, K/V for each sequence in one contiguous [B, T, H, D] tensor.
    mc = model.config
    t = context + 1
    dense_k = [torch.randn(batch, t, mc.num_kv_heads, mc.head_dim) for _ in range(mc.num_layers)]
    dense_v = [torch.randn(batch, t, mc.num_kv_heads, mc.head_dim) for _ in range(mc.num_layers)]
    positions = torch.full((batch,), context, dtype=torch.long)
    tokens = torch.randint(3, 4000, (batch,), generator=g)

    def dense():
        x = model.model.embed_tokens(tokens)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            # the same fused q/k/v matmul and single RoPE call as the paged model: only the cache differs
            hq, hkv, d = mc.num_heads, mc.num_kv_heads, mc.head_dim
            qkv = attn.qkv(h)
            qk = attn.rope(qkv[:, : (hq + hkv) * d].view(batch, hq + hkv, d), positions)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(batch, hkv, d)
            dense_k[i][:, context] = k
            dense_v[i][:, context] = v
            o = F.scaled_dot_product_attention(q.unsqueeze(2), dense_k[i].transpose(1, 2),
                                               dense_v[i].transpose(1, 2), enable_gqa=True)
            x = x + attn.o_proj(o.reshape(batch, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        model.compute_logits(model.model.norm(x))

    torch_logits = paged("torch")()
    for backend in backends()[1:]:
        logits = paged(backend)()
        diff = (torch_logits - logits).abs().max().item()
        same = bool((torch_logits.argmax(-1) == logits.argmax(-1)).all())
        print(f"   {backend} vs torch logits: max |diff| {diff:.1e}, greedy tokens {'equal' if same else 'DIFFER'}")
    return interleaved_seconds({**{f"paged {b}": paged(b) for b in backends()}, "dense": dense}, repeats)


def reference_vs_hf(model_name: str, batch: int, prompt: int, output: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per round to generate ``output`` tokens for ``batch`` prompts of ``prompt`` tokens, greedy,
    EOS ignored: the reference engine in process (its pool holds the whole batch, ``max_num_seqs`` =
    batch), with each of :func:`backends` for its decode attention, vs transformers' ``generate`` on the
    same batch as one tensor. Prints whether their outputs agree."""
    from transformers import LlamaForCausalLM

    ckpt = str(builtin_checkpoint(model_name))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (batch, prompt), generator=g)
    blocks = batch * ((prompt + output) // 16 + 2)
    engines = {backend: LLMEngine(EngineConfig(model=ckpt, num_gpu_blocks_override=blocks, max_num_seqs=batch,
                                               max_num_batched_tokens=max(batch * prompt, 2048),
                                               attention_backend=backend))
               for backend in backends()}
    hf = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, use_safetensors=True).eval()
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}

    def reference(backend: str):
        def run():
            outputs[backend] = [o.token_ids for o in engines[backend].generate(prompts.tolist(), params)]
        return run

    @torch.inference_mode()
    def transformers_generate():
        seqs = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=output,
                           min_new_tokens=output, do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs["hf"] = seqs[:, prompt:].tolist()

    times = interleaved_seconds({**{f"reference {b}": reference(b) for b in backends()},
                                 "hf generate": transformers_generate}, rounds)
    for backend in backends():
        agree = sum(a == b for a, b in zip(outputs[backend], outputs["hf"], strict=True))
        print(f"   reference ({backend}) outputs token-equal to hf for {agree}/{batch} prompts")
    return times


def swap_vs_copy(repeats: int, num_blocks: int = 1000) -> tuple[float, float, int]:
    # The small preset's block: 8 layers x K,V x 16 tokens x 4 heads x 64 dims x fp32 = 256 KiB.
    kv = KVCache(num_blocks + 8, num_blocks + 8, 8, 16, 4, 64, torch.float32, torch.device("cpu"))
    kv.device_cache.normal_()
    out_map = [(i, i) for i in range(num_blocks)]
    in_map = [(i, i) for i in range(num_blocks)]
    plain_src = torch.randn(num_blocks, *kv.block_shape)
    plain_dst = torch.empty_like(plain_src)

    def swap():
        kv.swap_out(out_map)
        kv.swap_in(in_map)

    def plain():
        plain_dst.copy_(plain_src)
        plain_src.copy_(plain_dst)

    return _median_seconds(swap, repeats), _median_seconds(plain, repeats), num_blocks * kv.block_bytes


def recompute_saved_by_prefix_caching() -> dict[bool, EngineCounters]:
    ckpt = builtin_checkpoint("tiny")
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, 301, (32,), generator=g)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in torch.randint(1, 101, (32,), generator=g)]
    counters = {}
    for caching in (False, True):
        engine = LLMEngine(EngineConfig(model=str(ckpt), num_gpu_blocks_override=40, enable_prefix_caching=caching))
        engine.generate(prompts, params)
        counters[caching] = engine.counters()
    return counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--only", default="1,2,3,4", help="which figures, e.g. 1,4")
    parser.add_argument("--hf-model", default="tiny", help="built-in checkpoint for figure 4 (tiny or small)")
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--hf-prompt", type=int, default=128)
    parser.add_argument("--hf-output", type=int, default=64)
    parser.add_argument("--hf-rounds", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    only = {int(x) for x in args.only.split(",")}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if 1 in only:
        t = paged_vs_dense(args.context, args.repeats)
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        dense = t["dense"]
        print(f"1. batch-64 decode step, small preset, context {args.context}, {args.repeats} rounds (median ms): "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items()) + "; per round: "
              + ", ".join(f"{b}/dense {ratio_text(t[f'paged {b}'], dense)}" for b in backends()))
    if 2 in only:
        swap, plain, nbytes = swap_vs_copy(args.repeats)
        print(f"2. 1,000 blocks ({nbytes / 2**20:.0f} MiB) out and back: swap {2 * nbytes / swap / 2**30:.2f} GiB/s, "
              f"plain torch copy {2 * nbytes / plain / 2**30:.2f} GiB/s, ratio {plain / swap:.2f}")
    if 3 in only:
        s = recompute_saved_by_prefix_caching()
        print(f"3. overloaded workload (32 requests, 40 blocks): recomputed tokens without caching "
              f"{s[False].recomputed_tokens}, with caching {s[True].recomputed_tokens}; computed "
              f"tokens {s[False].computed_tokens} vs {s[True].computed_tokens}; "
              f"preemptions {s[False].preemptions} vs {s[True].preemptions}")
    if 4 in only:
        t = reference_vs_hf(args.hf_model, args.hf_batch, args.hf_prompt, args.hf_output, args.hf_rounds)
        tokens = args.hf_batch * args.hf_output
        tps = {k: tokens / statistics.median(v) for k, v in t.items()}
        hf = t["hf generate"]
        print(f"4. {args.hf_model}, {args.hf_batch} x {args.hf_prompt} prompt + {args.hf_output} output, "
              f"{args.hf_rounds} rounds (median tok/s): " + ", ".join(f"{k} {v:,.0f}" for k, v in tps.items())
              + "; throughput ratio per round: "
              + ", ".join(f"reference {b}/hf {ratio_text(hf, t[f'reference {b}'])}" for b in backends()))


if __name__ == "__main__":
    main()
