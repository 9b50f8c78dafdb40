"""Hardware profiles: what a machine can do, and the fitted coefficients that turn work into time.

A profile holds the machine's peak rates (compute FLOP/s, memory bandwidth, host-link bandwidth),
its memory size (the KV pool is what is left after the weights) and the coefficients of the step
cost model (:mod:`reference_engine.costs.cost_model`). The built-in GPU profiles take the rates from
NVIDIA's public datasheets; their coefficients are *assumed* typical efficiencies, not fitted on the
machine (nobody calibrated them here: there is no GPU), so their absolute times are estimates.
``kvbench calibrate`` fits the coefficients on this machine and writes a profile file.

Profile file (JSON)::

    {"format": "kvbench-hardware-profile", "version": 1, "name": "this-machine",
     "compute_flops": 1.2e11, "memory_bandwidth": 1.0e10, "link_bandwidth": 8.0e9, "memory_bytes": 2.5e10,
     "combine": "sum",
     "coefficients": {"fixed_s": 0.002, "per_seq_s": 1e-4, "dense": 1.3, "attention": 4.0, "memory": 1.0,
                      "link": 1.0, "per_copy_s": 2e-5,
                      "wake_s": 0.0014, "wake_tau_s": 0.03},
     "dtype": "float32", "source": "kvbench calibrate ...", "fit": {...},
     "front_end": {"per_request_s": 0.004, "per_step_s": 0.0, "per_output_s": 2e-4, "per_chunk_s": 8e-4}}

``front_end`` (optional; absent: none) prices a serving front end's delivery, the process between the
engine and its clients (vLLM's API server): see :class:`FrontEndCosts`.

Unknown keys are kept out (an error names them), so a typo does not silently fall back to a default.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "kvbench-hardware-profile"
PROFILE_VERSION = 1
COMBINES = ("max", "sum")
GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Coefficients:
    """What turns work into seconds. A step costs::

        fixed_s + per_seq_s * sequences + combine(dense * dense_s + attention * attention_s, memory * memory_s)

    where ``dense_s``, ``attention_s`` are the step's FLOPs over the peak compute rate and ``memory_s``
    its bytes over the peak memory bandwidth (so ``dense = 1 / efficiency``). A swap copy costs
    ``per_copy_s + link * bytes / link_bandwidth``; taking in a request ``per_request_s`` (0 in the
    built-in GPU profiles; fitted on served runs here, where it is the driver's and the engine's
    Python work per arrival).

    A step that follows ``g`` seconds of idleness (the engine had nothing to run) costs
    ``wake_s * (1 - exp(-g / wake_tau_s))`` more: what an engine pays to get going again after a lull,
    measured by ``kvbench calibrate`` (:func:`~reference_engine.sim.calibrate.fit_wake`). On a small CPU
    VM a lone prefill right after another step is about twice as fast as one after a lull of sleep or
    of a busy wait alike (its caches gone cold, not a halted core), so in an open-loop run every request
    that arrives at an idle engine pays it (docs/simulator.md has the wake term). 0 (the
    default, and in the built-in GPU profiles): no such cost.
    """

    fixed_s: float = 0.0  # per step: scheduling, launches, host-side preparation
    per_seq_s: float = 0.0  # per sequence in the batch: its share of input preparation and sampling
    dense: float = 1.0  # multiplier on the matmuls' ideal time
    attention: float = 1.0  # multiplier on attention's ideal compute time
    memory: float = 1.0  # multiplier on the ideal time to read weights and KV
    link: float = 1.0  # multiplier on the ideal host-link transfer time
    per_copy_s: float = 0.0  # per batched swap copy (one per direction per step)
    per_request_s: float = 0.0  # host work to take in one request (validation, queueing, the driver's release)
    wake_s: float = 0.0  # extra seconds of a step after a long idle spell (its caches cold)
    wake_tau_s: float = 0.0  # how fast idleness makes the next step pay ``wake_s``: 63% of it after this long

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"coefficients.{key}={value!r} is invalid: expected a finite number >= 0")
        if self.wake_s > 0 and self.wake_tau_s <= 0:
            raise ValueError(f"coefficients.wake_tau_s={self.wake_tau_s!r} is invalid with wake_s={self.wake_s!r}: "
                             "expected seconds > 0 (how long idleness takes to make a step pay wake_s)")

    def wake_seconds(self, idle_s: float) -> float:
        """Extra seconds of a step that follows ``idle_s`` seconds in which the engine had nothing to run."""
        if self.wake_s <= 0 or idle_s <= 0:
            return 0.0
        return self.wake_s * -math.expm1(-idle_s / self.wake_tau_s)


@dataclass(frozen=True)
class FrontEndCosts:
    """What a serving front end spends, one process between the engine and its clients (vLLM V1's API
    server: one asyncio loop that takes requests in, turns each engine step's outputs into per-request
    outputs, and writes each request's stream). It does one thing at a time, so what it spends delays
    everything behind it; outputs of a request that pile up while it is busy leave as one chunk
    (:mod:`kvbench.sim.front_end` is the model that spends these)."""

    per_request_s: float = 0.0  # taking in one request (HTTP, tokenization, hand-off to the engine)
    per_step_s: float = 0.0  # absorbing one engine step's outputs (receive, deserialize, stats)
    per_output_s: float = 0.0  # per request output in that step (detokenize, merge into its collector)
    per_chunk_s: float = 0.0  # writing one stream chunk to a client (format, HTTP write, client read)

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"front_end.{key}={value!r} is invalid: expected a finite number >= 0")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    compute_flops: float  # peak dense FLOP/s at the model's dtype
    memory_bandwidth: float  # device memory, bytes/s
    link_bandwidth: float  # device <-> host, bytes/s, one direction
    memory_bytes: float  # device memory size
    coefficients: Coefficients = field(default_factory=Coefficients)
    combine: str = "max"  # how compute and memory time combine: "max" (roofline, overlapped) or "sum"
    dtype: str = "bfloat16"  # the dtype the rates and coefficients are for
    source: str = ""  # where the numbers come from
    fit: dict[str, Any] | None = None  # calibration's own fit error, if calibrated
    #: a serving front end between the engine and its clients; None: clients see the engine's steps directly
    front_end: FrontEndCosts | None = None

    def __post_init__(self) -> None:
        for key in ("compute_flops", "memory_bandwidth", "link_bandwidth", "memory_bytes"):
            value = getattr(self, key)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"profile {self.name!r}: {key}={value!r} is invalid: expected a finite number > 0")
        if self.combine not in COMBINES:
            raise ValueError(f"profile {self.name!r}: combine={self.combine!r} is invalid: expected one of {COMBINES}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"profile {self.name!r}: dtype={self.dtype!r} is invalid: expected float32, float16 "
                             "or bfloat16")

    def with_coefficients(self, coefficients: Coefficients, **changes: Any) -> HardwareProfile:
        return replace(self, coefficients=coefficients, **changes)

    # -- file format ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **asdict(self)}
        for key in ("fit", "front_end"):
            if data[key] is None:
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "profile") -> HardwareProfile:
        """Raises ValueError naming the field that is missing, unknown or invalid."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object")
        if data.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
            raise ValueError(f"{where}: format={data.get('format')!r} is not {PROFILE_FORMAT!r}")
        if data.get("version", PROFILE_VERSION) != PROFILE_VERSION:
            raise ValueError(f"{where}: version={data.get('version')!r} is not supported (expected {PROFILE_VERSION})")
        fields = {k: v for k, v in data.items() if k not in ("format", "version")}
        allowed = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - allowed)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown} (allowed: {sorted(allowed)})")
        missing = [k for k in ("name", "compute_flops", "memory_bandwidth", "link_bandwidth", "memory_bytes")
                   if k not in fields]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}")
        coef = fields.get("coefficients", {})
        if not isinstance(coef, dict):
            raise ValueError(f"{where}: coefficients must be an object")
        unknown = sorted(set(coef) - set(Coefficients.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{where}: unknown coefficient(s) {unknown} "
                             f"(allowed: {sorted(Coefficients.__dataclass_fields__)})")
        front = fields.get("front_end")
        if front is not None and (not isinstance(front, dict) or set(front) - set(FrontEndCosts.__dataclass_fields__)):
            raise ValueError(f"{where}: front_end must be an object with keys among "
                             f"{sorted(FrontEndCosts.__dataclass_fields__)}, got {front!r}")
        try:
            fields["coefficients"] = Coefficients(**coef)
            if front is not None:
                fields["front_end"] = FrontEndCosts(**front)
            return cls(**fields)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"hardware profile {str(path)!r}: cannot read it: {e}") from None
        return cls.from_dict(data, where=f"hardware profile {str(path)!r}")


