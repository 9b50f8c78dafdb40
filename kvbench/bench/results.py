"""One versioned JSON schema for results: written by the plugin, read by the report, the CLI and the gate.

Nothing downstream of a results file re-runs an engine: it holds every figure and timeline the
report draws. Skeleton (``schema_version`` 1)::

    {
      "schema_version": 1,
      "kvbench_version": "0.1.0",
      "created": "2025-01-31T12:00:00+00:00",
      "machine": {"hostname": "...", "platform": "...", "python": "3.11.9", "cpu_count": 2,
                  "torch": "2.13.0", "device": "cpu"},
      "commit": {"id": "abc123...", "branch": "main", "dirty": false},   # nulls without git
      "command": "pytest suites/benchmarks --benchmark --engine reference",  # null in older files
      "engines": [{"name": "reference", "kind": "reference", "options": {}, "capabilities": ["swap", ...]}],
      "scenarios": [{
        "name": "preemption_storm",
        "description": "concurrency swept past capacity",
        "parameters": {"num_gpu_blocks": 64, "block_size": 16, ...},
        "results": [{"engine": "reference", "mode": null,
                     "metrics": {"output_throughput": 812.5, "tbt_p99": 0.09, ...},   # metrics.summarize
                     "series": {"t": [...], "kv_usage": [...], ...},                # metrics.series
                     "checks": {"preemptions happened": true},
                     "undecided": {"a claim": "not exposed: why it could not be decided"},
                     "undecided_kinds": {"a claim": "not exposed"},  # or "did not fire", "not reached"
                     "claim_evidence": {"preemptions happened": "the preemption counter moved by 17 over the run"},
                     "notes": ["..."],
                     "repeats": [{"output_throughput": 800.1, ...}, ...],  # every repeat's values
                     "spread": {"output_throughput": 6.2, ...},            # kvbench.bench.repeats.spread
                     "clock": {"clock": "step", "step_seconds": 0.01, "exact_counts": true},
                     "counters": {"preemptions_recompute": 17, "aborts": null, ...},  # Counters.to_dict()
                     "delivery": {"tokens_per_chunk": 1.1, "bursty": false, "why": "..."},  # optional (older: absent)
                     "sampler_cost": {"status": "measured", "tbt_p99": 0.041, "tbt_p99_clear": 0.028,  # optional
                                      "scrapes": 142, "stall_share": 0.02, "moved": true, ...},  # (older: absent)
                     "settings": {"asked": {"block_size": 16, ...}, "confirmed": {...},  # optional (older: absent)
                                  "launch": ["python", "-m", "..."], "package": "kvbench", "version": "0.1.0"}}],
        "sweeps": [{"name": "concurrency", "x_label": "concurrent requests",
                    "points": [{"x": 8, "engine": "reference", "mode": "recompute",
                                "metrics": {"output_throughput": 700.0, ...},
                                "repeats": [...], "spread": {...}}]}],
        "settings": [{"engine": "reference", "modes": [], "asked": {...}, ...}]   # optional (older: absent)
      }],
      "skipped_scenarios": [{"scenario": "swap_vs_recompute", "engine": "server:preset=vllm",
                             "reason": "server:preset=vllm lacks capability events"}],   # optional (older: [])
      "conformance": [{                       # one record per engine x check; optional (older files: [])
        "engine": "reference:preemption_mode=swap", "kind": "reference",
        "check": "recompute_preemption_equivalence",        # see kvbench.plugin.check_id
        "nodeid": "suites/conformance/test_equivalence.py::test_recompute_preemption_equivalence[...]",
        "outcome": "passed",                  # passed|failed|skipped|xfailed|xpassed|error
        "evidence": {"preemptions_recompute": 31},          # the counters prove() saw
        "near_ties": 0,                       # divergences excused as near-ties
        "reason": null,                       # skip / xfail / failure reason, one line
        "knob_overrides": {"preemption_mode": ["swap", "recompute"]}}]   # option given, value used
    }

Repeats: a timed point served several times keeps every repeat's figures in ``repeats``, their
medians in ``metrics`` (what the report shows) and their spreads in ``spread`` (the gate's noise
floor, :mod:`kvbench.bench.gate`). ``clock`` says how arrivals were released: ``"step"`` (by engine
step, ``step_seconds`` virtual seconds each: counts repeat exactly when ``exact_counts``) or
``"wall"``; ``interleaved`` lists the engines whose repeats were served in the same rounds as this
one's (repeat i of each next to repeat i of the others, what the gate's per-repeat ratios pair;
:func:`kvbench.bench.scenarios.run_interleaved`), empty when it ran alone or absent in older files.
Files written before repeats existed have ``repeats: []``, ``spread: {}``, ``clock: null``.

Settings (:mod:`kvbench.bench.job_settings`): a result's ``settings`` is what the job behind it ran with:
``asked`` (the knobs the adapter received), ``confirmed`` (what the engine itself states; absent where it could not
be read), ``launch`` (a launched server's command, secrets as ``***``), ``package``/``version`` and ``dtype`` where
known. A scenario's ``settings`` lists each distinct record once per engine, with the ``modes`` of the jobs that ran
it (a sweep's points share one). Files written before either existed have neither; readers take that as unknown.

Undecided claims: ``undecided`` says why in words, ``undecided_kinds`` which way the claim stayed open
(:data:`kvbench.bench.scenarios.claims.KINDS`): ``"not exposed"`` (the engine publishes nothing that tells),
``"did not fire"`` (it does, and the counter did not move), ``"not reached"`` (the workload did not reach the
pressure it was built for on this engine). ``skipped_scenarios`` lists each scenario a run did not measure on an
engine, or measured without deciding any claim of (its results are kept), with the reason the test was skipped.

Conventions the report relies on: ``mode`` names a variant of one engine inside a scenario
(``"recompute"``/``"swap"``, ``"chunked"``/``"unchunked"``, ``"prefix_caching"``/``"no_prefix_caching"``);
a swap-vs-recompute sweep has ``x`` = sequence length and a cost metric named in
:data:`COST_METRICS`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import __version__
from kvbench.core.counters import Counters
from kvbench.core.jsonable import jsonable

SCHEMA_VERSION = 1
#: metric names a swap-vs-recompute sweep may use for "cost of one preempt-and-resume", by preference
COST_METRICS: tuple[str, ...] = ("cost_s", "preempt_resume_s", "resume_s", "e2e_mean", "e2e_p50")


#: outcomes a conformance record may have (pytest's, with strict-xfail passes as "xpassed")
CONFORMANCE_OUTCOMES: tuple[str, ...] = ("passed", "failed", "skipped", "undecided", "xfailed", "xpassed", "error")
#: which way an undecided claim stayed open (kvbench.bench.scenarios.claims.KINDS, restated here so that
#: reading a results file needs no scenario)
UNDECIDED_KINDS: tuple[str, ...] = ("not exposed", "did not fire", "not reached")


class ResultsError(ValueError):
    """A results file is unreadable, of another schema version, or malformed."""


# --------------------------------------------------------------------------------------------
# machine and commit


def machine_info(device: str | None = None) -> dict[str, Any]:
    """Where the numbers were measured.

    ``device`` is what the caller ran on ("cpu", "cuda:0 NVIDIA H100"...). Without it: the CUDA
    device name when torch is *already imported* and sees CUDA, else "cpu". torch is never
    imported here (it takes seconds and the CLI does not need it); its version comes from the
    installed distribution's metadata.
    """
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    if device is None:
        device = "cpu"
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_available():
                device = f"cuda ({torch.cuda.get_device_name(0)})"
        except Exception:  # a broken CUDA setup must not break writing results
            device = "cpu"
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch": torch_version, "device": device}


def _git(args: list[str], cwd: str | os.PathLike[str] | None) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def commit_info(cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``{"id", "branch", "dirty"}`` of the git checkout at ``cwd``; all None without git or a repo."""
    commit = _git(["rev-parse", "HEAD"], cwd)
    if not commit:
        return {"id": None, "branch": None, "dirty": None}
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return {"id": commit, "branch": _git(["rev-parse", "--abbrev-ref", "HEAD"], cwd),
            "dirty": None if status is None else bool(status)}


