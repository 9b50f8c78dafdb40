"""Seeded, reproducible request sets.

A :class:`WorkloadSpec` describes a workload (how many requests, how long their prompts and
outputs are, when they arrive, which share a prefix, their priorities, which are aborted) plus a
seed. ``spec.build(vocab_size)`` turns it into a :class:`Workload`: a list of
:class:`WorkloadRequest` sorted by arrival time. Every engine is fed the same requests.

Reproducibility contract: the same spec, seed and ``build`` arguments give identical requests
(token ids, lengths, arrival times, priorities, aborts, sampling seeds) on every machine. Each
aspect draws from its own random sub-stream, derived from the seed and a fixed per-aspect key,
so changing one aspect of a spec (say the arrival process) leaves the others (the prompts)
unchanged, and a benchmark can vary one thing at a time::

    seed --SeedSequence(seed, spawn_key=(k,))--> input_len | output_len | prompt_tokens | arrival
                                                 | prefix_tokens | prefix_groups | priorities
                                                 | aborts | sampling

Building blocks: length distributions (:class:`Fixed`, :class:`Uniform`, :class:`Normal`,
:class:`LogNormal`, :class:`Explicit`), arrival processes (:class:`Poisson`, :class:`Gamma`,
:class:`StepSurge`, :class:`AllAtOnce`, :class:`ClosedLoop`), :class:`SharedPrefix`,
:class:`Priorities` and :class:`Aborts`. :func:`combine` merges built workloads (steady traffic
plus a wave of long requests, say). Every block has ``to_dict()``; ``WorkloadSpec.from_dict``
rebuilds a spec from its ``to_dict()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Literal

import numpy as np

from kvbench.core.jsonable import jsonable
from kvbench.core.requests import WorkloadRequest

# The key of each aspect's sub-stream is its index here. Append new aspects at the end and never
# reorder: a changed key would silently change every workload built from an existing seed.
_ASPECTS = (
    "input_len",
    "output_len",
    "prompt_tokens",
    "arrival",
    "prefix_tokens",
    "prefix_groups",
    "priorities",
    "aborts",
    "sampling",
)


def _stream(seed: int, aspect: str) -> np.random.Generator:
    """The generator for one aspect; the same as ``SeedSequence(seed).spawn(...)[index]``."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_ASPECTS.index(aspect),)))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _request_id(index: int) -> str:
    return f"r{index:04d}"


# --------------------------------------------------------------------------------------------
# Requests and workloads
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A built workload: ``requests`` sorted by ``arrival_time`` (ids ``r0000``, ``r0001``...).

    ``concurrency`` is set for closed-loop workloads (keep at most this many in flight, ignore
    arrival times) and None for open-loop ones (submit each request at its arrival time).
    ``spec`` is a JSON-serialisable description of how the workload was made, for results files.
    """

    name: str
    requests: list[WorkloadRequest]
    concurrency: int | None
    spec: dict[str, Any]

    def __post_init__(self) -> None:
        arrivals = [r.arrival_time for r in self.requests]
        _check(arrivals == sorted(arrivals),
               f"Workload {self.name!r}: requests must be sorted by arrival_time")
        ids = [r.request_id for r in self.requests]
        _check(len(set(ids)) == len(ids), f"Workload {self.name!r}: request ids must be unique")
        _check(self.concurrency is None or self.concurrency >= 1,
               f"Workload {self.name!r}: concurrency must be None or >= 1, got {self.concurrency}")

    def __len__(self) -> int:
        return len(self.requests)

    def shifted(self, seconds: float) -> Workload:
        """The same open-loop workload with every arrival ``seconds`` later (a wave that starts late)."""
        _check(self.concurrency is None,
               f"Workload {self.name!r} is closed-loop; only open-loop workloads can be shifted")
        _check(seconds >= 0, f"shifted: seconds must be >= 0, got {seconds}")
        requests = [replace(r, arrival_time=r.arrival_time + seconds) for r in self.requests]
        spec = {**self.spec, "shift_s": self.spec.get("shift_s", 0) + seconds}
        return replace(self, requests=requests, spec=spec)


def combine(name: str, *workloads: Workload) -> Workload:
    """Merge open-loop workloads into one, sorted by arrival time and renumbered ``r0000``...

    Each request keeps its group, priority, abort and sampling settings. Requests arriving at the
    same time keep the order of the arguments. Group names are prefixed with the name of the spec
    that made them, so groups of differently named workloads never collide.
    """
    _check(len(workloads) >= 1, "combine: needs at least one workload")
    for w in workloads:
        # Closed-loop requests have no meaningful arrival times to merge by.
        _check(w.concurrency is None,
               f"combine: workload {w.name!r} is closed-loop (concurrency={w.concurrency}); "
               "only open-loop workloads can be merged")
    merged = sorted((r for w in workloads for r in w.requests), key=lambda r: r.arrival_time)
    requests = [replace(r, request_id=_request_id(i)) for i, r in enumerate(merged)]
    return Workload(name, requests, None, {"name": name, "combine": [w.spec for w in workloads]})


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class _Block:
    """``to_dict()`` of a dataclass block: its fields (tuples as lists), tagged with ``kind``."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind} if self.kind else {}
        out.update({f.name: jsonable(getattr(self, f.name)) for f in fields(self)})  # type: ignore[arg-type]
        return out


