"""Adapter ``hf``: transformers' plain ``generate``, one request at a time: the ground truth for outputs.

No paging, no batching, no preemption: each request runs alone through ``LlamaForCausalLM.generate``
with a contiguous ``DynamicCache`` and no padding (a batch of one needs none), so nothing but the model
itself decides its tokens. Conformance checks compare other engines' greedy outputs with these, under
the near-tie rule of :mod:`kvbench.conformance.equivalence`, using :meth:`HFAdapter.top2_margins`.

Contracts:

* Greedy when ``temperature == 0`` (``do_sample=False``: argmax of the raw float32 logits).
* ``ignore_eos=True`` (the default of :class:`GenRequest`) produces exactly ``max_tokens`` tokens:
  ``eos_token_id=None`` is passed as a ``generate`` keyword (keywords override the model's
  ``generation_config``; passing it inside a ``GenerationConfig`` object would not, because
  transformers fills ``None`` fields from the model's defaults). ``min_new_tokens`` is deliberately
  *not* used: it masks the EOS logit to -inf, which changes greedy picks where EOS is the argmax,
  whereas ``ignore_eos`` in vLLM and in the reference engine keeps EOS a valid token that merely does
  not stop the request.
* Seeded sampling when ``temperature > 0``: ``torch.manual_seed(seed)`` inside
  ``torch.random.fork_rng`` (the caller's RNG state is untouched). transformers samples with
  ``torch.multinomial`` on the global generator, a different random stream from any other engine's
  sampler, so sampled outputs are reproducible for ``hf`` itself but must never be compared across
  engines.
* Counters: none exposed (every field of :class:`~kvbench.core.counters.Counters` is ``None``):
  ``generate`` keeps no statistics and has no pool to preempt from.
* ``knobs`` are ignored: they change how a paged engine schedules, never what a request alone produces.
  All of them are listed in ``unsupported_knobs`` so that a check about a paging mechanism skips ``hf``.

Loaded models are cached per (model_dir, device, attn_implementation) in :func:`load_model`, which
``hf-cb`` shares; the two adapters must not use one model from two threads at the same time (kvbench
runs engines one after another).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvbench.core.counters import Counters
from kvbench.engines.base import DEFAULT_KNOBS, EngineAdapter, GenOutput, GenRequest, GenResult, Knobs

# torch and transformers are imported inside functions: kvbench is a pytest plugin and importing this
# module must stay cheap.

_MODEL_CACHE: dict[tuple[str, str, str | None, str], Any] = {}
#: the ``dtype`` option's values
DTYPES = ("float32", "bfloat16", "float16")
_MODEL_CACHE_LOCK = threading.Lock()

_NO_POOL = "hf runs each request alone with a contiguous DynamicCache: no block pool, no batching, no preemption"


def load_model(model_dir: str, device: str = "cpu", attn_implementation: str | None = None,
               dtype: str = "float32") -> Any:
    """Load (once) a ``LlamaForCausalLM`` in ``dtype`` (float32 by default) from safetensors, in eval mode,
    on ``device``.

    Cached per (model_dir, device, attn_implementation, dtype). ``attn_implementation=None`` keeps
    transformers' default (sdpa where available).
    """
    key = (str(model_dir), device, attn_implementation, dtype)
    with _MODEL_CACHE_LOCK:
        model = _MODEL_CACHE.get(key)
        if model is None:
            import torch
            from transformers import LlamaForCausalLM

            kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "use_safetensors": True}
            if attn_implementation is not None:
                kwargs["attn_implementation"] = attn_implementation
            model = LlamaForCausalLM.from_pretrained(str(model_dir), **kwargs).to(device).eval()
            _MODEL_CACHE[key] = model
    return model


def check_dtype(dtype: str) -> str:
    """Validate the ``dtype`` option."""
    if dtype not in DTYPES:
        raise ValueError(f"option dtype={dtype!r} is not supported: use one of {', '.join(DTYPES)}")
    return dtype


def eos_token_ids(model: Any) -> set[int]:
    """The EOS token ids of a loaded model (empty if it has none)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def check_device(device: str) -> str:
    """Validate the ``device`` option: ``cpu`` or ``cuda[:N]``."""
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"option device={device!r} is not supported: use 'cpu' or 'cuda' (or 'cuda:N')")
    return device


