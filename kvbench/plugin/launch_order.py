"""Tests ordered by the servers they launch, for engines whose every launch is a fresh start (a peer such as
vLLM: tens of seconds a start on a small machine).

A check's knobs are computed as it runs (pools are sized to its own requests), so which server a test needs
is known only once it has run. This module keeps what each test ran on, per engine, in a *launch plan*: for
every test, the launch keys it was served from in order (:meth:`ServerAdapter.take_launches
<kvbench.engines.http.server.ServerAdapter.take_launches>`) and whether it failed. The next run of the same
engine on the same checkpoint is ordered by that plan (:func:`ordered`): the tests of one launch run one after
another, a test that moves from one launch to another comes where its first launch is already up, and a test
that failed (whose server is then stopped) comes last among its launch's. After each test, a server that no
later test of the plan needs is stopped (:meth:`ServerAdapter.stop_servers_except`), so with ``keep_servers=1``
(vLLM's default) each distinct launch starts once; a server of a launch the plan does not know (the checks now
size their launches otherwise) is kept as ``keep_servers`` allows, never stopped for the plan's sake. And the
first launch a later test needs that is not up is started ahead (:meth:`ServerAdapter.prestart`), once the test
just run has launched what the plan said it would: a start overlaps the tests before it. The plan keeps each
launch's knobs for this.

Stable otherwise: tests of other engines keep their places, and an engine's tests the plan does not know
(new, or never run) go first, in their order; without a plan nothing moves. The order depends only on the
plan file and the collected tests, so every pytest-xdist worker collects the same order; ``--kvbench-shard``
selects by node id, whatever the order. Only a plain run (not an xdist worker) records a plan and stops
servers early: a worker runs the tests the controller sends it, not the collected order.

Plans live under ``$KVBENCH_CACHE/launch-plans/`` (:func:`plan_path`), one per engine spec, checkpoint option
and engine list; a run records the tests it ran into its plan and keeps the other tests' entries. A plan names
no path of the machine that wrote it (:func:`portable_key`: the checkpoint, kvbench's cache and kvbench's own
package are written as placeholders), so a plan recorded on one machine orders a run on another. kvbench ships
one for each peer preset (``kvbench/plugin/launch_plans/<preset>.json``, :func:`seed_plan`, refreshed with
``scripts/seed_launch_plan.py``): a first run on a machine, which has no plan of its own, is ordered by it and
starts ahead what it says, as later runs are by their own. A seed that no longer holds (the checks now size
their launches otherwise, or the engine is started otherwise) costs only the starts ahead: a test whose launches
differ from the plan's starts nothing ahead, and no server the plan does not know is stopped for its sake.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbench.core.cache import cache_root
from kvbench.core.knobs import Knobs
from kvbench.engines.registry import EngineSpec, EngineSpecError, adapter_class
from kvbench.plugin.session import engine_spec_of, is_xdist_worker, session_of

#: a launch key as the plan stores it (the launch command with ``{port}``, and kvbench's environment, with this
#: machine's paths as placeholders: :func:`portable_key`)
Key = tuple[str, ...]
#: the plan file format: 2 since keys name no machine's paths (a plan of format 1 is not read: its keys would
#: match no launch, and the run would be ordered by launches it never makes)
PLAN_FORMAT = 2
#: where kvbench's own launch plans are kept, one per preset (:func:`seed_plan`)
SEED_DIR = Path(__file__).resolve().parent / "launch_plans"
#: what stands for the engine spec's name in a seed plan's node ids (``test_x[{engine}-auto]``)
ENGINE_PLACEHOLDER = "{engine}"
_KVBENCH_DIR = Path(__file__).resolve().parents[1]
_FAILED_KEY = pytest.StashKey[bool]()


@dataclass
class Planned:
    """What one test ran on last time: its launch keys in order, and whether it failed."""

    launches: list[Key] = field(default_factory=list)
    failed: bool = False


def plan_path(spec: EngineSpec, model: str | None, specs: list[EngineSpec]) -> Path:
    """Where the plan of ``spec`` is kept: per engine spec, ``--kvbench-model`` (None: the built-in checkpoint,
    which depends on every engine of the run) and the run's engine list."""
    ident = json.dumps([spec.name, model, [s.name for s in specs] if model is None else []])
    return cache_root() / "launch-plans" / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def portable_key(key: tuple[str, ...], model_dir: str | None) -> Key:
    """``key`` (an engine's launch key) with this machine's paths written as placeholders: the launching
    executable by its file name (where a peer is installed: its environment under kvbench's cache, ``vllm=``,
    ``$KVBENCH_VLLM``), the checkpoint (``{model}``, and what kvbench derives beside it: a GGUF at
    ``{model}-gguf/...``), kvbench's cache (``{cache}``) and kvbench's own package (``{kvbench}``: the fault
    hook's path). Two launches have the same portable key where they have the same key, on one machine (one
    engine's launches share their executable); on two machines where they launch the same command on their own
    paths."""
    if key and Path(key[0]).is_absolute():
        key = (Path(key[0]).name, *key[1:])
    swaps = [(str(Path(model_dir).resolve()), "{model}"), (str(model_dir), "{model}")] if model_dir else []
    swaps += [(str(cache_root().resolve()), "{cache}"), (str(cache_root()), "{cache}"),
              (str(_KVBENCH_DIR), "{kvbench}")]
    out = []
    for arg in key:
        for path, placeholder in swaps:
            arg = arg.replace(path, placeholder)
        out.append(arg)
    return tuple(out)