class LengthDist(_Block):
    """A distribution of token counts: ``sample(rng, n)`` gives ``n`` ints within ``bounds()``."""

    def bounds(self) -> tuple[int, int]:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError


def _check_range(cls: str, low: float, high: float, low_name: str = "low", high_name: str = "high") -> None:
    _check(low >= 0, f"{cls}.{low_name} must be >= 0, got {low}")
    _check(low <= high,
           f"{cls}.{low_name} must be <= {cls}.{high_name}, got {low_name}={low}, {high_name}={high}")


@dataclass(frozen=True)
class Fixed(LengthDist):
    """Always ``n``."""

    kind: ClassVar[str] = "fixed"
    n: int

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and self.n >= 0, f"Fixed.n must be an int >= 0, got {self.n!r}")

    def bounds(self) -> tuple[int, int]:
        return self.n, self.n

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.n, dtype=np.int64)


@dataclass(frozen=True)
class Uniform(LengthDist):
    """Uniform over the integers ``low..high``, both included."""

    kind: ClassVar[str] = "uniform"
    low: int
    high: int

    def __post_init__(self) -> None:
        _check(_is_int(self.low) and _is_int(self.high),
               f"Uniform.low and Uniform.high must be ints, got low={self.low!r}, high={self.high!r}")
        _check_range("Uniform", self.low, self.high)

    def bounds(self) -> tuple[int, int]:
        return self.low, self.high

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)


