"""One results file from several: pytest-xdist workers' results, or shards run on several machines.

:func:`merge_results` takes ``(source, Results)`` pairs (``source`` names a file or a worker, for
messages) and returns one :class:`~kvbench.bench.results.Results` holding every engine, scenario
result, sweep point and conformance record of them all. It refuses (:class:`MergeError`, naming the
files) what cannot be one run:

* different ``schema_version`` values;
* different scenario sizes: a ``quick`` run beside a ``full`` one (``parameters["scale"]``), or the
  same scale on different models;
* the same result twice (a scenario x engine x mode, a sweep point, a conformance node id) or the
  same shard twice: overlapping inputs would silently pick one of two measurements;
* one engine name with different options in two files.

Machines: every result, sweep point and conformance record keeps the machine it was measured on
(``"machine"``: its hostname, unless it already had one), the top level lists each machine's
details under ``"machines"`` (hostname -> machine info), and ``"machine"`` is that machine's info
when there is one, else each field's distinct values joined by ", ". ``"merge"`` records the
sources and notes (shards missing, commits that differ), which the caller should show.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from kvbench.bench.results import Results


class MergeError(ValueError):
    """Results that cannot be merged into one run; the message names the sources."""


def _sizes(results: Results) -> set[tuple[Any, Any]]:
    """(scale, model) of every scenario that records its scale."""
    return {(sc["parameters"].get("scale"), sc["parameters"].get("model")) for sc in results.scenarios
            if sc["parameters"].get("scale") is not None}


def _hostname(results: Results, source: str) -> str:
    return str((results.machine or {}).get("hostname") or f"unknown ({source})")


def _check_mergeable(parts: Sequence[tuple[str, Results]]) -> None:
    versions = {source: r.data.get("schema_version") for source, r in parts}
    if len(set(versions.values())) > 1:
        raise MergeError("cannot merge results of different schema versions: "
                         + ", ".join(f"{s} has schema_version {v!r}" for s, v in versions.items()))
    sizes = {source: _sizes(r) for source, r in parts}
    distinct = set().union(*sizes.values()) if sizes else set()
    if len(distinct) > 1:
        raise MergeError("cannot merge results of different scenario sizes (scale, model): "
                         + ", ".join(f"{s} is " + (" + ".join(f"{sc} on {m}" for sc, m in sorted(v, key=str)) or
                                                    "unsized (conformance only)")
                                     for s, v in sizes.items() if v))
    shards: dict[tuple[int, int], str] = {}
    counts = set()
    for source, r in parts:
        shard = r.data.get("shard")
        if not shard:
            continue
        key = (int(shard["index"]), int(shard["count"]))
        counts.add(key[1])
        if key in shards:
            raise MergeError(f"shard {key[0]}/{key[1]} appears twice: {shards[key]} and {source}")
        shards[key] = source
    if len(counts) > 1:
        raise MergeError("cannot merge shards of different splits: "
                         + ", ".join(f"{s} is shard {i}/{n}" for (i, n), s in shards.items()))


def _shard_notes(parts: Sequence[tuple[str, Results]]) -> list[str]:
    shards = [r.data["shard"] for _, r in parts if r.data.get("shard")]
    if not shards:
        return []
    count = int(shards[0]["count"])
    missing = sorted(set(range(1, count + 1)) - {int(s["index"]) for s in shards})
    return [f"shard(s) {', '.join(f'{i}/{count}' for i in missing)} missing: this merge covers only part of the "
            f"run"] if missing else []


def _commit_notes(parts: Sequence[tuple[str, Results]]) -> list[str]:
    commits = {source: (r.data.get("commit") or {}).get("id") for source, r in parts}
    if len({c for c in commits.values() if c}) > 1:
        return ["results come from different commits: " + ", ".join(f"{s} at {(c or 'unknown')[:10]}"
                                                                     for s, c in commits.items())]
    return []


def _combined_machine(machines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if len(machines) == 1:
        return dict(next(iter(machines.values())))
    combined: dict[str, Any] = {}
    for info in machines.values():
        for key, value in info.items():
            values = combined.setdefault(key, [])
            if str(value) not in values:
                values.append(str(value))
    return {key: ", ".join(values) for key, values in combined.items()}


def merge_results(parts: Sequence[tuple[str, Results]]) -> Results:
    """Merge ``(source, results)`` pairs, in order, into one new Results (the inputs are not changed).

    Raises :class:`MergeError` (module docstring) when they cannot be one run, or when ``parts`` is empty.
    """
    if not parts:
        raise MergeError("nothing to merge: no results given")
    _check_mergeable(parts)
    first = parts[0][1]
    merged = Results({"schema_version": first.data["schema_version"], "kvbench_version": first.data.get(
        "kvbench_version"), "created": min((r.data.get("created") or "" for _, r in parts)) or None,
        "machine": {}, "commit": copy.deepcopy(first.data.get("commit") or {}), "engines": [], "scenarios": [],
        "conformance": []})
    machines: dict[str, dict[str, Any]] = {}
    seen_results: dict[tuple, str] = {}
    seen_points: dict[tuple, str] = {}
    seen_records: dict[str, str] = {}
    engine_source: dict[str, str] = {}
    for source, part in parts:
        data = copy.deepcopy(part.data)
        host = _hostname(part, source)
        for host_name, info in (data.get("machines") or {host: data.get("machine") or {}}).items():
            machines.setdefault(host_name, info)
        for eng in data["engines"]:
            earlier = merged.engine(eng["name"])
            if earlier is not None and earlier.get("options") != eng.get("options"):
                raise MergeError(f"engine {eng['name']!r} has options {earlier.get('options')} in "
                                 f"{engine_source[eng['name']]} and {eng.get('options')} in {source}")
            engine_source.setdefault(eng["name"], source)
            merged.add_engine(eng)
        for sc in data["scenarios"]:
            target = merged.scenario(sc["name"], create=True, description=sc.get("description"))
            for key, value in sc.get("parameters", {}).items():
                target["parameters"].setdefault(key, value)
            for res in sc["results"]:
                key = (sc["name"], res["engine"], res.get("mode"))
                if key in seen_results:
                    raise MergeError(f"{sc['name']} / {res['engine']}" + (f" [{res['mode']}]" if res.get("mode")
                                     else "") + f" is in both {seen_results[key]} and {source}")
                seen_results[key] = source
                res.setdefault("machine", host)
                target["results"].append(res)
            for sw in sc.get("sweeps", []):
                target_sweep = next((s for s in target["sweeps"] if s["name"] == sw["name"]), None)
                if target_sweep is None:
                    target_sweep = {**sw, "points": []}
                    target["sweeps"].append(target_sweep)
                for point in sw["points"]:
                    key = (sc["name"], sw["name"], point["x"], point["engine"], point.get("mode"))
                    if key in seen_points:
                        raise MergeError(f"{sc['name']} sweep {sw['name']} point x={point['x']} of "
                                         f"{point['engine']} is in both {seen_points[key]} and {source}")
                    seen_points[key] = source
                    point.setdefault("machine", host)
                    target_sweep["points"].append(point)
        for record in data.get("conformance", []):
            if record["nodeid"] in seen_records:
                raise MergeError(f"conformance result {record['nodeid']} is in both {seen_records[record['nodeid']]} "
                                 f"and {source}")
            seen_records[record["nodeid"]] = source
            record.setdefault("machine", host)
            merged.data["conformance"].append(record)
        for skip in data.get("skipped_scenarios", []):  # each shard's skips, kept with their reasons
            merged.add_skipped_scenario(skip["scenario"], skip["engine"], skip["reason"])
    merged.data["machine"] = _combined_machine(machines)
    merged.data["machines"] = machines
    merged.data["merge"] = {"sources": [source for source, _ in parts],
                            "notes": _shard_notes(parts) + _commit_notes(parts)}
    return merged


def machine_count(results: Results) -> int:
    """How many machines a results file's figures come from (1 for an unmerged run)."""
    return max(1, len(results.data.get("machines") or {}))
