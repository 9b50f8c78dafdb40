"""The counter contract: every counter kvbench reads from an engine, with one meaning each.

An adapter fills a :class:`Counters` from whatever the engine exposes (its stats, its events, a
server's ``/metrics``). A field left ``None`` means "the engine does not expose it": never 0, which
would claim that nothing happened. Checks prove mechanisms from these fields, metrics prefer them
over what the trace saw from outside, and the report shows "not exposed" for ``None``.

The table :data:`COUNTER_SPECS` is the documentation (docs/engines.md renders it): a name means exactly
what its row says in every adapter. ``python -m kvbench.core.counters`` prints it as Markdown.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class CounterSpec:
    name: str
    unit: str
    meaning: str


#: name, unit and exact meaning of every counter. Cumulative over one run unless it says otherwise.
COUNTER_SPECS: tuple[CounterSpec, ...] = (
    CounterSpec("preemptions_recompute", "events",
                "preemptions whose victim's KV was discarded, to be computed again on resume "
                "(swap fallbacks included)"),
    CounterSpec("preemptions_swap", "events", "preemptions whose victim's KV was copied to host memory"),
    CounterSpec("preemptions_total", "events",
                "preemptions of every mode as the engine's own single total (vLLM's vllm:num_preemptions_total), "
                "where it keeps one beside by-mode counts of its own: it must equal their sum. Where the total is "
                "the only preemption count and is read as one mode's count (vLLM v1), it is told once and not "
                "exposed here"),
    CounterSpec("swap_outs", "requests", "requests whose KV blocks were copied device -> host"),
    CounterSpec("swap_ins", "requests", "requests whose KV blocks were copied host -> device on resume"),
    CounterSpec("swap_fallbacks", "events",
                "preemptions that asked for swap but recomputed because the host pool was full"),
    CounterSpec("swapped_out_bytes", "bytes", "KV bytes copied device -> host"),
    CounterSpec("swapped_in_bytes", "bytes", "KV bytes copied host -> device"),
    CounterSpec("swap_seconds", "seconds", "wall time spent copying KV between the pools, both directions"),
    CounterSpec("prefix_cache_queries", "tokens",
                "tokens looked up in the prefix cache: the request's whole sequence at each admission (its prompt, "
                "plus the tokens it generated before a recompute preemption when admitted again), as vLLM v1 "
                "counts them"),
    CounterSpec("prefix_cache_hits", "tokens", "looked-up tokens whose KV was served from the prefix cache"),
    CounterSpec("prefill_chunks", "pieces",
                "prefill pieces that ended before the request's prompt (or recomputed context) was complete: "
                "a prefill computed in k pieces counts k - 1, an unsplit prefill 0"),
    CounterSpec("computed_tokens", "tokens", "tokens whose KV the model computed (prefill, recompute and decode)"),
    CounterSpec("recomputed_tokens", "tokens",
                "tokens computed again because a recompute preemption discarded their KV, "
                "not counting tokens served from the prefix cache on resume"),
    CounterSpec("generated_tokens", "tokens", "output tokens sampled"),
    CounterSpec("prompt_tokens", "tokens",
                "prompt tokens of the requests the engine began to answer, counted once per request when its first "
                "output token is sampled, whether computed or served from the prefix cache (vLLM's "
                "vllm:prompt_tokens_total)"),
    CounterSpec("finished_length", "requests",
                "requests the engine finished at their max_tokens or the model's length "
                "(vllm:request_success_total{finished_reason=\"length\"})"),
    CounterSpec("finished_stop", "requests",
                "requests the engine finished at a stop token or EOS "
                "(vllm:request_success_total{finished_reason=\"stop\"})"),
    CounterSpec("request_preemptions", "events",
                "preemptions summed over the requests that finished, each request's own count (vLLM's "
                "vllm:request_num_preemptions histogram sum): the preemptions told a second time, per request"),
    CounterSpec("aborts", "requests", "requests the engine aborted on the client's request while in flight"),
    CounterSpec("leaked_blocks", "blocks",
                "device + host blocks still held by a request after every request finished (a gauge at the end)"),
    CounterSpec("num_gpu_blocks", "blocks", "size of the device KV pool (configuration)"),
    CounterSpec("num_cpu_blocks", "blocks", "size of the host (swap) pool (configuration)"),
)

COUNTER_NAMES: tuple[str, ...] = tuple(s.name for s in COUNTER_SPECS)
_SPECS = {s.name: s for s in COUNTER_SPECS}


@dataclass(frozen=True)
class Counters(Mapping[str, float]):
    """One run's counters. ``None`` = not exposed by the engine.

    Read like a mapping of the *exposed* counters (``"swap_ins" in counters``, ``counters["swap_ins"]``,
    ``counters.get("swap_ins")``), so a missing counter can never read as zero by accident.
    """

    preemptions_recompute: int | None = None
    preemptions_swap: int | None = None
    preemptions_total: int | None = None
    swap_outs: int | None = None
    swap_ins: int | None = None
    swap_fallbacks: int | None = None
    swapped_out_bytes: int | None = None
    swapped_in_bytes: int | None = None
    swap_seconds: float | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    prefill_chunks: int | None = None
    computed_tokens: int | None = None
    recomputed_tokens: int | None = None
    generated_tokens: int | None = None
    prompt_tokens: int | None = None
    finished_length: int | None = None
    finished_stop: int | None = None
    request_preemptions: int | None = None
    aborts: int | None = None
    leaked_blocks: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"counter {f.name!r} must be a number or None (not exposed), got {value!r}")
            if value < 0:
                raise ValueError(f"counter {f.name!r} must be >= 0, got {value}")

    # Mapping over the exposed counters only
    def __getitem__(self, name: str) -> float:
        if name not in _SPECS:
            raise KeyError(f"{name!r} is not a counter of the contract; known: {', '.join(COUNTER_NAMES)}")
        value = getattr(self, name)
        if value is None:
            raise KeyError(f"counter {name!r} is not exposed by this engine")
        return value

    def __iter__(self) -> Iterator[str]:
        return (n for n in COUNTER_NAMES if getattr(self, n) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def preemptions(self) -> int | None:
        """Preemptions of both modes; None when either mode is not exposed."""
        if self.preemptions_recompute is None or self.preemptions_swap is None:
            return None
        return self.preemptions_recompute + self.preemptions_swap

    def to_dict(self) -> dict[str, float | None]:
        """Every counter of the contract, ``None`` where not exposed (the results schema)."""
        return {n: getattr(self, n) for n in COUNTER_NAMES}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Counters:
        """From a results file or an adapter's table. Unknown names are refused, naming them."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(COUNTER_NAMES))
        if unknown:
            raise ValueError(f"unknown counter(s) {unknown}; the contract has: {', '.join(COUNTER_NAMES)}")
        return cls(**{k: v for k, v in data.items() if v is not None})

    def minus(self, before: Counters) -> Counters:
        """What happened between two snapshots of cumulative counters (a server scraped before and after
        a run). Configuration and end-of-run gauges are taken from ``self``."""
        gauges = {"leaked_blocks", "num_gpu_blocks", "num_cpu_blocks"}
        out: dict[str, float | None] = {}
        for n in COUNTER_NAMES:
            now, then = getattr(self, n), getattr(before, n)
            out[n] = now if n in gauges or now is None else (None if then is None else now - then)
        return Counters(**out)


def spec(name: str) -> CounterSpec:
    """The contract's row for ``name`` (KeyError naming the known counters otherwise)."""
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a counter of the contract; known: {', '.join(COUNTER_NAMES)}") from None


def markdown_table() -> str:
    """The contract as the table in docs/engines.md."""
    rows = ["| counter | unit | meaning |", "|---|---|---|"]
    rows += [f"| `{s.name}` | {s.unit} | {s.meaning} |" for s in COUNTER_SPECS]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