@dataclass(frozen=True)
class Normal(LengthDist):
    """Normal(mean, std), rounded to the nearest int and clipped to ``[low, high]``."""

    kind: ClassVar[str] = "normal"
    mean: float
    std: float
    low: int
    high: int

    def __post_init__(self) -> None:
        _check(self.std >= 0, f"Normal.std must be >= 0, got {self.std}")
        _check_range("Normal", self.low, self.high)

    def bounds(self) -> tuple[int, int]:
        return self.low, self.high

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(np.rint(rng.normal(self.mean, self.std, size=n)), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class LogNormal(LengthDist):
    """exp(Normal(log(median), sigma)), rounded and clipped to ``[low, high]``: a long right tail,
    the usual shape of real prompt and output lengths."""

    kind: ClassVar[str] = "lognormal"
    median: float
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        _check(self.median > 0, f"LogNormal.median must be > 0, got {self.median}")
        _check(self.sigma >= 0, f"LogNormal.sigma must be >= 0, got {self.sigma}")
        _check_range("LogNormal", self.low, self.high)

    def bounds(self) -> tuple[int, int]:
        return self.low, self.high

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        draws = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(draws), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class Explicit(LengthDist):
    """Given lengths. ``mode="cycle"`` (default) uses them in order, repeating the list (request i
    gets ``values[i % len(values)]``, no randomness); ``mode="sample"`` draws them uniformly with
    replacement."""

    kind: ClassVar[str] = "explicit"
    values: tuple[int, ...]
    mode: Literal["cycle", "sample"] = "cycle"

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        _check(len(self.values) >= 1, "Explicit.values must not be empty")
        _check(all(_is_int(v) and v >= 0 for v in self.values),
               f"Explicit.values must be ints >= 0, got {list(self.values)}")
        _check(self.mode in ("cycle", "sample"),
               f"Explicit.mode must be 'cycle' or 'sample', got {self.mode!r}")

    def bounds(self) -> tuple[int, int]:
        return min(self.values), max(self.values)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        values = np.asarray(self.values, dtype=np.int64)
        if self.mode == "cycle":
            return np.resize(values, n)
        return rng.choice(values, size=n)


class ArrivalProcess(_Block):
    """When requests arrive: ``arrival_times(rng, n)`` gives ``n`` sorted times >= 0, in seconds.

    Open-loop processes are renewal (or piecewise Poisson) processes started at t=0: the first
    request arrives after the first gap, not at t=0.
    """

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError


def _check_rate(cls: str, name: str, rate: float, allow_zero: bool = False) -> None:
    ok = (rate >= 0 if allow_zero else rate > 0) and math.isfinite(rate)
    _check(ok, f"{cls}.{name} must be {'>= 0' if allow_zero else '> 0'} and finite (req/s), got {rate}")


@dataclass(frozen=True)
class Poisson(ArrivalProcess):
    """Poisson arrivals at ``rate`` requests per second (exponential gaps)."""

    kind: ClassVar[str] = "poisson"
    rate: float

    def __post_init__(self) -> None:
        _check_rate("Poisson", "rate", self.rate)

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.cumsum(rng.exponential(1.0 / self.rate, size=n))


@dataclass(frozen=True)
class Gamma(ArrivalProcess):
    """Gamma-distributed gaps as in vLLM's benchmark_serving: shape ``burstiness``, scale
    ``1 / (rate * burstiness)``. The mean rate is ``rate``; burstiness 1 is Poisson, below 1 is
    burstier (coefficient of variation of the gaps = 1 / sqrt(burstiness))."""

    kind: ClassVar[str] = "gamma"
    rate: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        _check_rate("Gamma", "rate", self.rate)
        _check(self.burstiness > 0 and math.isfinite(self.burstiness),
               f"Gamma.burstiness must be > 0 and finite, got {self.burstiness}")

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        gaps = rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), size=n)
        return np.cumsum(gaps)


@dataclass(frozen=True)
class StepSurge(ArrivalProcess):
    """Poisson arrivals at a piecewise-constant rate: ``phases = ((duration_s, rate), ...)``.

    E.g. ``((60, 2), (20, 30), (60, 2))``: steady traffic, a surge, steady again. A phase may have
    rate 0 (silence, e.g. a wave that starts late), except the last. The last phase continues past
    its duration until all requests have arrived, so ``num_requests`` is always honoured; size it
    from the expected count ``sum(duration * rate)`` to end near the last phase's end.
    """

    kind: ClassVar[str] = "step_surge"
    phases: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", tuple(tuple(p) for p in self.phases))
        _check(len(self.phases) >= 1, "StepSurge.phases must not be empty")
        for i, phase in enumerate(self.phases):
            _check(len(phase) == 2, f"StepSurge.phases[{i}] must be (duration_s, rate), got {phase}")
            duration, rate = phase
            _check(duration > 0 and math.isfinite(duration),
                   f"StepSurge.phases[{i}] duration must be > 0 and finite, got {duration}")
            _check_rate("StepSurge", f"phases[{i}] rate", rate, allow_zero=i < len(self.phases) - 1)

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # Time rescaling: a unit-rate Poisson process mapped through the inverse of the cumulative
        # rate L(t) (piecewise linear, slope = the phase's rate) is Poisson with the phases' rates.
        masses = np.cumsum(rng.exponential(1.0, size=n))
        durations = np.array([d for d, _ in self.phases], dtype=np.float64)
        rates = np.array([r for _, r in self.phases], dtype=np.float64)
        phase_starts = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
        mass_starts = np.concatenate([[0.0], np.cumsum(durations * rates)[:-1]])
        # side="right" skips zero-rate phases: they end at the same mass as they start.
        phase = np.searchsorted(mass_starts, masses, side="right") - 1
        return phase_starts[phase] + (masses - mass_starts[phase]) / rates[phase]


