"""Minimal reproductions of what kvbench's conformance suite found in transformers' continuous
batching (``hf-cb``), using transformers directly (no kvbench code), on the built-in tiny model.

    python scripts/findings/hf_cb_repro.py

1. a request that needs more KV blocks than the whole cache is not refused up front: it is
   admitted, soft-reset while others run, and once alone the loop raises "No requests can be
   scheduled and no requests can be offloaded." (``_handle_critical_error`` then fails every request
   still in flight and the manager accepts no more: here the others happen to have finished);
2. a prompt longer than ``max_position_embeddings`` is accepted and generated without a word (not an
   expected failure: the engine has no per-request length limit at all, a missing prerequisite, so
   the over-long-prompt check skips on hf-cb saying so; this case shows the adapter's claim is true);
3. with block sharing (prefix caching) on, a soft-reset victim re-hits only blocks that another
   request still holds (the shared prefix, below); its own blocks are freed with ``no_cache=True``
   (offloading_manager.py, ``offload_requests``) after every cached block was evicted, so a victim
   with a prompt of its own recomputes everything on resume (reference_engine keeps them cached:
   conformance check 3b passes there and fails on hf-cb with prefix_cache_hits=0).
"""

from __future__ import annotations

import logging

import torch
from transformers import GenerationConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvbench.models.builtin import builtin_checkpoint


def run(model, prompts, max_new_tokens, **cb):
    """Greedy, EOS ignored; ``max_new_tokens`` is one number or one per prompt."""
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, **cb))
    manager.start()
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    for i, (p, n) in enumerate(zip(prompts, budgets, strict=True)):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
    results = {}
    while len(results) < len(prompts):
        out = manager.get_result(timeout=30)
        if out is None:
            break
        results[out.request_id] = out
    manager.stop(block=True, timeout=30)
    return results


def main() -> None:
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.INFO)
    ckpt = builtin_checkpoint("tiny")
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, use_safetensors=True).eval()
    small = [[5 + i] * 20 for i in range(3)]

    print("1. three 20-token requests (40 new tokens each) and one 120-token request, cache of 6 blocks x 16:")
    res = run(model, [*small, [9] * 120], [40, 40, 40, 8], num_blocks=6)
    for rid, out in sorted(res.items()):
        print(f"   {rid}: status={out.status} error={out.error!r} tokens={len(out.generated_tokens)}")

    print("2. a 1100-token prompt on a model with max_position_embeddings =",
          model.config.max_position_embeddings)
    res = run(model, [[7] * 1100], 4, num_blocks=128)
    out = res["r0"]
    print(f"   status={out.status} error={out.error!r} tokens={len(out.generated_tokens)}")

    print("3. block sharing on, 4 requests sharing a 64-token prefix in a 9-block cache "
          "(victims re-hit only the shared 64-token prefix):")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.DEBUG)
    logging.basicConfig(level=logging.WARNING, format="   %(levelname)s %(message)s")
    prefix = list(range(10, 74))
    res = run(model, [prefix + [100 + i] * 8 for i in range(4)], 40, num_blocks=9, allow_block_sharing=True)
    print("   finished:", sorted((rid, len(o.generated_tokens)) for rid, o in res.items()))


if __name__ == "__main__":
    main()
