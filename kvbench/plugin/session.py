"""The session object: options parsed once in ``pytest_configure`` into one :class:`KvbenchSession`,
kept in the config's stash, plus what the run produces (results, report, regressions). Also the small
lookups every part of the plugin shares (the session of a config, an item's engine spec, whether a run
is an xdist worker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbench.engines.registry import EngineSpec, EngineSpecError, adapter_class

SESSION_KEY = pytest.StashKey["KvbenchSession"]()


@dataclass
class KvbenchSession:
    """Options parsed once, plus what the run produces (results, report, regressions)."""

    engine_specs: list[EngineSpec]
    benchmark: bool = False
    scale: str = "quick"
    report_dir: Path = Path("reports")
    baseline: Path | None = None
    thresholds: list[str] = field(default_factory=list)
    slos: str | None = None
    model: str | None = None
    run_name: str = ""
    results: Any = None  # kvbench.bench.results.Results, created on first use
    report_path: Path | None = None
    regressions: list[Any] = field(default_factory=list)
    gate_error: str | None = None
    repeats: int = 3  # timed repeats of every benchmark job (--benchmark-repeats)
    gate_absolute: bool = False
    gate_noise_k: float = 3.0
    verdict: Any = None  # kvbench.bench.gate.Verdict when --baseline was given
    near_ties: list[str] = field(default_factory=list)  # conformance divergences excused as near-ties
    near_tie_tolerance: float | None = None  # --kvbench-near-tie-tolerance; None: the engine's dtype decides
    conformance: dict[str, dict[str, Any]] = field(default_factory=dict)  # nodeid -> record, in run order
    results_path: Path | None = None  # where results.json was written (with or without a report)
    liveness: Any = None  # kvbench.core.liveness.Liveness every engine runs under
    expectations: list[Any] = field(default_factory=list)  # kvbench.conformance.expectations.Expectation
    findings: list[str] = field(default_factory=list)  # expected failures seen, and ones that now pass

    def get_results(self):
        if self.results is None:
            from kvbench.bench.results import Results

            self.results = Results()
            self.results.data["command"] = self.redacted(self.results.data.get("command") or "")
        return self.results

    def redacted(self, text: str) -> str:
        """``text`` (the command line, or anything quoting an ``--engine`` value) with the value of every
        secret option of the session's engines replaced by ``***``: results files are shared."""
        from kvbench.engines.base import REDACTED

        values = {spec.options[key] for spec in self.engine_specs for key in spec.secret
                  if spec.options.get(key)}
        for value in sorted(values, key=len, reverse=True):
            text = text.replace(value, REDACTED)
        return text


def session_of(config: pytest.Config) -> KvbenchSession:
    return config.stash[SESSION_KEY]


def is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def engine_spec_of(item: pytest.Item) -> EngineSpec | None:
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get("engine_spec") if callspec is not None else None
    return spec if isinstance(spec, EngineSpec) else None


def is_simulator(spec: EngineSpec) -> bool:
    """Whether ``spec`` names a simulator (:attr:`kvbench.engines.base.EngineAdapter.simulated`)."""
    try:
        return adapter_class(spec.kind).simulated
    except EngineSpecError:
        return False