@dataclass(frozen=True)
class AllAtOnce(ArrivalProcess):
    """Every request arrives at t=0 (open loop: the engine's queue holds them all)."""

    kind: ClassVar[str] = "all_at_once"

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.zeros(n)


@dataclass(frozen=True)
class ClosedLoop(ArrivalProcess):
    """Closed loop: arrival times are all 0 and the workload's ``concurrency`` is set; the driver
    keeps at most ``concurrency`` requests in flight, submitting in id order."""

    kind: ClassVar[str] = "closed_loop"
    concurrency: int

    def __post_init__(self) -> None:
        _check(_is_int(self.concurrency) and self.concurrency >= 1,
               f"ClosedLoop.concurrency must be an int >= 1, got {self.concurrency!r}")

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.zeros(n)


@dataclass(frozen=True)
class SharedPrefix(_Block):
    """``num_groups`` groups, each with its own ``prefix_len`` random tokens. Each request joins a
    group uniformly at random; its prompt is the group's prefix followed by its own suffix, whose
    length the spec's ``input_len`` gives (so a prompt has ``prefix_len + input_len`` tokens)."""

    num_groups: int
    prefix_len: int

    def __post_init__(self) -> None:
        _check(_is_int(self.num_groups) and self.num_groups >= 1,
               f"SharedPrefix.num_groups must be an int >= 1, got {self.num_groups!r}")
        _check(_is_int(self.prefix_len) and self.prefix_len >= 1,
               f"SharedPrefix.prefix_len must be an int >= 1, got {self.prefix_len!r}")


@dataclass(frozen=True)
class Priorities(_Block):
    """Each request gets one of ``levels`` with probability proportional to ``weights``."""

    levels: tuple[int, ...] = (0, 1)
    weights: tuple[float, ...] = (0.2, 0.8)

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        object.__setattr__(self, "weights", tuple(self.weights))
        _check(len(self.levels) >= 1, "Priorities.levels must not be empty")
        _check(all(_is_int(v) for v in self.levels),
               f"Priorities.levels must be ints, got {list(self.levels)}")
        _check(len(self.weights) == len(self.levels),
               f"Priorities.weights must have one weight per level ({len(self.levels)}), "
               f"got {len(self.weights)}")
        _check(all(w >= 0 and math.isfinite(w) for w in self.weights) and sum(self.weights) > 0,
               f"Priorities.weights must be finite, >= 0 and not all 0, got {list(self.weights)}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = np.asarray(self.weights, dtype=np.float64)
        return rng.choice(np.asarray(self.levels, dtype=np.int64), size=n, p=p / p.sum())


@dataclass(frozen=True)
class Aborts(_Block):
    """Exactly ``fraction * n`` (rounded half up) requests, chosen at random, are aborted by the client a
    uniform ``after = (low, high)`` seconds after their submission."""

    fraction: float
    after: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "after", tuple(self.after))
        _check(0 <= self.fraction <= 1, f"Aborts.fraction must be in [0, 1], got {self.fraction}")
        _check(len(self.after) == 2, f"Aborts.after must be (low, high) in seconds, got {self.after}")
        _check_range("Aborts", self.after[0], self.after[1], "after[0]", "after[1]")

    def sample(self, rng: np.random.Generator, n: int) -> list[float | None]:
        """Per request: seconds after submission at which it is aborted, or None."""
        count = math.floor(self.fraction * n + 0.5)
        chosen = rng.choice(n, size=count, replace=False)
        delays = rng.uniform(self.after[0], self.after[1], size=count)
        out: list[float | None] = [None] * n
        for index, delay in zip(chosen, delays, strict=True):
            out[int(index)] = float(delay)
        return out


_LENGTHS: dict[str, type[LengthDist]] = {c.kind: c for c in (Fixed, Uniform, Normal, LogNormal, Explicit)}
_ARRIVALS: dict[str, type[ArrivalProcess]] = {
    c.kind: c for c in (Poisson, Gamma, StepSurge, AllAtOnce, ClosedLoop)
}