# Assumed efficiencies of the built-in GPU profiles (not measured here: no GPU to calibrate on).
# Dense bf16 GEMMs of a serving engine reach ~60-70% of peak, paged attention less, HBM streaming
# ~80%; a vLLM-style engine step has a few ms of host-side work without CUDA graphs, ~1 ms with
# them; a cudaMemcpyAsync launch is ~10 us. Calibrate on the machine for numbers to plan on.
_GPU_COEFFICIENTS = Coefficients(fixed_s=1.5e-3, per_seq_s=5e-6, dense=1 / 0.65, attention=1 / 0.4, memory=1 / 0.8,
                                 link=1 / 0.8, per_copy_s=10e-6)

PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA H200 (SXM) datasheet: BF16 Tensor Core 1,979 TFLOPS *with sparsity* -> 989 TFLOPS dense;
    # 141 GB HBM3e at 4.8 TB/s; PCIe Gen5 128 GB/s (both directions) -> 64 GB/s one way.
    "h200": HardwareProfile("h200", compute_flops=989 * TB, memory_bandwidth=4.8 * TB, link_bandwidth=64 * GB,
                            memory_bytes=141 * GB, coefficients=_GPU_COEFFICIENTS,
                            source="NVIDIA H200 datasheet (dense BF16, HBM3e, PCIe Gen5 x16); efficiencies assumed"),
    # NVIDIA H100 SXM5 datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense; 80 GB HBM3 at 3.35 TB/s;
    # PCIe Gen5 128 GB/s -> 64 GB/s one way.
    "h100": HardwareProfile("h100", compute_flops=989 * TB, memory_bandwidth=3.35 * TB, link_bandwidth=64 * GB,
                            memory_bytes=80 * GB, coefficients=_GPU_COEFFICIENTS,
                            source="NVIDIA H100 SXM datasheet (dense BF16, HBM3, PCIe Gen5 x16); efficiencies assumed"),
    # NVIDIA A100 80GB SXM datasheet: BF16 312 TFLOPS dense (624 with sparsity); HBM2e 2,039 GB/s;
    # PCIe Gen4 64 GB/s (both directions) -> 32 GB/s one way.
    "a100-80gb": HardwareProfile("a100-80gb", compute_flops=312 * TB, memory_bandwidth=2.039 * TB,
                                 link_bandwidth=32 * GB, memory_bytes=80 * GB, coefficients=_GPU_COEFFICIENTS,
                                 source="NVIDIA A100 80GB SXM datasheet (dense BF16, HBM2e, PCIe Gen4 x16); "
                                        "efficiencies assumed"),
}
PROFILE_ALIASES = {"h100-sxm": "h100", "a100": "a100-80gb", "a100-80g": "a100-80gb"}


def load_profile(spec: str | Path) -> HardwareProfile:
    """A built-in profile name (``h200``, ``h100``, ``a100-80gb``) or a profile JSON file."""
    text = str(spec)
    key = PROFILE_ALIASES.get(text.lower(), text.lower())
    if key in PROFILES:
        return PROFILES[key]
    path = Path(text)
    if path.is_file():
        return HardwareProfile.load(path)
    raise ValueError(f"hardware {text!r} is neither a built-in profile ({', '.join(PROFILES)}) nor a profile "
                     "file (write one with `kvbench calibrate`)")
