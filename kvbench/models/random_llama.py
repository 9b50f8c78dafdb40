"""Seeded random Llama checkpoints in Hugging Face format, for tests and the default benchmarks.

``write_checkpoint(out_dir, preset="tiny", seed=0)`` writes ``config.json`` and ``model.safetensors``
(float32, safetensors only: never pickle) that ``transformers.LlamaForCausalLM.from_pretrained(out_dir)``
loads with no missing or unexpected keys, and a word-level tokenizer (``reference_engine.tokenizer``)
that ``transformers.AutoTokenizer`` and ``tokenizers.Tokenizer.from_file`` load. The same (preset,
seed, overrides) always gives byte-identical files on a given torch version: every tensor is drawn
from one explicitly seeded ``torch.Generator`` in a fixed order, and no global RNG is touched.

Why the weights are not Hugging Face's default init (std 0.02 everywhere): random weights give flat
logits, and greedy decoding then sits on near-ties that float32 noise (different kernels, batch shapes,
paged vs. contiguous attention) flips, so a correct engine would fail token-exact conformance. The init
here is chosen so that

* each residual branch (attention, MLP) adds an O(1) contribution: projections are variance preserving
  (std 1/sqrt(fan_in)), so the next token depends on the whole context and not only on the current
  token (which would make greedy output fall into short cycles and let KV-cache bugs go unnoticed);
* logits have a std of about ``LOGIT_STD``, so the top-1 minus top-2 margin is O(1) in the median, far
  above float32 noise (measure it with ``measure_margins`` or ``--measure-margins``);
* attention is sharp enough to be position-selective (``qk_gain`` in ``PRESETS``), so each KV entry
  matters and greedy output does not settle into loops;
* no token t is its own greedy successor after "t t ... t" (``_break_repeat_fixed_points``): random
  models otherwise tend to end up repeating one token forever;
* RMSNorm weights are not all ones, so a loader that ignores them (or uses Gemma's ``1 + w``) produces
  different tokens; the final norm's have random signs, which keeps tied-embedding models from
  favouring the current token;
* biases, where the config asks for them (Llama's ``attention_bias``: q, k, v and o projections;
  ``mlp_bias``: gate, up and down), are drawn at ``BIAS_SCALE`` of their projection's output: enough to
  move the logits by about one, so an engine that drops one, or a loader that skips them, produces
  different tokens, and not so much that constant terms take over the greedy output.

What real checkpoints vary, the presets cover: grouped-query attention (both presets have fewer KV heads
than query heads), attention and MLP biases (``tiny``, the suites' default, has both, so a default run
exercises an engine's bias path; ``small`` has none, as Llama), tied or untied embeddings (untied by
default; ``tie_word_embeddings=True``).
Every variant is a plain ``LlamaForCausalLM`` checkpoint, which transformers, vLLM and the reference
engine all read the same way: ``attention_bias`` puts a bias on q, k, v *and* o, ``mlp_bias`` on gate,
up and down.

Scaling the logits does not by itself beat float32 noise, which grows with them: what counts is the
margin against the measured noise. ``measure_margins`` reports both (float32 incremental decode vs. a
float64 forward); the built-in checkpoints' figures are in docs/journal/measurements.md#checkpoints. Any continuous
random model has some near-ties; expect roughly one position in 10^4..10^5 within noise of a tie.

Command line::

    python -m kvbench.models.random_llama OUT_DIR --preset tiny|small [--seed N] [--tie-word-embeddings]
        [--attention-bias|--no-attention-bias] [--mlp-bias|--no-mlp-bias]
    python -m kvbench.models.random_llama --measure-margins DIR [--num-prompts 16 ...] [--dtype bfloat16]

This module imports torch and safetensors only; ``measure_margins`` imports transformers lazily.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import statistics
import sys
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reference_engine.tokenizer import write_tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# Target std of the logits. The top-1/top-2 gap of n Gaussian logits is about
# LOGIT_STD / sqrt(2 ln n), i.e. ~2 for vocab 512: a median margin >= 1 with a p1 well above 1e-2.
# Not much larger on purpose: seeded-sampling tests need temperature-1 distributions that are not
# one-hot, or a sampler that ignores its seed would pass.
LOGIT_STD = 8.0
# A token t that greedy decoding follows with t after "t t ... t" is pushed this far below the best
# other token (see _break_repeat_fixed_points).
REPEAT_MARGIN = LOGIT_STD / 4
REPEAT_REPAIR_PASSES = 8
# RMSNorm weights are drawn uniformly from this range (see the module docstring for why not ones).
NORM_WEIGHT_RANGE = (0.75, 1.25)
# A bias's std, relative to the std of its projection's output (1, or qk_gain for q and k). Measured on
# tiny (seeds 0-2): dropping the q/k/v, the o or the MLP biases moves the logits by 0.8-1.6 on average
# and changes the argmax at 20-40% of positions, while greedy output stays as varied as without biases;
# at 0.15 and up the constant terms took over: runs of one token grew to 20-40 and fewer tokens were used.
BIAS_SCALE = 0.1

PRESETS: dict[str, dict[str, Any]] = {
    # For tests: a 32-request workload (prompts <= 300, outputs <= 100 tokens) runs in seconds on CPU.
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        # biases on every projection, so the default conformance run exercises an engine's bias path
        "attention_bias": True,
        "mlp_bias": True,
        "qk_gain": 2.0,
    },
    # For benchmarks: wide and deep enough that a batch-64 decode step is dominated by matmuls, not by
    # the engine's Python.
    "small": {
        "vocab_size": 4096,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "qk_gain": 1.5,
    },
}
# "qk_gain" is an init setting, not a shape (recorded under "kvbench_init" in config.json): q_proj and
# k_proj are scaled by it, giving attention scores of std ~qk_gain**2. Sharp enough that attention is
# position-selective (each KV entry matters, so KV-cache bugs change tokens, and greedy output does
# not drift into loops), not so sharp that softmax amplifies float32 noise. Measured float32-vs-float64
# max logit noise: tiny 1.6e-5 at gain 1 (but runs of one token up to 63 long), 7.8e-5 at 2; small
# 5e-5 at 1 (loops), 1.5e-4 at 1.5, 8.7e-4 at 2 (deeper nets amplify more, hence a lower gain).

# Keys a caller may override on top of a preset (``head_dim`` defaults to hidden_size // num_heads).
OVERRIDABLE_KEYS = (*PRESETS["tiny"].keys(), "head_dim")

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 0


def build_config(preset: str = "tiny", seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` dict for ``preset`` with ``overrides`` applied.

    Besides what transformers reads, it records how the weights were drawn under ``"kvbench_init"``
    (preset, seed, qk_gain, logit_std), so ``build_weights(config)`` regenerates them from the file
    alone. Raises ``ValueError`` naming the allowed values for an unknown preset or override key, and for
    head counts that GQA cannot use. rope_theta is written twice: as ``rope_parameters`` (where
    transformers v5 reads it) and as top-level ``rope_theta`` with ``rope_scaling: null`` (where v4 and
    most other loaders read it).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    unknown = sorted(set(overrides) - set(OVERRIDABLE_KEYS))
    if unknown:
        raise ValueError(f"unknown override(s) {unknown}: expected keys among {sorted(OVERRIDABLE_KEYS)}")
    shape = {**PRESETS[preset], **overrides}

    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"hidden_size={hidden} is not divisible by num_attention_heads={heads}: "
                "pass head_dim explicitly or pick a divisor"
            )
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}: "
            "GQA needs each KV head shared by a whole number of query heads"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} is odd: RoPE rotates pairs, so it must be even")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings"):
        if shape[key] < 1:
            raise ValueError(f"{key}={shape[key]} is invalid: expected a positive integer")
    if shape["vocab_size"] <= EOS_TOKEN_ID:
        raise ValueError(f"vocab_size={shape['vocab_size']} is invalid: expected > {EOS_TOKEN_ID}")

    rope_theta = float(shape["rope_theta"])
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid: expected a non-negative integer")
    qk_gain = float(shape["qk_gain"])
    if not qk_gain > 0:
        raise ValueError(f"qk_gain={qk_gain} is invalid: expected a positive float")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        if not isinstance(shape[key], bool):
            raise ValueError(f"{key}={shape[key]!r} is invalid: expected True or False")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": "float32",
        "torch_dtype": "float32",
        "vocab_size": shape["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape["max_position_embeddings"],
        "rms_norm_eps": float(shape["rms_norm_eps"]),
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": shape["attention_bias"],
        "attention_dropout": 0.0,
        "mlp_bias": shape["mlp_bias"],
        "tie_word_embeddings": shape["tie_word_embeddings"],
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "initializer_range": 0.02,  # unused (every tensor is in the file); present for HF's benefit
        "use_cache": True,
        "kvbench_init": {"preset": preset, "seed": seed, "qk_gain": qk_gain, "logit_std": LOGIT_STD},
    }


def build_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Random float32 tensors named as ``LlamaForCausalLM``'s state dict, for a ``build_config`` dict.

    Tensors are drawn in the order they are listed here from one ``torch.Generator`` seeded with
    ``config["kvbench_init"]["seed"]`` and then deterministically repaired
    (``_break_repeat_fixed_points``), so the result is a pure function of the config (on a given torch
    version). With tied embeddings there is no ``lm_head.weight``. Biases (``attention_bias``: q, k, v, o;
    ``mlp_bias``: gate, up, down) are drawn after every other tensor, so a checkpoint and its bias-free
    twin (same seed) share their weight matrices, but for the output rows the repair moves.
    """
    init = config["kvbench_init"]
    qk_gain, output_scale = init["qk_gain"], init["logit_std"] / math.sqrt(config["hidden_size"])
    gen = torch.Generator(device="cpu").manual_seed(init["seed"])
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        # Variance preserving: a unit-RMS input gives a unit-RMS output, so every branch matters.
        return torch.randn(out_features, in_features, generator=gen) * (gain / math.sqrt(in_features))

    def norm() -> torch.Tensor:
        low, high = NORM_WEIGHT_RANGE
        return low + (high - low) * torch.rand(hidden, generator=gen)

    # The final norm hands lm_head a unit-RMS vector, so rows of std LOGIT_STD / sqrt(hidden)
    # (output_scale) give logits of std ~LOGIT_STD. Tied models use the embedding as lm_head, hence the
    # same scale there; the first layer normalizes its input, so the scale does not matter there.
    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen) * output_scale,
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "self_attn.q_proj.weight"] = linear(q_dim, hidden, qk_gain)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_dim, hidden, qk_gain)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        weights[p + "post_attention_layernorm.weight"] = norm()
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    # Random signs on the final norm: with tied embeddings the residual stream still carries the
    # current token's embedding, and logit_t = e_t . norm(h) would favour repeating t in almost every
    # context; signed weights cancel that self-similarity on average (and catch loaders taking |w|).
    signs = torch.where(torch.rand(hidden, generator=gen) < 0.5, -1.0, 1.0)
    weights["model.norm.weight"] = norm() * signs
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = torch.randn(vocab, hidden, generator=gen) * output_scale

    def bias(size: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(size, generator=gen) * (BIAS_SCALE * gain)

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if config["attention_bias"]:  # Llama's attention_bias: all four projections (q and k at their gain)
            weights[p + "self_attn.q_proj.bias"] = bias(q_dim, qk_gain)
            weights[p + "self_attn.k_proj.bias"] = bias(kv_dim, qk_gain)
            weights[p + "self_attn.v_proj.bias"] = bias(kv_dim)
            weights[p + "self_attn.o_proj.bias"] = bias(hidden)
        if config["mlp_bias"]:
            weights[p + "mlp.gate_proj.bias"] = bias(inter)
            weights[p + "mlp.up_proj.bias"] = bias(inter)
            weights[p + "mlp.down_proj.bias"] = bias(hidden)
    weights = {name: t.to(torch.float32).contiguous() for name, t in weights.items()}
    _break_repeat_fixed_points(config, weights)
    return weights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def repeated_token_states(
    config: dict[str, Any], weights: dict[str, torch.Tensor], tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """lm_head's input after a context of one token repeated, per token in ``tokens`` (default: all).

    Returns ``[len(tokens), hidden]``.

    When every position holds the same token, every position's residual stream is the same, so each
    attention layer returns exactly that token's value (softmax weights sum to 1, whatever RoPE and
    the scores do) and the whole model collapses to a per-token MLP. Row t is therefore exact for any
    length of "t t t ... t", and if ``argmax(row t @ lm_head.T) == t``, greedy decoding, once it has
    repeated t for a while, repeats it forever.
    """
    eps = config["rms_norm_eps"]
    head_dim, kv_heads = config["head_dim"], config["num_key_value_heads"]
    group = config["num_attention_heads"] // kv_heads
    x = weights["model.embed_tokens.weight"]  # [vocab, hidden]: one row per repeated token
    if tokens is not None:
        x = x[tokens]

    def linear(name: str, inputs: torch.Tensor) -> torch.Tensor:
        out = inputs @ weights[name + ".weight"].T
        bias = weights.get(name + ".bias")  # present where the config asks for biases
        return out if bias is None else out + bias

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # q and k (and their biases) only move the softmax weights, which sum to 1 over equal values.
        v = linear(p + "self_attn.v_proj", _rms_norm(x, weights[p + "input_layernorm.weight"], eps))
        # GQA: query head h reads KV head h // group, as transformers' repeat_kv lays them out.
        v = v.view(-1, kv_heads, head_dim).repeat_interleave(group, dim=1).flatten(1)  # [vocab, q_dim]
        x = x + linear(p + "self_attn.o_proj", v)
        n = _rms_norm(x, weights[p + "post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(linear(p + "mlp.gate_proj", n))
        x = x + linear(p + "mlp.down_proj", gate * linear(p + "mlp.up_proj", n))
    return _rms_norm(x, weights["model.norm.weight"], eps)


def _output_matrix(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return weights["model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"]


def _break_repeat_fixed_points(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Edit output rows in place so that no token, once repeated, is its own greedy successor.

    A random model has about one such token (two in practice), and greedy decoding drifts into it
    and stays there: one token repeated forever makes a poor conformance workload. For each fixed
    point t we move output row t against the final hidden state of "t t ... t" (a rank-1 change to
    one row) until t sits ``REPEAT_MARGIN`` below the best other token. Untied, one pass is exact;
    tied, the row is also t's embedding and so moves its own hidden state, hence a few passes.
    """
    output = _output_matrix(config, weights)
    tokens = torch.arange(config["vocab_size"])
    with torch.no_grad():
        # The states are the costly part ("small": seconds). Row t depends on t's embedding only, so
        # only edited tokens' states change, and only when tied. Every row is rechecked each pass:
        # lowering t's logit can leave another token u on top of its own row.
        states = repeated_token_states(config, weights)  # [vocab, hidden]
        for _ in range(REPEAT_REPAIR_PASSES):
            logits = states @ output.T  # [vocab, vocab]: row t scores what follows "t t ... t"
            self_logit = logits[tokens, tokens]
            logits[tokens, tokens] = -math.inf
            best_other = logits.max(dim=-1).values
            # Flag at half the margin and push to the full one, so float rounding cannot make this loop.
            fixed = (self_logit > best_other - REPEAT_MARGIN / 2).nonzero().flatten()
            if len(fixed) == 0:
                return
            # Subtracting c * u from row t lowers t's logit against u by c * |u|^2, other rows untouched.
            u = states[fixed]
            excess = self_logit[fixed] - best_other[fixed] + REPEAT_MARGIN
            output[fixed] -= (excess / u.pow(2).sum(-1))[:, None] * u
            if config["tie_word_embeddings"]:
                states[fixed] = repeated_token_states(config, weights, fixed)
    raise RuntimeError(
        f"could not remove repeated-token fixed points in {REPEAT_REPAIR_PASSES} passes; try another seed"
    )


def write_checkpoint(
    out_dir: str | pathlib.Path, preset: str = "tiny", seed: int = 0, **overrides: Any
) -> pathlib.Path:
    """Write ``config.json``, ``model.safetensors`` and a tokenizer (``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``: see ``reference_engine.tokenizer``) for
    ``preset`` into ``out_dir``; return its path.

    ``overrides`` replace preset fields (e.g. ``tie_word_embeddings=True``, ``num_hidden_layers=1``); an
    unknown key or preset raises ``ValueError`` naming the allowed ones. ``out_dir`` is created if needed
    and the files are overwritten. Same arguments -> byte-identical files (same torch version).
    """
    config = build_config(preset, seed, **overrides)
    weights = build_weights(config)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # Metadata "format: pt" is what transformers expects of a torch-written safetensors file.
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    # A tokenizer (t<id> words) lets text prompts reach the model through the server; weights unchanged.
    write_tokenizer(out, config)
    return out


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list."""
    index = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[index]


def measure_margins(
    ckpt_dir: str | pathlib.Path, num_prompts: int = 16, prompt_len: int = 64, new_tokens: int = 64, seed: int = 0,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Greedy top-1 minus top-2 logit margins of a checkpoint under transformers' ``generate``.

    Runs ``num_prompts`` seeded random prompts of ``prompt_len`` tokens through greedy generation of
    exactly ``new_tokens`` tokens (EOS ignored, as the engines' ``ignore_eos``), and returns over all
    generated positions:

    * ``median``, ``p1``, ``min``: margins of the raw (unprocessed) float32 logits;
    * ``float32_noise``: max |logit difference| between that float32 incremental decode and a float64
      full forward over the same sequences: the scale of noise a correct engine may see, to compare
      with ``min``; ``argmax_flips``: generated positions where float64 would have picked another token;
    * ``distinct_tokens``: distinct generated tokens over all prompts, ``distinct_per_prompt_min`` and
      ``distinct_per_prompt_median``, and ``longest_repeat`` (longest run of one token repeated),
      to show greedy output has not collapsed into a single token;
    * ``engine_noise``, only with ``dtype``: the reference engine's logits in that dtype over the same
      sequences, in the situations the conformance checks compare, against each other, float32 and float64
      (:func:`kvbench.models.logit_noise.measure_engine_noise`).
    """
    from transformers import LlamaForCausalLM  # lazy: the checkpoint writer must not need it

    model = LlamaForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Ids above the special tokens, so no prompt contains BOS/EOS/PAD.
    prompts = torch.randint(EOS_TOKEN_ID + 1, vocab, (num_prompts, prompt_len), generator=gen)
    with torch.inference_mode():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN_ID,
            output_logits=True,
            return_dict_in_generate=True,
        )
        logits32 = torch.stack(out.logits, dim=1).float()  # [num_prompts, new_tokens, vocab]
        generated = out.sequences[:, prompt_len:]  # [num_prompts, new_tokens]
        # Logits at position t predict token t + 1: the generated tokens are predicted from
        # positions prompt_len - 1 ... prompt_len + new_tokens - 2.
        model64 = model.to(torch.float64)
        full64 = model64(out.sequences[:, :-1]).logits[:, prompt_len - 1 :]  # [num_prompts, new_tokens, vocab]

    top2 = logits32.topk(2, dim=-1).values
    margins = sorted((top2[..., 0] - top2[..., 1]).flatten().tolist())
    tokens = generated.tolist()
    engine_noise = None
    if dtype is not None:
        from kvbench.models.logit_noise import measure_engine_noise

        engine_noise = measure_engine_noise(str(ckpt_dir), out.sequences, prompt_len, dtype)
    longest_repeat = max(len(list(run)) for row in tokens for _, run in itertools.groupby(row))
    distinct_per_prompt = [len(set(row)) for row in tokens]
    return {
        "ckpt_dir": str(ckpt_dir),
        "num_positions": len(margins),
        "median": statistics.median(margins),
        "p1": _percentile(margins, 1),
        "min": margins[0],
        "float32_noise": (logits32.double() - full64).abs().max().item(),
        "argmax_flips": int((full64.argmax(-1) != generated).sum().item()),
        "distinct_tokens": len({t for row in tokens for t in row}),
        "distinct_per_prompt_min": min(distinct_per_prompt),
        "distinct_per_prompt_median": statistics.median(distinct_per_prompt),
        "longest_repeat": longest_repeat,
        **({"engine_noise": engine_noise} if engine_noise is not None else {}),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write a checkpoint, or measure a checkpoint's greedy margins."""
    parser = argparse.ArgumentParser(
        prog="python -m kvbench.models.random_llama",
        description="Write a seeded random Llama checkpoint (config.json + model.safetensors), "
        "or measure the greedy logit margins of one.",
    )
    parser.add_argument("out_dir", nargs="?", help="directory to write the checkpoint into")
    parser.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)} (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    parser.add_argument(
        "--tie-word-embeddings", action="store_true", help="share the embedding with lm_head (no lm_head.weight tensor)"
    )
    parser.add_argument(
        "--attention-bias", action=argparse.BooleanOptionalAction, default=None,
        help="biases on the q, k, v and o projections (default: the preset's; tiny has them, small not)",
    )
    parser.add_argument(
        "--mlp-bias", action=argparse.BooleanOptionalAction, default=None,
        help="biases on the gate, up and down projections (default: the preset's)",
    )
    parser.add_argument(
        "--measure-margins",
        metavar="DIR",
        help="measure greedy top-1/top-2 margins of the checkpoint in DIR (needs transformers)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="with --measure-margins: also measure the reference engine's logit noise in this dtype "
        "(kvbench.models.logit_noise)",
    )
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    if args.measure_margins is not None:
        if args.out_dir is not None:
            parser.error("give either OUT_DIR (to write) or --measure-margins DIR (to measure), not both")
        result = measure_margins(
            args.measure_margins,
            num_prompts=args.num_prompts,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            seed=args.seed,
            dtype=args.dtype,
        )
        print(json.dumps(result, indent=2))
        return 0
    if args.out_dir is None:
        parser.error("OUT_DIR is required (or use --measure-margins DIR)")
    if args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}: expected one of {sorted(PRESETS)}")

    overrides: dict[str, Any] = {"tie_word_embeddings": True} if args.tie_word_embeddings else {}
    overrides.update({key: value for key, value in (("attention_bias", args.attention_bias),
                                                    ("mlp_bias", args.mlp_bias)) if value is not None})
    out = write_checkpoint(args.out_dir, preset=args.preset, seed=args.seed, **overrides)
    config = json.loads((out / CONFIG_FILE).read_text())
    with safe_open(str(out / WEIGHTS_FILE), framework="pt") as f:
        num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    print(f"wrote {out / CONFIG_FILE}")
    print(
        f"wrote {out / WEIGHTS_FILE} ({(out / WEIGHTS_FILE).stat().st_size:,} bytes, {num_params:,} float32 parameters)"
    )
    print(
        f"preset={args.preset} seed={args.seed} vocab={config['vocab_size']} "
        f"hidden={config['hidden_size']} layers={config['num_hidden_layers']} "
        f"heads={config['num_attention_heads']} kv_heads={config['num_key_value_heads']} "
        f"intermediate={config['intermediate_size']} tied={config['tie_word_embeddings']} "
        f"attention_bias={config['attention_bias']} mlp_bias={config['mlp_bias']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