def command_line(argv: list[str] | None = None) -> str:
    """The command that is writing these results, as a reader would type it again (``sys.argv`` by default):
    pytest's and kvbench's entry points (a console script or ``python -m``) are named ``pytest`` and
    ``kvbench``; any other program by its file name."""
    import shlex

    words = list(sys.argv if argv is None else argv)
    if not words:
        return ""
    head = Path(words[0])
    if head.name in ("pytest", "py.test") or (head.name == "__main__.py" and head.parent.name == "pytest"):
        words[0] = "pytest"
    elif head.name == "kvbench" or (head.name == "__main__.py" and head.parent.name == "kvbench"):
        words[0] = "kvbench"
    else:
        words[0] = head.name
    return shlex.join(words)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# the results object


class Results:
    """The results of one run: engines, scenarios with per-engine results and sweeps.

    Build with :meth:`add_engine`, :meth:`add_scenario_result` (or :meth:`add_trace`) and
    :meth:`add_sweep_point`; persist with :meth:`save` / :meth:`load`. ``data`` is the plain
    JSON-shaped dict, always valid against ``SCHEMA_VERSION``.
    """

    def __init__(self, data: dict[str, Any] | None = None, *, device: str | None = None,
                 cwd: str | os.PathLike[str] | None = None):
        if data is None:
            data = {"schema_version": SCHEMA_VERSION, "kvbench_version": __version__, "created": _now(),
                    "machine": machine_info(device), "commit": commit_info(cwd), "command": command_line(),
                    "engines": [],
                    "scenarios": [], "conformance": [], "skipped_scenarios": []}
        self.data = validate(data)

    # -- building ---------------------------------------------------------------------------

    def add_engine(self, engine: Mapping[str, Any] | str) -> dict[str, Any]:
        """Register an engine (an adapter's ``describe()`` dict, or a bare name); idempotent by name."""
        desc = {"name": engine} if isinstance(engine, str) else dict(engine)
        if not desc.get("name"):
            raise ResultsError(f"an engine needs a non-empty 'name', got {desc!r}")
        for existing in self.data["engines"]:
            if existing["name"] == desc["name"]:
                for key, value in desc.items():  # later, fuller descriptions fill in the gaps
                    if value not in (None, {}, []):
                        existing[key] = jsonable(value)
                return existing
        full = {"name": str(desc["name"]), "kind": desc.get("kind"), "options": dict(desc.get("options") or {}),
                "capabilities": sorted(desc.get("capabilities") or [])}
        full.update({k: v for k, v in desc.items() if k not in full})
        full = jsonable(full)
        self.data["engines"].append(full)
        return full

    def scenario(self, name: str, *, create: bool = False, parameters: Mapping[str, Any] | None = None,
                 description: str | None = None) -> dict[str, Any]:
        """The scenario dict called ``name`` (created when ``create``; parameters/description merged in)."""
        for sc in self.data["scenarios"]:
            if sc["name"] == name:
                break
        else:
            if not create:
                raise KeyError(f"no scenario {name!r} in results (have: {', '.join(self.scenario_names())})")
            sc = {"name": name, "description": "", "parameters": {}, "results": [], "sweeps": []}
            self.data["scenarios"].append(sc)
        if parameters:
            sc["parameters"].update(jsonable(dict(parameters)))
        if description:
            sc["description"] = description
        return sc

    def add_scenario_result(self, scenario: str, engine: Mapping[str, Any] | str, metrics: Mapping[str, Any], *,
                            series: Mapping[str, list] | None = None, checks: Mapping[str, bool] | None = None,
                            undecided: Mapping[str, str] | None = None, notes: list[str] | None = None,
                            mode: str | None = None,
                            parameters: Mapping[str, Any] | None = None,
                            description: str | None = None, repeats: list[Mapping[str, Any]] | None = None,
                            spread: Mapping[str, float] | None = None,
                            clock: Mapping[str, Any] | None = None,
                            counters: Counters | Mapping[str, Any] | None = None,
                            undecided_kinds: Mapping[str, str] | None = None,
                            claim_evidence: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Add (or replace) the result of ``engine`` (in ``mode``) on ``scenario``; returns the entry.

        ``counters`` (the engine's own: :class:`~kvbench.core.counters.Counters` or a mapping of its
        names) is stored as ``Counters.to_dict()``, every counter of the contract with null = not
        exposed; omitted, the entry's ``counters`` is null (not recorded).

        ``checks`` are the claims decided (True held, False failed); ``undecided`` the claims that could not
        be decided, each with its reason: never counted as passed; ``undecided_kinds`` which way each stayed open
        (one of :data:`UNDECIDED_KINDS`; ResultsError naming the claim otherwise); ``claim_evidence`` what each
        decided check was decided on, in words, where its judge said.

        ``metrics`` are the figures shown (the medians when the point was repeated); ``repeats`` every
        repeat's figures, ``spread`` their spreads, ``clock`` how arrivals were released (module docstring).
        """
        name = self.add_engine(engine)["name"]
        sc = self.scenario(scenario, create=True, parameters=parameters, description=description)
        entry = jsonable({"engine": name, "mode": mode, "metrics": dict(metrics), "series": dict(series or {}),
                           "checks": {str(k): bool(v) for k, v in (checks or {}).items()},
                           "undecided": {str(k): str(v) for k, v in (undecided or {}).items()},
                           "undecided_kinds": _undecided_kinds(undecided_kinds, f"{scenario} [{name}]"),
                           "claim_evidence": {str(k): str(v) for k, v in (claim_evidence or {}).items()},
                           "notes": [str(n) for n in (notes or [])],
                           "repeats": [dict(r) for r in (repeats or [])], "spread": dict(spread or {}),
                           "clock": dict(clock) if clock else None,
                           "counters": None if counters is None else _as_counters(counters).to_dict()})
        sc["results"] = [r for r in sc["results"] if (r["engine"], r.get("mode")) != (name, mode)]
        sc["results"].append(entry)
        return entry

    def add_skipped_scenario(self, scenario: str, engine: Mapping[str, Any] | str, reason: str) -> dict[str, Any]:
        """Note that ``scenario`` was not measured on ``engine`` (or measured without deciding anything), and
        why: the skip's reason. Replaces an earlier note of the same pair; returns the entry."""
        name = self.add_engine(engine)["name"]
        if not scenario or not str(reason).strip():
            raise ResultsError(f"a skipped scenario needs a 'scenario' and a 'reason', got {scenario!r}, {reason!r}")
        entry = {"scenario": str(scenario), "engine": name, "reason": str(reason)}
        self.data["skipped_scenarios"] = [s for s in self.data["skipped_scenarios"]
                                          if (s["scenario"], s["engine"]) != (entry["scenario"], name)] + [entry]
        return entry

    def add_trace(self, trace: Any, *, engine: Mapping[str, Any] | str | None = None,
                  slos: str | Mapping[str, float] | None = None, **kwargs: Any) -> dict[str, Any]:
        """Summarize a :class:`~kvbench.core.trace.Trace` and add it under its scenario and engine,
        with the engine's counters."""
        from kvbench.bench import metrics  # local: results files are read without numpy-heavy work
        from kvbench.core import delivery

        kwargs.setdefault("counters", trace.counters)
        entry = self.add_scenario_result(trace.scenario, engine or trace.engine, metrics.summarize(trace, slos),
                                         series=metrics.series(trace), **kwargs)
        if (how := delivery.of_traces([trace])) is not None:
            entry["delivery"] = how
        from kvbench.bench import sampler_cost

        entry["sampler_cost"] = sampler_cost.measure(trace)
        return entry

    def add_sweep_point(self, scenario: str, sweep: str, x: float, engine: Mapping[str, Any] | str,
                        metrics: Mapping[str, Any], *, mode: str | None = None,
                        x_label: str | None = None, repeats: list[Mapping[str, Any]] | None = None,
                        spread: Mapping[str, float] | None = None) -> dict[str, Any]:
        """Add one point of sweep ``sweep`` (e.g. "concurrency", "seq_len") to ``scenario``."""
        name = self.add_engine(engine)["name"]
        sc = self.scenario(scenario, create=True)
        for sw in sc["sweeps"]:
            if sw["name"] == sweep:
                break
        else:
            sw = {"name": sweep, "x_label": x_label or sweep, "points": []}
            sc["sweeps"].append(sw)
        if x_label:
            sw["x_label"] = x_label
        point = jsonable({"x": x, "engine": name, "mode": mode, "metrics": dict(metrics),
                           "repeats": [dict(r) for r in (repeats or [])], "spread": dict(spread or {})})
        sw["points"].append(point)
        return point

    def add_conformance(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Add (or replace, by ``nodeid``) one conformance outcome; returns the validated record."""
        entry = _conformance_record(jsonable(dict(record)), len(self.data["conformance"]))
        self.data["conformance"] = [r for r in self.data["conformance"] if r["nodeid"] != entry["nodeid"]]
        self.data["conformance"].append(entry)
        return entry

    # -- reading ----------------------------------------------------------------------------

    @property
    def conformance(self) -> list[dict[str, Any]]:
        """The conformance records (engine x check outcomes), in the order the tests ran."""
        return self.data["conformance"]

    @property
    def skipped_scenarios(self) -> list[dict[str, Any]]:
        """``{"scenario", "engine", "reason"}`` of every scenario the run skipped on an engine, in order."""
        return self.data["skipped_scenarios"]

    @property
    def engines(self) -> list[dict[str, Any]]:
        return self.data["engines"]

    @property
    def scenarios(self) -> list[dict[str, Any]]:
        return self.data["scenarios"]

    @property
    def machine(self) -> dict[str, Any]:
        return self.data["machine"]

    def scenario_names(self) -> list[str]:
        return [sc["name"] for sc in self.data["scenarios"]]

    def engine_names(self) -> list[str]:
        return [e["name"] for e in self.data["engines"]]

    def engine(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.data["engines"] if e["name"] == name), None)

    def iter_results(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """(scenario, result) pairs in file order."""
        for sc in self.data["scenarios"]:
            for res in sc["results"]:
                yield sc, res

    def result(self, scenario: str, engine: str, mode: str | None = None) -> dict[str, Any] | None:
        for sc, res in self.iter_results():
            if sc["name"] == scenario and res["engine"] == engine and res.get("mode") == mode:
                return res
        return None

    def counters(self, scenario: str, engine: str, mode: str | None = None) -> Counters | None:
        """The engine's own counters recorded with a result, read through the contract (``None`` when
        the result, or its counters, were not recorded: files written before the contract have none)."""
        res = self.result(scenario, engine, mode)
        return None if res is None else result_counters(res)

    def to_frame(self) -> pd.DataFrame:
        """One row per scenario x engine (x mode): ``scenario``, ``engine``, ``mode``, ``checks_passed``,
        ``checks_total``, then one column per metric (NaN where absent)."""
        rows = []
        for sc, res in self.iter_results():
            checks = res.get("checks", {})
            rows.append({"scenario": sc["name"], "engine": res["engine"], "mode": res.get("mode"),
                         "checks_passed": sum(bool(v) for v in checks.values()), "checks_total": len(checks),
                         **{k: (math.nan if v is None else v) for k, v in res.get("metrics", {}).items()}})
        base = ["scenario", "engine", "mode", "checks_passed", "checks_total"]
        return pd.DataFrame(rows, columns=base if not rows else None)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    # -- persistence ------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write JSON atomically (a reader never sees half a file), mode 0644 like the report beside it
        (mkstemp's 0600 would hide results from a CI artifact step or a colleague); creates parent folders."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(jsonable(self.data), indent=1, allow_nan=False, sort_keys=False)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Results:
        """Read a results file. Raises FileNotFoundError, or :class:`ResultsError` naming the file and
        what is wrong with it (not JSON, another ``schema_version``, a missing section)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ResultsError(f"{path}: not a kvbench results file (invalid JSON: {e})") from e
        try:
            return cls(validate(data))
        except ResultsError as e:
            raise ResultsError(f"{path}: {e}") from e

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Results:
        return cls(validate(data))


def _undecided_kinds(kinds: Mapping[str, Any] | None, where: str) -> dict[str, str]:
    """``{claim: kind}`` checked against :data:`UNDECIDED_KINDS` (ResultsError naming the claim otherwise)."""
    out = {}
    for claim, kind in (kinds or {}).items():
        if kind not in UNDECIDED_KINDS:
            raise ResultsError(f"{where}: undecided_kinds[{claim!r}] must be one of {', '.join(UNDECIDED_KINDS)}, "
                               f"got {kind!r}")
        out[str(claim)] = str(kind)
    return out


def _as_counters(counters: Counters | Mapping[str, Any]) -> Counters:
    return counters if isinstance(counters, Counters) else Counters.from_dict(counters)


def result_counters(result: Mapping[str, Any]) -> Counters | None:
    """A result entry's ``counters`` read through the contract (None when not recorded)."""
    raw = result.get("counters")
    return None if raw is None else Counters.from_dict(raw)


def validate(data: Any) -> dict[str, Any]:
    """Check the shape of a results dict and fill optional parts; returns it. Raises ResultsError."""
    if not isinstance(data, dict):
        raise ResultsError(f"expected a JSON object at the top level, got {type(data).__name__}")
    if "schema_version" not in data:
        raise ResultsError("no 'schema_version': not a kvbench results file")
    version = data["schema_version"]
    if version != SCHEMA_VERSION:
        raise ResultsError(
            f"schema_version {version!r} is not supported: kvbench {__version__} reads schema_version "
            f"{SCHEMA_VERSION}; re-render with the kvbench version that wrote it, or re-run the benchmarks")
    for key, kind in (("engines", list), ("scenarios", list)):
        if not isinstance(data.get(key), kind):
            raise ResultsError(f"'{key}' must be a {kind.__name__}, got {type(data.get(key)).__name__}")
    conformance = data.setdefault("conformance", [])  # absent from files written before it existed
    if not isinstance(conformance, list):
        raise ResultsError(f"'conformance' must be a list, got {type(conformance).__name__}")
    data["conformance"] = [_conformance_record(r, i) for i, r in enumerate(conformance)]
    skipped = data.setdefault("skipped_scenarios", [])  # absent from files written before it existed
    if not isinstance(skipped, list) or not all(
            isinstance(s, dict) and all(isinstance(s.get(k), str) for k in ("scenario", "engine", "reason"))
            for s in skipped):
        raise ResultsError("'skipped_scenarios' must be a list of {scenario, engine, reason} strings")
    data.setdefault("kvbench_version", None)
    data.setdefault("created", None)
    data.setdefault("machine", {})
    data.setdefault("command", None)  # absent from files written before it was recorded
    data["commit"] = {"id": None, "branch": None, "dirty": None, **(data.get("commit") or {})}
    for i, eng in enumerate(data["engines"]):
        if not isinstance(eng, dict) or not eng.get("name"):
            raise ResultsError(f"engines[{i}] needs a 'name'")
        eng.setdefault("kind", None)
        eng.setdefault("options", {})
        eng.setdefault("capabilities", [])
    for i, sc in enumerate(data["scenarios"]):
        if not isinstance(sc, dict) or not sc.get("name"):
            raise ResultsError(f"scenarios[{i}] needs a 'name'")
        sc.setdefault("description", "")
        sc.setdefault("parameters", {})
        sc.setdefault("sweeps", [])
        for j, res in enumerate(sc.setdefault("results", [])):
            if not isinstance(res, dict) or "engine" not in res or not isinstance(res.get("metrics"), dict):
                raise ResultsError(f"scenarios[{i}] ({sc['name']}) results[{j}] needs 'engine' and 'metrics'")
            res.setdefault("mode", None)
            for key, default in (("series", {}), ("checks", {}), ("undecided", {}), ("notes", []), ("repeats", []),
                                 ("spread", {}), ("clock", None)):
                res.setdefault(key, default)
            res.setdefault("counters", None)  # absent from files written before the counter contract
            res["undecided_kinds"] = _undecided_kinds(res.get("undecided_kinds"), f"{sc['name']} [{res['engine']}]")
            res.setdefault("claim_evidence", {})  # absent from files written before it existed
            try:
                result_counters(res)
            except (TypeError, ValueError) as e:
                raise ResultsError(f"scenarios[{i}] ({sc['name']}) results[{j}] counters: {e}") from None
        for j, sw in enumerate(sc["sweeps"]):
            if not isinstance(sw, dict) or not sw.get("name") or not isinstance(sw.get("points"), list):
                raise ResultsError(f"scenarios[{i}] ({sc['name']}) sweeps[{j}] needs 'name' and 'points'")
            sw.setdefault("x_label", sw["name"])
            for point in sw["points"]:
                if not {"x", "engine", "metrics"} <= set(point):
                    raise ResultsError(f"a point of sweep {sw['name']!r} in {sc['name']!r} needs x, engine, metrics")
                point.setdefault("mode", None)
                point.setdefault("repeats", [])
                point.setdefault("spread", {})
    return data


def _conformance_record(record: Any, index: int) -> dict[str, Any]:
    """Check one conformance record and fill its optional parts; raises ResultsError naming the field."""
    where = f"conformance[{index}]"
    if not isinstance(record, dict):
        raise ResultsError(f"{where} must be an object, got {type(record).__name__}")
    for key in ("engine", "check", "nodeid"):
        if not isinstance(record.get(key), str) or not record[key]:
            raise ResultsError(f"{where} needs a non-empty string {key!r}, got {record.get(key)!r}")
    if record.get("outcome") not in CONFORMANCE_OUTCOMES:
        raise ResultsError(f"{where} ({record['check']}): 'outcome' must be one of {', '.join(CONFORMANCE_OUTCOMES)}, "
                           f"got {record.get('outcome')!r}")
    record.setdefault("kind", None)
    record.setdefault("reason", None)
    record.setdefault("proven", [])  # what the check proved fired (older files: unknown, so none)
    record.setdefault("pressured", True)
    for key, kind, what in (("evidence", dict, "an object"), ("knob_overrides", dict, "an object"),
                            ("near_ties", int, "an integer")):
        value = record.setdefault(key, kind())
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ResultsError(f"{where} ({record['check']}): {key!r} must be {what}, got {value!r}")
    if record["reason"] is not None and not isinstance(record["reason"], str):
        raise ResultsError(f"{where} ({record['check']}): 'reason' must be a string or null")
    for knob, pair in record["knob_overrides"].items():
        if not isinstance(pair, list) or len(pair) != 2:
            raise ResultsError(f"{where} ({record['check']}): knob_overrides[{knob!r}] must be "
                               f"[option value given, value used], got {pair!r}")
    return record