class HFAdapter(EngineAdapter):
    """transformers ``generate``, one request at a time (see the module docstring for the contract)."""

    kind = "hf"
    capabilities = frozenset({"sampling", "stop_token_ids"})
    option_keys = {  # noqa: RUF012 - read-only class-level table
        "device": "cpu (default) or cuda[:N]",
        "attn_implementation": "transformers attention implementation (default: transformers' choice, sdpa)",
        "dtype": "float32 (default), bfloat16 or float16: the dtype the model is loaded and run in",
    }
    unsupported_knobs = {  # noqa: RUF012
        "block_size": _NO_POOL,
        "num_gpu_blocks": _NO_POOL,
        "num_cpu_blocks": _NO_POOL,
        "max_num_seqs": _NO_POOL,
        "max_num_batched_tokens": _NO_POOL,
        "max_model_len": "hf has no sequence length cap, not even the model's position embeddings",
        "enable_chunked_prefill": "hf prefills each prompt in one forward pass",
        "enable_prefix_caching": "hf has no cache shared across requests",
        "preemption_mode": _NO_POOL,
        "scheduling_policy": "hf runs requests one after another, in the order given",
        "admission_policy": _NO_POOL,
        "admission_headroom": _NO_POOL,
        "prefill_pacing_tokens": "hf prefills each prompt in one forward pass, one request at a time",
    }
    no_length_limit = ("hf (plain generate) has no admission control: a prompt longer than the model's "
                       "max_position_embeddings is run, not refused (RoPE positions are computed on the fly)")

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        """Option values checked as the adapter reads them (nothing is loaded)."""
        super().validate_options(options)
        check_device(options.get("device", "cpu"))
        check_dtype(options.get("dtype", "float32"))

    def __init__(self, model_dir: str, options: dict[str, str] | None = None, name: str | None = None):
        super().__init__(model_dir, options, name)
        self.device = check_device(self.options.get("device", "cpu"))
        self.attn_implementation = self.options.get("attn_implementation")
        self.dtype = check_dtype(self.options.get("dtype", "float32"))

    def compute_dtype(self) -> str:
        return self.dtype

    @property
    def model(self) -> Any:
        """The cached ``LlamaForCausalLM`` (loaded on first use)."""
        return load_model(self.model_dir, self.device, self.attn_implementation, self.dtype)

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        """Run each request alone, in order. ``knobs`` are ignored (see the module docstring)."""
        outputs = [self._generate_one(r) for r in requests]
        evidence = [f"hf: {len(requests)} requests run one at a time through transformers generate "
                    f"on {self.device}, no paging; no counter is exposed (generate keeps none)"]
        # Every counter None: generate has no pool and counts nothing; 0 would claim "nothing happened".
        return GenResult(outputs=outputs, counters=Counters(), evidence=evidence)

    def _generate_one(self, request: GenRequest) -> GenOutput:
        import torch

        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be >= 1, got {request.max_tokens}")
        model = self.model
        eos = eos_token_ids(model)
        input_ids = torch.tensor([request.prompt_token_ids], dtype=torch.long, device=model.device)
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": request.max_tokens,
            # A batch of one is never padded; an explicit pad id only silences transformers' warning.
            "pad_token_id": model.config.pad_token_id if model.config.pad_token_id is not None else 0,
        }
        # stop_token_ids end a request like EOS does (vLLM's semantics), so both go in generate's EOS list
        stops = set(request.stop_token_ids) | (set() if request.ignore_eos else eos)
        if request.ignore_eos or request.stop_token_ids:
            # as a keyword: overrides the model's generation_config
            kwargs["eos_token_id"] = sorted(stops) if stops else None
        sampling = request.temperature > 0
        if sampling:
            kwargs.update(do_sample=True, temperature=request.temperature, top_k=request.top_k,
                          top_p=request.top_p)
        else:
            kwargs["do_sample"] = False

        with torch.inference_mode(), torch.random.fork_rng(devices=self._rng_devices()):
            if sampling:
                torch.manual_seed(request.seed if request.seed is not None else 0)
            sequences = model.generate(input_ids, **kwargs)
        tokens = sequences[0, len(request.prompt_token_ids):].tolist()

        stopped = bool(tokens) and tokens[-1] in stops
        return GenOutput(request.request_id, tokens, "stop" if stopped else "length", num_preemptions=0)

    def _rng_devices(self) -> list[int]:
        import torch

        if self.device.startswith("cuda"):
            return [torch.device(self.device).index or 0]
        return []

    def top2_margins(self, prompt_token_ids: Sequence[int], generated_token_ids: Sequence[int]) -> list[float]:
        """Teacher-forced top-1 minus top-2 logit margins of the generated positions.

        One forward pass over ``prompt + generated[:-1]``; element ``i`` of the result is the margin of
        the logits (in the model's dtype, float32 by default) that predicted ``generated_token_ids[i]`` (the
        distribution at position ``len(prompt) + i - 1``). These are a full-forward's logits, not the
        incremental decode's: the two differ by float noise only, below the dtype's near-tie tolerance
        (:data:`kvbench.conformance.equivalence.TOLERANCES`).
        """
        import torch

        if not prompt_token_ids:
            raise ValueError("top2_margins needs a non-empty prompt")
        generated = list(generated_token_ids)
        if not generated:
            return []
        model = self.model
        sequence = list(prompt_token_ids) + generated[:-1]
        input_ids = torch.tensor([sequence], dtype=torch.long, device=model.device)
        with torch.inference_mode():
            logits = model(input_ids).logits[0, len(prompt_token_ids) - 1:]  # [len(generated), vocab]
        top2 = logits.float().topk(2, dim=-1).values  # [len(generated), 2]
        return (top2[:, 0] - top2[:, 1]).tolist()

    def next_logits(self, prompt_token_ids: Sequence[int], generated_token_ids: Sequence[int], position: int) -> Any:
        """Teacher-forced: the float32 copy of the logits (``[vocab]``) that predicted
        ``generated_token_ids[position]``, from one forward pass over the prompt and the tokens before it."""
        import torch

        if not prompt_token_ids:
            raise ValueError("next_logits needs a non-empty prompt")
        if not 0 <= position < len(generated_token_ids):
            raise ValueError(f"position {position} is outside the {len(generated_token_ids)} generated tokens")
        model = self.model
        sequence = list(prompt_token_ids) + list(generated_token_ids)[:position]
        input_ids = torch.tensor([sequence], dtype=torch.long, device=model.device)
        with torch.inference_mode():
            return model(input_ids).logits[0, -1].float()  # [vocab]

    def logit_gap(self, prompt_token_ids: Sequence[int], generated_token_ids: Sequence[int], position: int,
                  token: int) -> float:
        """Teacher-forced: the top-1 logit minus ``token``'s logit of the distribution that predicted
        ``generated_token_ids[position]`` (0 when ``token`` is the top-1). How far below the best another
        engine's pick at a divergence was (:func:`kvbench.conformance.equivalence.confirm_near_tie`)."""
        logits = self.next_logits(prompt_token_ids, generated_token_ids, position)
        return float(logits.max() - logits[token])
