"""``kvbench measure-gpu``: the reference engine on a CUDA device against the memory-bandwidth roofline.

The simulator prices a decode step by the bytes it must read over the device's bandwidth (the
roofline of :mod:`reference_engine.costs`); this measures how close the engine's own CUDA paths come
to that bound on the device at hand. ``scripts/gpu_check.sh`` runs it on a lent GPU machine;
``--dry-run`` runs every step on CPU at tiny sizes (the tests use it).

What it measures, and how:

1. **HBM bandwidth**: a device-to-device copy of ``copy_mib`` MiB, timed over repeats; bandwidth
   counts the bytes read plus the bytes written (how the device's datasheet figure is usually matched).
2. **Decode step vs the HBM roofline**: a random Llama checkpoint (model ``1b``: Llama-3.2-1B's shape
   with a 32k vocabulary, bf16) is written from :func:`kvbench.models.random_llama.build_config` with
   seeded random weights (the generator's margin repair is skipped: it runs the whole vocabulary
   through the model on CPU, far too slow at this size, and timing does not need greedy margins). For
   each batch size B, B requests of ``context`` prompt tokens are prefilled, then ``decode_steps``
   decode steps are timed one by one (``engine.step()`` ends with the sampled tokens on the host, so
   each step is synchronous). The roofline is the bytes a step must read, the weights (every matrix
   and norm; the embedding table only for its B rows, so it is left out) plus the KV cache of every
   sequence, over the measured bandwidth: ``efficiency = roofline seconds / measured seconds``
   (1.0 = at the memory-bandwidth bound).
3. **Triton decode kernel vs the torch path**: the same decode steps with ``attention_backend`` set to
   ``triton`` and to ``torch`` on identical engines and requests; ratio = torch time / triton time.
4. **One storm on the device**: the preemption storm (``quick`` scale, tiny model) on the reference
   engine on this device, recorded and judged as in ``pytest suites/benchmarks`` (``--dry-run``: cut to
   6 requests at concurrency 2 and 8).

The swap copies are not here: they are one micro-benchmark, ``suites/benchmarks/test_micro.py``, on
CPU and (marked ``gpu``) on CUDA against a plain pinned copy; the GPU check runs it under pytest.

Everything lands in ``OUT/results.json`` (kvbench's results schema: one scenario per measurement, so
``kvbench report``/``compare`` read it), ``OUT/report.html`` and ``OUT/gpu_measure.json`` (the raw
figures). Nothing here asserts a time: a run fails only if something does not run, or the storm's
claims are not shown.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from reference_engine.costs import ModelShape

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
#: the sizes of a run on a CUDA device (meant to take under 8 minutes) and of a ``--dry-run`` on CPU
FULL_DEFAULTS: dict[str, Any] = {"device": "cuda", "model": "1b", "dtype": "bfloat16", "batches": (1, 16, 64),
                                 "context": 1024, "decode_steps": 20, "copy_mib": 2048}
DRY_RUN_DEFAULTS: dict[str, Any] = {"device": "cpu", "model": "tiny", "dtype": "float32", "batches": (1, 4),
                                    "context": 48, "decode_steps": 3, "copy_mib": 16}


class NoCudaDevice(RuntimeError):
    """CUDA was asked for (``Settings.device``) on a machine that has none."""


@dataclass(frozen=True)
class Settings:
    """What one run measures and at which sizes. :meth:`for_run` fills what is not given from the full
    defaults (a CUDA device) or the dry-run ones (CPU, tiny sizes)."""

    out: Path
    dry_run: bool
    device: str
    model: str
    dtype: str
    batches: tuple[int, ...]
    context: int
    decode_steps: int
    copy_mib: int
    storm: bool = True

    @classmethod
    def for_run(cls, out: str | Path, dry_run: bool = False, storm: bool = True, **given: Any) -> Settings:
        """The settings of a run: ``given`` values (None = the default) over the full or dry-run
        defaults. Raises ValueError naming the field and what is allowed."""
        defaults = DRY_RUN_DEFAULTS if dry_run else FULL_DEFAULTS
        values = {key: defaults[key] if given.get(key) is None else given[key] for key in defaults}
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}: expected among {sorted(defaults)}")
        settings = cls(out=Path(out), dry_run=dry_run, storm=storm, **{**values,
                                                                        "batches": tuple(values["batches"])})
        settings.check()
        return settings

    def check(self) -> None:
        """ValueError naming the field when a value is outside what the run can measure."""
        if self.model not in MODEL_SHAPES:
            raise ValueError(f"model={self.model!r}: expected one of {sorted(MODEL_SHAPES)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches={list(self.batches)}: expected one or more integers >= 1")
        for key in ("context", "decode_steps", "copy_mib"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: expected an integer >= 1")
        positions = MODEL_SHAPES[self.model]["max_position_embeddings"]
        if self.context + self.decode_steps + 8 > positions:
            raise ValueError(f"context={self.context} + decode_steps={self.decode_steps}: does not fit the "
                             f"{self.model} model's {positions} positions (at most {positions - 8} together)")


# --------------------------------------------------------------------------------------------
# the roofline arithmetic (sizes from reference_engine.costs, as the simulator prices them)


def model_shape(model: str) -> ModelShape:
    """The :class:`~reference_engine.costs.ModelShape` of the checkpoint :func:`write_random_checkpoint`
    writes for ``model`` (one of :data:`MODEL_SHAPES`)."""
    from kvbench.models.random_llama import build_config

    return ModelShape.from_config_dict(build_config("small", 0, **MODEL_SHAPES[model]), name=model)


def weight_bytes_per_step(shape: ModelShape, dtype: str) -> int:
    """Weight bytes one decode step reads: every parameter except the embedding table (a decode reads
    only its batch's rows of it; with tied embeddings the table is the LM head and is read whole)."""
    params = shape.num_params()
    if not shape.tie_word_embeddings:
        params -= shape.vocab_size * shape.hidden_size
    return params * DTYPE_BYTES[dtype]


def decode_step_bytes(shape: ModelShape, dtype: str, kv_tokens: int) -> int:
    """Bytes a decode step reads when its sequences hold ``kv_tokens`` tokens of KV in all (the new
    ones included): the weights plus that KV."""
    return weight_bytes_per_step(shape, dtype) + kv_tokens * shape.kv_bytes_per_token(DTYPE_BYTES[dtype])


def roofline_seconds(nbytes: int, bandwidth: float) -> float:
    """The memory-bandwidth bound: ``nbytes`` over ``bandwidth`` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    return nbytes / bandwidth


# --------------------------------------------------------------------------------------------
# measuring


def _sync(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 2) -> list[float]:
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
    """Device-to-device copy of ``mib`` MiB; bandwidth counts bytes read + bytes written, best time."""
    import torch

    src = torch.empty(mib * MIB, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = _timed(lambda: dst.copy_(src), device, repeats=10)
    return {"bytes": src.numel(), **_summary(times), "bandwidth_bytes_s": 2 * src.numel() / min(times),
            "note": "2 x bytes / best time (read + write)"}


def write_random_checkpoint(out_dir: Path, model: str, dtype: str, seed: int = 0) -> Path:
    """config.json from :func:`kvbench.models.random_llama.build_config`, seeded random weights
    (variance preserving, the generator's names) in ``dtype``; no margin repair (module docstring)."""
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

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=torch_dtype)

    weights = {"model.embed_tokens.weight": linear(vocab, h), "model.norm.weight": ones(),
               "lm_head.weight": linear(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
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


def measure_decode(model_dir: Path, settings: Settings, backend: str, bandwidth: float) -> list[dict[str, Any]]:
    """Decode-step times per batch size on one engine with ``attention_backend=backend``, each beside
    its roofline."""
    from reference_engine import EngineConfig, LLMEngine, SamplingParams

    shape = model_shape(settings.model)
    max_batch = max(settings.batches)
    budget = max(4096, settings.context)  # prefill tokens per step
    # Requests prefilled early decode while later ones prefill: room for those tokens too, so that no
    # request finishes (or runs out of blocks) inside the timed window.
    max_tokens = settings.decode_steps + 2 + -(-max_batch * settings.context // budget) + 2
    blocks = max_batch * -(-(settings.context + max_tokens) // BLOCK_SIZE) + 8
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=settings.device, dtype=settings.dtype,
                                    block_size=BLOCK_SIZE, num_gpu_blocks_override=blocks, max_num_seqs=max_batch,
                                    max_num_batched_tokens=budget, attention_backend=backend))
    rng = random.Random(0)
    rows = []
    for batch in settings.batches:
        ids = [f"{backend}-b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(3, shape.vocab_size) for _ in range(settings.context)],
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for _ in range(max_tokens):  # prefill until every request decodes
            if engine.step().record.num_prefill_tokens == 0:
                break
        engine.step()  # one decode step as warm-up (kernel compilation, allocator)
        kv_tokens_before = sum(engine.scheduler.requests[rid].num_tokens for rid in ids)
        times = []
        for _ in range(settings.decode_steps):
            t0 = time.perf_counter()
            record = engine.step().record
            times.append(time.perf_counter() - t0)
            if record.num_decode_tokens != batch:  # a step of something else would not be a decode step's time
                raise RuntimeError(f"a timed step of batch {batch} decoded {record.num_decode_tokens} tokens: "
                                   f"{record}")
        kv_tokens_after = sum(engine.scheduler.requests[rid].num_tokens for rid in ids)
        for rid in ids:
            engine.abort_request(rid)
        engine.step()
        # KV read per step: every sequence's tokens so far, averaged over the timed steps
        kv_tokens = (kv_tokens_before + kv_tokens_after) // 2
        nbytes = decode_step_bytes(shape, settings.dtype, kv_tokens)
        summary = _summary(times)
        roof = roofline_seconds(nbytes, bandwidth)
        rows.append({"backend": backend, "batch": batch, "context": settings.context, **summary,
                     "bytes_read": nbytes, "mean_kv_tokens_per_seq": kv_tokens / batch, "roofline_s": roof,
                     "efficiency": roof / summary["median_s"], "tokens_per_s": batch / summary["median_s"]})
    del engine
    return rows


def run_storm(settings: Settings, results: Any) -> dict[str, Any]:
    """The preemption storm at quick scale on the reference engine on this device, recorded into
    ``results``: its name, seconds and the claims it did not show."""
    from kvbench.bench import scenarios as sc
    from kvbench.bench.scenarios.common import STEP_SECONDS
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from kvbench.models.builtin import builtin_checkpoint

    scenario = _dry_run_storm() if settings.dry_run else sc.PREEMPTION_STORM
    model = sc.Model.from_dir(builtin_checkpoint("tiny"), "tiny")
    adapter = make_adapter(parse_engine_spec(f"reference:device={settings.device}"), model.path)
    try:
        started = time.perf_counter()
        outcome = sc.run(scenario, adapter, model, "quick", None, repeats=1, step_seconds=STEP_SECONDS["quick"])
        seconds = time.perf_counter() - started
        sc.record(outcome, results, adapter.describe())
    finally:
        adapter.close()
    return {"scenario": scenario.name, "seconds": seconds, "failures": outcome.failures()}


def _dry_run_storm() -> Any:
    """The preemption storm cut to 6 requests at concurrency 2 and 8 (a rehearsal takes seconds, not minutes)."""
    from kvbench.bench.scenarios.storms import PreemptionStorm, StormSize
    from kvbench.bench.workloads import Fixed, Uniform

    spec = dataclasses.replace(PreemptionStorm.sizes["quick"].spec, num_requests=6, input_len=Uniform(16, 48),
                               output_len=Fixed(24))
    small = StormSize(spec, concurrencies=(2, 8), num_gpu_blocks=12)

    class DryRunStorm(PreemptionStorm):
        sizes = {"quick": small, "full": small}  # noqa: RUF012

    return DryRunStorm()


# --------------------------------------------------------------------------------------------
# one run


def device_name(device: str) -> str:
    """``cuda (NAME)`` for a CUDA device, else ``cpu``."""
    import torch

    if torch.device(device).type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def measure(settings: Settings, out: TextIO) -> tuple[dict[str, Any], Any]:
    """Every measurement of the module docstring, progress printed on ``out``; writes OUT/gpu_measure.json
    and returns its raw figures and the :class:`~kvbench.bench.results.Results` that record them (the
    command writes those as OUT/results.json and OUT/report.html: the report is a floor above this one).
    Raises :class:`NoCudaDevice` when ``settings.device`` is CUDA and this machine has none."""
    import torch

    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise NoCudaDevice("CUDA is not available here; --dry-run rehearses every step on CPU")
    threads = torch.get_num_threads()
    if settings.dry_run:  # one thread: on a shared CPU, OpenMP threads spinning against each other dominate tiny copies
        torch.set_num_threads(1)
    try:
        return _measure(settings, out)
    finally:
        torch.set_num_threads(threads)  # the caller's process (a test, a notebook) keeps its own


def _measure(settings: Settings, out: TextIO) -> tuple[dict[str, Any], Any]:
    import torch

    from kvbench.bench.results import Results
    from reference_engine.kernels.triton_attention import triton_available

    settings.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    raw: dict[str, Any] = {"settings": {k: str(v) if isinstance(v, Path) else v
                                        for k, v in dataclasses.asdict(settings).items()},
                           "device": device_name(settings.device), "torch": torch.__version__}
    results = Results(device=raw["device"])
    params = {"scale": "gpu", "model": settings.model, "dtype": settings.dtype, "device": raw["device"]}

    def step(name: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {name}", file=out, flush=True)

    step("bandwidth")
    raw["bandwidth"] = bw = measure_bandwidth(settings.device, settings.copy_mib)
    results.add_scenario_result("gpu_bandwidth", "device", {"bandwidth_gb_s": bw["bandwidth_bytes_s"] / 1e9},
                                parameters={**params, "copy_mib": settings.copy_mib}, notes=[bw["note"]])

    step(f"checkpoint ({settings.model}, {settings.dtype})")
    model_dir = write_random_checkpoint(settings.out / "model", settings.model, settings.dtype)
    raw["parameters"] = model_shape(settings.model).num_params()
    backends = ["torch"] + (["triton"] if triton_available(settings.device) else [])
    raw["decode"] = []
    try:
        for backend in backends:
            step(f"decode steps, attention_backend={backend}")
            raw["decode"] += measure_decode(model_dir, settings, backend, bw["bandwidth_bytes_s"])
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)  # GBs at full size, and random: not worth keeping
    if "triton" not in backends:
        raw["triton_skipped"] = f"triton cannot run on {settings.device} in this process"
    for row in raw["decode"]:
        results.add_scenario_result("gpu_decode_roofline", f"reference[{row['backend']}]",
                                    {"step_s": row["median_s"], "roofline_s": row["roofline_s"],
                                     "efficiency": row["efficiency"], "tokens_per_s": row["tokens_per_s"]},
                                    mode=f"batch={row['batch']}", parameters={**params, "context": settings.context})
    by_key = {(r["backend"], r["batch"]): r for r in raw["decode"]}
    raw["triton_vs_torch"] = {str(b): by_key[("torch", b)]["median_s"] / by_key[("triton", b)]["median_s"]
                              for b in settings.batches if ("triton", b) in by_key}
    if raw["triton_vs_torch"]:
        results.add_scenario_result("gpu_triton_vs_torch", "reference",
                                    {f"speedup_batch_{b}": v for b, v in raw["triton_vs_torch"].items()},
                                    parameters=params, notes=["torch decode step time / triton decode step time"])
    if settings.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if settings.storm:
        step("preemption storm (quick scale, tiny model)")
        raw["storm"] = run_storm(settings, results)
    raw["seconds"] = time.perf_counter() - t_start
    (settings.out / "gpu_measure.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    step(f"measured: {settings.out / 'gpu_measure.json'}")
    return raw, results


def summary_lines(raw: dict[str, Any]) -> Sequence[str]:
    """The figures of a run (:func:`measure`'s return) as lines of text."""
    lines = [f"{raw['device']}, torch {raw['torch']}, {raw['parameters'] / 1e9:.2f}e9 parameters",
             f"HBM copy bandwidth: {raw['bandwidth']['bandwidth_bytes_s'] / 1e9:,.0f} GB/s"]
    lines += [f"decode {r['backend']:6s} batch {r['batch']:3d}: {1e3 * r['median_s']:8.2f} ms/step, roofline "
              f"{1e3 * r['roofline_s']:7.2f} ms, efficiency {100 * r['efficiency']:5.1f}%" for r in raw["decode"]]
    lines += [f"triton vs torch, batch {b}: {v:.2f}x" for b, v in raw["triton_vs_torch"].items()]
    if raw.get("triton_skipped"):
        lines.append(f"triton: skipped ({raw['triton_skipped']})")
    if raw.get("storm"):
        lines.append(f"storm: {raw['storm']['scenario']} in {raw['storm']['seconds']:.1f} s, claims not shown: "
                     f"{raw['storm']['failures'] or 'none'}")
    lines.append(f"total {raw['seconds']:.0f} s")
    return lines
