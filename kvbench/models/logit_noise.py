"""How far the reference engine's logits move between correct ways of computing them, in one dtype.

The conformance checks excuse a divergence from the ground truth only at a near-tie: a position where
the ground truth's top-1/top-2 logit margin is below a tolerance
(:mod:`kvbench.conformance.equivalence`). The tolerance has to sit above the noise between correct
computations and far below the margins the checkpoints give, so this module measures both, on
fixed token sequences (teacher-forced: every way of computing sees the same context), in the
situations the checks compare::

    decode, batched     prompts prefilled together, then one decode step per position for all
                        sequences at once through the paged KV cache (how the engine runs a batch)
    decode, alone       the same, one sequence at a time (batch of 1)
    recompute, batched  each whole sequence as one prefill chunk, all in one step (a recompute
                        after preemption: another kernel and another batch shape for the same rows)
    dense, batched      transformers' forward over the padded-free batch (contiguous attention)

each in the engine's dtype, and against the engine in float32 and transformers in float64.

Per position two figures: ``max_abs``, the largest |logit difference| over the vocabulary (what
float32's noise was first stated as), and ``gain``, the most any token gained on the other side's
top-1 token: a greedy pick can flip only where the margin is below it, so the near-tie tolerance is
a bound on ``gain``. Both are summarised as median, p99 and max over positions.

``python -m kvbench.models.random_llama --measure-margins DIR --dtype bfloat16`` runs it; the figures
and the tolerance chosen from them are in docs/checks.md.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

#: the engine's dtype option -> torch dtype
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    """Median, p99 and max of ``values``."""
    return {"median": statistics.median(values), "p99": _percentile(values, 99), "max": max(values)}


def differences(reference: torch.Tensor, other: torch.Tensor) -> dict[str, Any]:
    """``max_abs`` and ``gain`` (module docstring) of ``other`` against ``reference``, both ``[N, T, V]``,
    summarised over the N * T positions, with ``argmax_flips``: positions whose greedy pick differs."""
    reference, other = reference.double(), other.double()
    max_abs = (other - reference).abs().amax(-1)  # [N, T]
    top1 = reference.argmax(-1, keepdim=True)
    # how much each token's lead over the reference's top-1 grew; the top-1 itself gains 0
    gain = ((other - other.gather(-1, top1)) - (reference - reference.gather(-1, top1))).amax(-1)
    return {"max_abs": summary(max_abs.flatten().tolist()), "gain": summary(gain.flatten().tolist()),
            "argmax_flips": int((other.argmax(-1) != top1.squeeze(-1)).sum())}


class _EngineForward:
    """The engine's model runner driven directly over fixed sequences (no scheduler, no sampling):
    chunks are scheduled by hand and the logits of every row that predicts a generated token are kept."""

    def __init__(self, model_dir: str, dtype: str, sequences: torch.Tensor, attention_backend: str = "auto"):
        from reference_engine.config import EngineConfig
        from reference_engine.engine import load_parts

        block_size = 16
        config = EngineConfig(model=model_dir, dtype=dtype, block_size=block_size, attention_backend=attention_backend,
                              num_gpu_blocks_override=len(sequences) * math.ceil(sequences.shape[1] / block_size))
        self.parts = load_parts(config)
        self.attention_backend = self.parts.attention_backend

    def logits(self, sequences: torch.Tensor, prompt_len: int, mode: str, batched: bool) -> torch.Tensor:
        """``[N, T, V]`` float32 logits predicting ``sequences[:, prompt_len:]`` (T = that many tokens).
        ``mode``: ``decode`` (prefill the prompt, then one decode chunk per position) or ``recompute``
        (the whole sequence but its last token as one prefill chunk)."""
        rows = sequences.tolist()
        groups = [rows] if batched else [[r] for r in rows]
        out = []
        for group in groups:
            out.extend(self._run(group, prompt_len, mode))
        return torch.stack(out)

    def _run(self, rows: list[list[int]], prompt_len: int, mode: str) -> list[torch.Tensor]:
        from reference_engine.request import Request
        from reference_engine.sampling_params import SamplingParams
        from reference_engine.scheduler import ScheduledChunk

        runner, bm = self.parts.runner, self.parts.block_manager
        # The whole sequence is the "prompt", so a chunk at any position reads its token (teacher forcing).
        requests = [Request(f"seq{i}", row[:-1], SamplingParams(max_tokens=1), 0.0) for i, row in enumerate(rows)]
        for r in requests:
            if not bm.allocate_slots(r, r.num_prompt_tokens):
                raise RuntimeError("pool too small for the measurement")
        try:
            if mode == "recompute":
                steps = [[ScheduledChunk(r, 0, r.num_prompt_tokens, True) for r in requests]]
                first_row = prompt_len - 1  # of each chunk: the row that predicts the first generated token
            elif mode == "decode":
                steps = [[ScheduledChunk(r, 0, prompt_len, True) for r in requests]]
                positions = range(prompt_len, len(rows[0]) - 1)
                steps += [[ScheduledChunk(r, p, 1, True) for r in requests] for p in positions]
                first_row = prompt_len - 1
            else:
                raise ValueError(f"mode {mode!r}: expected 'decode' or 'recompute'")
            per_request: list[list[torch.Tensor]] = [[] for _ in requests]
            with torch.inference_mode():
                for step, chunks in enumerate(steps):
                    input_ids, positions, meta, _ = runner.prepare(chunks)
                    hidden = runner.model(input_ids, positions, runner.kv.device_cache, meta)
                    logits = runner.model.compute_logits(hidden)  # [num_tokens, V]: every row
                    start = 0
                    for i, c in enumerate(chunks):
                        keep = slice(start + first_row, start + c.num_tokens) if step == 0 else slice(start, start + 1)
                        per_request[i].append(logits[keep])
                        start += c.num_tokens
        finally:
            for r in requests:
                bm.free(r.request_id)
        return [torch.cat(parts) for parts in per_request]


def measure_engine_noise(model_dir: str, sequences: torch.Tensor, prompt_len: int, dtype: str = "bfloat16",
                         attention_backend: str = "auto") -> dict[str, Any]:
    """The noise figures of the module docstring for the reference engine in ``dtype`` over ``sequences``
    (``[N, prompt_len + T]`` token ids; logits predict the last T), against each other, the engine in float32
    and transformers in float64; and the margins (top-1 minus top-2) of each, as median, p1 and min."""
    from transformers import LlamaForCausalLM  # lazy: the engine must not need it

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    engine = _EngineForward(model_dir, dtype, sequences, attention_backend)
    runs = {
        "decode_batched": engine.logits(sequences, prompt_len, "decode", batched=True),
        "decode_alone": engine.logits(sequences, prompt_len, "decode", batched=False),
        "recompute_batched": engine.logits(sequences, prompt_len, "recompute", batched=True),
        "recompute_alone": engine.logits(sequences, prompt_len, "recompute", batched=False),
    }
    backend = engine.attention_backend
    del engine
    float32 = _EngineForward(model_dir, "float32", sequences, attention_backend)
    engine_float32 = float32.logits(sequences, prompt_len, "decode", batched=True)
    del float32
    with torch.inference_mode():
        # each loaded in its own dtype: a float64 copy of the bfloat16 model would keep its rounded weights
        dense = LlamaForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
        runs["dense_batched"] = dense(sequences[:, :-1]).logits[:, prompt_len - 1 :].float()
        del dense
        exact = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
        float64 = exact(sequences[:, :-1]).logits[:, prompt_len - 1 :]
    base = runs["decode_batched"]
    pairs = {f"decode_batched vs {name}": differences(base, other) for name, other in runs.items() if other is not base}
    pairs["decode_batched vs float32 engine"] = differences(engine_float32, base)
    pairs["decode_batched vs float64"] = differences(float64, base)
    pairs["float32 engine vs float64"] = differences(float64, engine_float32)
    worst = max(p["gain"]["max"] for name, p in pairs.items() if not name.startswith("float32"))

    def margins(logits: torch.Tensor) -> dict[str, float]:
        top2 = logits.double().topk(2, dim=-1).values
        values = (top2[..., 0] - top2[..., 1]).flatten().tolist()
        return {"median": statistics.median(values), "p1": _percentile(values, 1), "min": min(values)}

    return {
        "dtype": dtype, "attention_backend": backend,
        "num_positions": int(base.shape[0] * base.shape[1]),
        "pairs": pairs,
        "worst_gain": worst,
        "margins": {"float64": margins(float64), f"{dtype} decode_batched": margins(base)},
    }