def load_plan(path: Path) -> dict[str, Planned]:
    """nodeid -> :class:`Planned` from ``path``; {} when there is none, it cannot be read, or it is of another
    format (:data:`PLAN_FORMAT`)."""
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != PLAN_FORMAT:
            return {}
        return {nodeid: Planned([tuple(k) for k in entry["launches"]], bool(entry.get("failed")))
                for nodeid, entry in raw["tests"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def load_launch_knobs(path: Path) -> dict[Key, dict[str, Any]]:
    """launch key -> the knobs it was launched with, as the plan at ``path`` keeps them ({} when it has none, or
    is of another format): what a later run gives :meth:`ServerAdapter.prestart
    <kvbench.engines.http.server.ServerAdapter.prestart>` to start a coming test's server ahead of it."""
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != PLAN_FORMAT:
            return {}
        return {tuple(entry["launch"]): dict(entry["knobs"]) for entry in raw.get("launch_knobs", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def seed_path(spec: EngineSpec) -> Path | None:
    """kvbench's own plan for ``spec``'s preset (:data:`SEED_DIR`), or None: an engine given its own command
    (``cmd=``) or no preset has none."""
    preset = spec.options.get("preset")
    if not preset or spec.options.get("cmd"):
        return None
    return SEED_DIR / f"{preset}.json"


def seed_plan(spec: EngineSpec) -> tuple[dict[str, Planned], dict[Key, dict[str, Any]]]:
    """kvbench's own plan for ``spec`` (:func:`seed_path`) with ``spec``'s name in its node ids, and its launches'
    knobs: what a run without a plan of its own is ordered by. ({}, {}) where there is none."""
    path = seed_path(spec)
    if path is None:
        return {}, {}
    plan = {nodeid.replace(ENGINE_PLACEHOLDER, spec.name): planned for nodeid, planned in load_plan(path).items()}
    return plan, load_launch_knobs(path)


def seed_from(plan_file: Path, spec: EngineSpec, dest: Path) -> int:
    """Write the plan a run of ``spec`` recorded at ``plan_file`` as a seed plan at ``dest``: the spec's name in
    each node id as :data:`ENGINE_PLACEHOLDER`, only the tests that ran on ``spec``. Returns how many tests it
    holds; :class:`ValueError` when ``plan_file`` holds no plan of this format."""
    plan = load_plan(plan_file)
    if not plan:
        raise ValueError(f"{plan_file} holds no launch plan of format {PLAN_FORMAT}: run the suite on {spec.name} "
                         "once with this kvbench first")
    marker = f"[{spec.name}"
    seed = {nodeid.replace(marker, f"[{ENGINE_PLACEHOLDER}", 1): planned for nodeid, planned in plan.items()
            if marker in nodeid}
    save_plan(dest, spec, seed, load_launch_knobs(plan_file), engine_name=ENGINE_PLACEHOLDER)
    return len(seed)


def save_plan(path: Path, spec: EngineSpec, plan: dict[str, Planned],
              launch_knobs: dict[Key, dict[str, Any]] | None = None, engine_name: str | None = None) -> None:
    """Write ``plan`` (and the knobs of its launches) atomically (a concurrent reader sees the old plan or the
    new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    used = {k for p in plan.values() for k in p.launches}
    body = {"format": PLAN_FORMAT, "engine": engine_name or spec.name,
            "tests": {nodeid: {"launches": [list(k) for k in p.launches], "failed": p.failed}
                      for nodeid, p in sorted(plan.items())},
            "launch_knobs": [{"launch": list(k), "knobs": knobs} for k, knobs in sorted((launch_knobs or {}).items())
                             if k in used]}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)


def ordered(nodeids: list[str], plan: dict[str, Planned]) -> list[str]:
    """``nodeids`` (one engine's tests, in collection order) in launch order by ``plan``.

    Tests the plan does not know, or that launched nothing, first, in their order. Then, greedily, with the
    server the previous test left running as ``current``: the tests served by ``current`` alone (those that
    passed last time, then those that failed: a failure stops the server); else the first test that starts on
    ``current`` and moves on; else the first test that moves from one launch to another (it brings up the
    launch it ends on, so the tests served by that launch alone can follow); else the first one left, a failed
    one last unless it shares no launch with another (its failure stops no server a later test needs)."""
    free = [n for n in nodeids if not (n in plan and plan[n].launches)]
    left = [n for n in nodeids if n in plan and plan[n].launches]
    out = list(free)
    current: Key | None = None
    while left:
        alone = [n for n in left if set(plan[n].launches) == {current}]
        if alone:
            batch = [n for n in alone if not plan[n].failed] + [n for n in alone if plan[n].failed]
            out += batch
            left = [n for n in left if n not in batch]
            current = None if plan[batch[-1]].failed else current
            continue
        # a test that failed stops the server it leaves: it goes after the others that could share that server;
        # one that shares its launches with no other keeps its place (a refused launch, an expected failure:
        # last of all, its start came alone at the run's end)
        passing = [n for n in left if not plan[n].failed or not _shares_a_launch(n, left, plan)]
        moving = [n for n in passing if len(set(plan[n].launches)) > 1]
        starts_here = [n for n in moving if plan[n].launches[0] == current]
        pick = (starts_here or moving or passing or left)[0]
        out.append(pick)
        left.remove(pick)
        current = None if plan[pick].failed else plan[pick].launches[-1]
    return out


def _shares_a_launch(nodeid: str, others: list[str], plan: dict[str, Planned]) -> bool:
    """Whether another of ``others`` ran on one of ``nodeid``'s launches."""
    mine = set(plan[nodeid].launches)
    return any(mine & set(plan[other].launches) for other in others if other != nodeid)


class LaunchOrder:
    """The plugin part: orders the tests at collection, records each test's launches (the plan is written after
    every test), and stops what no later test needs."""

    def __init__(self, config: pytest.Config):
        self.config = config
        ks = session_of(config)
        self.recording = not is_xdist_worker(config)
        #: spec name -> (spec, plan path, plan as loaded, this run's records)
        self.engines: dict[str, tuple[EngineSpec, Path, dict[str, Planned], dict[str, Planned]]] = {}
        #: spec name -> launch key -> its knobs (the plan's, updated by what this run launched)
        self.launch_knobs: dict[str, dict[Key, dict[str, Any]]] = {}
        #: spec name -> where its tests' order comes from, in words (the report header)
        self.sources: dict[str, str] = {}
        for spec in ks.engine_specs:
            if _starts_fresh(spec):
                path = plan_path(spec, ks.model, ks.engine_specs)
                plan, knobs = load_plan(path), load_launch_knobs(path)
                self.sources[spec.name] = f"this machine's launch plan ({path})"
                if not plan:  # a first run on this machine: kvbench's own plan for the preset, where it has one
                    plan, knobs = seed_plan(spec)
                    self.sources[spec.name] = (f"kvbench's launch plan for preset {spec.options.get('preset')}" if plan
                                               else "no launch plan yet: collection order, nothing started ahead")
                self.engines[spec.name] = (spec, path, plan, {})
                self.launch_knobs[spec.name] = knobs
        self.items: list[pytest.Item] = []

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        """One line per engine whose tests go in launch order: which plan orders them."""
        return [f"kvbench launch order for {name}: {source}" for name, source in self.sources.items()]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        for name, (_, _, plan, _) in self.engines.items():
            if not plan:
                continue
            slots = [i for i, item in enumerate(items) if _engine_name(item) == name]
            by_id = {items[i].nodeid: items[i] for i in slots}
            new = ordered([items[i].nodeid for i in slots], plan)
            for slot, nodeid in zip(slots, new, strict=True):
                items[slot] = by_id[nodeid]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
            item.stash[_FAILED_KEY] = True
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Before the test's fixtures go: take the launches it was served from, and stop the servers no later
        test of the plan needs (nothing is stopped while a later test is one the plan does not know)."""
        name = _engine_name(item)
        if name not in self.engines or not self.recording:
            return
        engine = (getattr(item, "funcargs", None) or {}).get("engine")
        take = getattr(engine, "take_launches", None)
        _, _, plan, records = self.engines[name]
        model_dir = getattr(engine, "model_dir", None)

        def portable(key: tuple[str, ...]) -> Key:
            return portable_key(key, model_dir)

        # a test that never reached its engine (skipped first) is recorded too: it launched nothing
        records[item.nodeid] = Planned([portable(k) for k in take()] if take is not None else [],
                                       item.stash.get(_FAILED_KEY, False))
        launched = getattr(engine, "launch_knobs_of", None) or {}
        self.launch_knobs[name].update({portable(key): knobs.as_dict() for key, knobs in launched.items()})
        self._save(name)  # after every test: a run cut short still leaves the next one its plan so far
        if take is None:
            return
        later = self.items[self.items.index(item) + 1:] if item in self.items else []
        coming: list[Key] = []  # the launches later tests need, in the order they need them
        for other in later:
            if _engine_name(other) != name:
                continue
            if other.nodeid not in plan:
                return
            coming += [k for k in plan[other.nodeid].launches if k not in coming]
        # a server whose launch the plan does not know (the plan predates a change in how a check sizes its
        # launch) says nothing about later tests: kept, as keep_servers allows, rather than stopped after every test
        known = {k for p in plan.values() for k in p.launches}
        live = getattr(engine, "live_launches", None)
        unknown = {k for k in live() if portable(k) not in known} if live is not None else set()
        needed = set(coming)  # portable keys: matched against every launch the engine made (launch_knobs_of)
        engine.stop_servers_except({k for k in launched if portable(k) in needed} | unknown)
        if item.nodeid in plan and plan[item.nodeid].launches == records[item.nodeid].launches:
            self._start_ahead(engine, name, coming)  # only on a plan this test has just confirmed
        else:
            self._start_ahead(engine, name, [])  # nothing started ahead on a plan that no longer holds

    def _start_ahead(self, engine: Any, name: str, coming: list[Key]) -> None:
        """Hand the engine the launches later tests need, in the order they are needed
        (:meth:`ServerAdapter.plan_ahead`): it starts those not up yet as far as it starts ahead, and goes on
        starting them as earlier starts finish, so a run is not one start after another."""
        plan_ahead = getattr(engine, "plan_ahead", None)
        if plan_ahead is None:
            return
        wanted: list[Knobs] = []
        for key in coming:
            knobs = self.launch_knobs[name].get(key)
            if knobs is None:
                break  # a plan from an older kvbench: this one and those after it start when needed
            with contextlib.suppress(ValueError, TypeError):
                wanted.append(Knobs(**knobs))
        plan_ahead(wanted)

    def _save(self, name: str) -> None:
        spec, path, plan, records = self.engines[name]
        # a plan is an optimisation: a run that cannot keep one runs in collection order next time
        with contextlib.suppress(OSError):
            save_plan(path, spec, {**plan, **records}, self.launch_knobs[name])


def _engine_name(item: pytest.Item) -> str | None:
    spec = engine_spec_of(item)
    return spec.name if spec is not None else None


def _starts_fresh(spec: EngineSpec) -> bool:
    try:
        cls: Any = adapter_class(spec.kind)
    except EngineSpecError:
        return False
    starts_fresh = getattr(cls, "starts_fresh", None)
    return bool(starts_fresh is not None and starts_fresh(dict(spec.options)))
