"""Figures for the engine issues, each measured side by side in one run (not asserted anywhere):

1. a batch-64 decode step of the ``small`` preset, paged attention vs the same model with a dense
   (contiguous, non-paged) KV cache;
2. swap-out + swap-in of 1,000 blocks vs a plain torch copy of the same bytes;
3. recomputed tokens with and without prefix caching on the same overloaded workload.

    python scripts/measure_engine.py [--context 256] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvbench.checkpoints import builtin_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.kv_cache import KVCache


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def paged_vs_dense(context: int, repeats: int, batch: int = 64) -> tuple[float, float]:
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

    def paged():
        ids, pos, meta, last = engine.runner.prepare(out.chunks)
        model.compute_logits(model(ids, pos, cache, meta)[last])

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

    return _median_seconds(paged, repeats), _median_seconds(dense, repeats)


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


def recompute_saved_by_prefix_caching() -> dict[bool, dict]:
    ckpt = builtin_checkpoint("tiny")
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, 301, (32,), generator=g)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in torch.randint(1, 101, (32,), generator=g)]
    stats = {}
    for caching in (False, True):
        engine = LLMEngine(EngineConfig(model=str(ckpt), num_gpu_blocks_override=40, enable_prefix_caching=caching))
        engine.generate(prompts, params)
        stats[caching] = engine.stats()
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    paged, dense = paged_vs_dense(args.context, args.repeats)
    print(f"1. batch-64 decode step, small preset, context {args.context}: paged {paged * 1e3:.1f} ms, "
          f"dense {dense * 1e3:.1f} ms, paged/dense = {paged / dense:.2f}x")
    swap, plain, nbytes = swap_vs_copy(args.repeats)
    print(f"2. 1,000 blocks ({nbytes / 2**20:.0f} MiB) out and back: swap {2 * nbytes / swap / 2**30:.2f} GiB/s, "
          f"plain torch copy {2 * nbytes / plain / 2**30:.2f} GiB/s, ratio {plain / swap:.2f}")
    s = recompute_saved_by_prefix_caching()
    print(f"3. overloaded workload (32 requests, 40 blocks): recomputed tokens without caching "
          f"{s[False]['num_recomputed_tokens']}, with caching {s[True]['num_recomputed_tokens']}; computed tokens "
          f"{s[False]['num_computed_tokens']} vs {s[True]['num_computed_tokens']}; "
          f"preemptions {s[False]['num_preemptions']} vs {s[True]['num_preemptions']}")


if __name__ == "__main__":
    main()