def _block_from_dict(where: str, kinds: dict[str, type], data: dict[str, Any]) -> Any:
    data = dict(data)
    kind = data.pop("kind", None)
    _check(kind in kinds, f"WorkloadSpec.{where}: unknown kind {kind!r}, expected one of {sorted(kinds)}")
    return _construct(where, kinds[kind], data)


def _construct(where: str, cls: type, data: dict[str, Any]) -> Any:
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:  # TypeError: missing or unexpected fields
        raise ValueError(f"WorkloadSpec.{where}: {e}") from e


# --------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """A seeded workload description; ``build`` turns it into requests.

    ``input_len`` is the prompt length, or with ``shared_prefix`` the length of each request's
    own suffix after its group's prefix. ``output_len`` gives ``max_tokens``. With
    ``temperature > 0`` each request gets its own sampling seed, derived from ``seed``; with
    greedy decoding (temperature 0) ``seed`` is None.
    """

    name: str
    num_requests: int
    input_len: LengthDist
    output_len: LengthDist
    arrival: ArrivalProcess
    shared_prefix: SharedPrefix | None = None
    priorities: Priorities | None = None
    aborts: Aborts | None = None
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and self.name != "", "WorkloadSpec.name must be a non-empty string")
        _check(_is_int(self.num_requests) and self.num_requests >= 1,
               f"WorkloadSpec.num_requests must be an int >= 1, got {self.num_requests!r}")
        _check(isinstance(self.input_len, LengthDist),
               f"WorkloadSpec.input_len must be a length distribution, got {self.input_len!r}")
        _check(isinstance(self.output_len, LengthDist),
               f"WorkloadSpec.output_len must be a length distribution, got {self.output_len!r}")
        _check(isinstance(self.arrival, ArrivalProcess),
               f"WorkloadSpec.arrival must be an arrival process, got {self.arrival!r}")
        # Every request needs a token of its own: an empty prompt is invalid, and a prompt that is
        # only a shared prefix would be a 100% cache hit.
        for name in ("input_len", "output_len"):
            low = getattr(self, name).bounds()[0]
            _check(low >= 1, f"WorkloadSpec.{name} must give lengths >= 1, but its low bound is {low}")
        _check(self.temperature >= 0 and math.isfinite(self.temperature),
               f"WorkloadSpec.temperature must be >= 0 and finite, got {self.temperature}")
        _check(_is_int(self.seed) and self.seed >= 0,
               f"WorkloadSpec.seed must be an int >= 0, got {self.seed!r}")

    def max_prompt_len(self) -> int:
        """The longest prompt this spec can produce (prefix included)."""
        prefix = self.shared_prefix.prefix_len if self.shared_prefix else 0
        return prefix + self.input_len.bounds()[1]

    def build(self, vocab_size: int, reserved_low: int = 3, *, max_prompt_len: int | None = None) -> Workload:
        """The requests of this spec. Token ids are uniform in ``[reserved_low, vocab_size)``, so
        special ids below ``reserved_low`` never appear. ``max_prompt_len``, if given, is the
        engine's limit: a spec that could exceed it is rejected rather than silently truncated."""
        _check(_is_int(reserved_low) and reserved_low >= 0,
               f"build: reserved_low must be an int >= 0, got {reserved_low!r}")
        _check(_is_int(vocab_size) and vocab_size > reserved_low,
               f"build: vocab_size must be an int > reserved_low ({reserved_low}), got {vocab_size!r}")
        if max_prompt_len is not None:
            if self.shared_prefix is not None:
                _check(self.shared_prefix.prefix_len < max_prompt_len,
                       f"WorkloadSpec.shared_prefix.prefix_len ({self.shared_prefix.prefix_len}) must be < "
                       f"max_prompt_len ({max_prompt_len}) to leave room for each request's suffix")
            _check(self.max_prompt_len() <= max_prompt_len,
                   f"WorkloadSpec.input_len allows prompts of up to {self.max_prompt_len()} tokens "
                   f"(prefix included), more than max_prompt_len ({max_prompt_len})")

        n = self.num_requests
        suffix_lens = self.input_len.sample(_stream(self.seed, "input_len"), n)
        max_tokens = self.output_len.sample(_stream(self.seed, "output_len"), n)
        token_rng = _stream(self.seed, "prompt_tokens")
        tokens = token_rng.integers(reserved_low, vocab_size, size=int(suffix_lens.sum()))
        suffixes = np.split(tokens, np.cumsum(suffix_lens)[:-1])
        arrivals = self.arrival.arrival_times(_stream(self.seed, "arrival"), n)

        prefixes: list[list[int]] = [[] for _ in range(n)]
        groups: list[str | None] = [None] * n
        if self.shared_prefix is not None:
            sp = self.shared_prefix
            group_tokens = _stream(self.seed, "prefix_tokens").integers(
                reserved_low, vocab_size, size=(sp.num_groups, sp.prefix_len)
            ).tolist()
            # Named after the spec so that combine() never merges two workloads' groups.
            for i, g in enumerate(_stream(self.seed, "prefix_groups").integers(0, sp.num_groups, size=n)):
                prefixes[i], groups[i] = group_tokens[g], f"{self.name}/g{g}"

        priorities = (self.priorities.sample(_stream(self.seed, "priorities"), n).tolist()
                      if self.priorities else [0] * n)
        aborts = self.aborts.sample(_stream(self.seed, "aborts"), n) if self.aborts else [None] * n
        seeds: list[int | None] = (_stream(self.seed, "sampling").integers(0, 2**31 - 1, size=n).tolist()
                                   if self.temperature > 0 else [None] * n)

        # Arrival times come out sorted, so generation order is arrival order; the stable sort
        # only guards processes that might not be.
        order = np.argsort(arrivals, kind="stable")
        requests = [
            WorkloadRequest(
                request_id=_request_id(rank),
                prompt_token_ids=prefixes[i] + suffixes[i].tolist(),
                max_tokens=int(max_tokens[i]),
                arrival_time=float(arrivals[i]),
                priority=int(priorities[i]),
                abort_at=aborts[i],
                temperature=float(self.temperature),
                seed=seeds[i],
                group=groups[i],
            )
            for rank, i in enumerate(order)
        ]
        concurrency = self.arrival.concurrency if isinstance(self.arrival, ClosedLoop) else None
        build = {"vocab_size": vocab_size, "reserved_low": reserved_low, "max_prompt_len": max_prompt_len}
        return Workload(self.name, requests, concurrency, {**self.to_dict(), "build": build})

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable; ``WorkloadSpec.from_dict(spec.to_dict()) == spec``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, _Block) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkloadSpec:
        """Inverse of ``to_dict``. Also accepts a built ``Workload.spec`` (its ``build`` key, the
        build arguments, is ignored: pass them to ``build`` again)."""
        data = {k: v for k, v in data.items() if k != "build"}
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        _check(not unknown, f"WorkloadSpec.from_dict: unknown fields {unknown}")
        data["input_len"] = _block_from_dict("input_len", _LENGTHS, data.get("input_len") or {})
        data["output_len"] = _block_from_dict("output_len", _LENGTHS, data.get("output_len") or {})
        data["arrival"] = _block_from_dict("arrival", _ARRIVALS, data.get("arrival") or {})
        for name, block in (("shared_prefix", SharedPrefix), ("priorities", Priorities), ("aborts", Aborts)):
            if data.get(name) is not None:
                data[name] = _construct(name, block, data[name])
        return _construct_spec(cls, data)


def _construct_spec(cls: type[WorkloadSpec], data: dict[str, Any]) -> WorkloadSpec:
    try:
        return cls(**data)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"WorkloadSpec.from_dict: {e}") from e


__all__ = [
    "Aborts",
    "AllAtOnce",
    "ArrivalProcess",
    "ClosedLoop",
    "Explicit",
    "Fixed",
    "Gamma",
    "LengthDist",
    "LogNormal",
    "Normal",
    "Poisson",
    "Priorities",
    "SharedPrefix",
    "StepSurge",
    "Uniform",
    "Workload",
    "WorkloadRequest",
    "WorkloadSpec",
    "combine",
]
