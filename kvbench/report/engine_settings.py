"""The report's "Engine settings": what each engine ran each scenario with, side by side.

Read from the ``settings`` a results file records (:mod:`kvbench.bench.job_settings`): per scenario (or once,
where every scenario ran the same), one table whose rows are settings and whose columns are engines (an engine
that ran several knob sets in a scenario, one per mode, gets a column each). Rules (tests/kvbench/
test_engine_settings.py holds each):

* a cell shows the value where what kvbench asked and what the engine confirmed agree (or the engine stated
  nothing: the column says so), and "asked / confirmed" where they differ;
* missing is "not stated", never 0 or blank;
* a row where two engines ran different values (in the same modes; the engine's confirmed value where it stated
  one, else the asked one) is flagged "not matched": their figures were measured under different settings;
  except the block size and the pool in blocks, each engine's own granularity: the pool in tokens is matched;
* below the table, each engine's version and launch command (secrets as ``***``);
* a results file without settings (written before they were recorded) shows no table and says so.

Every string reaches the page through jinja2's autoescape; nothing here is marked safe.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from kvbench.bench.job_settings import redact_argv
from kvbench.bench.results import Results
from kvbench.report import words

NOT_STATED = "not stated"
NOT_MATCHED = "not matched"
#: a derived row: the KV pool in tokens (block size x blocks), which an engine of another block size matches
POOL_TOKENS = "pool_tokens"
#: the rows, in order, with their labels; a setting recorded but not named here follows them under its own name
ROWS: tuple[tuple[str, str], ...] = (
    ("block_size", "block size (tokens)"),
    (POOL_TOKENS, "KV pool (tokens)"),
    ("num_gpu_blocks", "KV pool (blocks)"),
    ("num_cpu_blocks", "host swap pool (blocks)"),
    ("max_num_seqs", "max_num_seqs"),
    ("max_num_batched_tokens", "max_num_batched_tokens"),
    ("enable_prefix_caching", "prefix caching"),
    ("enable_chunked_prefill", "chunked prefill"),
    ("preemption_mode", "preemption mode"),
    ("scheduling_policy", "scheduling policy"),
    ("max_model_len", "max_model_len"),
    ("admission_policy", "admission policy"),
    ("admission_headroom", "admission headroom"),
    ("prefill_pacing_tokens", "prefill pacing (tokens)"),
    ("dtype", "dtype"),
)
#: rows of an engine's own granularity (block size, and so the pool counted in blocks): engines of other block
#: sizes differ there by design, and what is matched is the pool in tokens (POOL_TOKENS), flagged where it differs
GRANULARITY = frozenset({"block_size", "num_gpu_blocks"})
_NOT_SETTINGS = frozenset({"engine", "modes", "asked", "confirmed", "launch", "package", "version"})


def _fmt(value: Any) -> str:
    if value is None:
        return NOT_STATED
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _pool(said: Mapping[str, Any]) -> int | None:
    block, blocks = said.get("block_size"), said.get("num_gpu_blocks")
    if isinstance(block, int) and isinstance(blocks, int) and not isinstance(block, bool):
        return block * blocks
    return None


def _values(record: Mapping[str, Any], key: str) -> tuple[Any, Any]:
    """(asked, confirmed) of setting ``key`` in a record; None where not stated. ``dtype`` is asked at the
    record's top level (what kvbench launches it in)."""
    asked = record.get("asked") or {}
    confirmed = record.get("confirmed") or {}
    if key == POOL_TOKENS:
        return _pool(asked), _pool(confirmed)
    if key == "dtype":
        return record.get("dtype", asked.get("dtype")), confirmed.get("dtype")
    return asked.get(key), confirmed.get(key)


def _columns(sc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The scenario's recorded settings as columns: its ``settings`` list, else its results' own ``settings``."""
    recorded = sc.get("settings")
    if isinstance(recorded, list) and recorded:
        found = [dict(s) for s in recorded if isinstance(s, dict) and s.get("engine")]
    else:
        found = [{"engine": r["engine"], "modes": [r["mode"]] if r.get("mode") else [], **r["settings"]}
                 for r in sc.get("results", []) if isinstance(r.get("settings"), dict)]
    per_engine: dict[str, int] = {}
    for col in found:
        per_engine[col["engine"]] = per_engine.get(col["engine"], 0) + 1
    for i, col in enumerate(found):
        modes = [str(m) for m in col.get("modes") or []]
        col["label"] = str(col["engine"])
        if per_engine[col["engine"]] > 1:
            nth = sum(1 for c in found[:i] if c["engine"] == col["engine"]) + 1
            col["label"] += f" [{', '.join(modes)}]" if modes else f" (knob set {nth})"
        col["group"] = tuple(modes)
    # the engines that ran one mode stand next to each other: the columns a reader compares
    order = {g: i for i, g in enumerate(dict.fromkeys(c["group"] for c in found))}
    return sorted(found, key=lambda c: order[c["group"]])


def _cell(asked: Any, confirmed: Any, stated: bool) -> dict[str, str]:
    """One cell: the value, or "asked / confirmed" where they differ; ``stated``: the engine states settings.
    A knob kvbench left unset runs at the engine's default: "(default)" beside what the engine states of it."""
    if asked is None and confirmed is None:
        return {"text": NOT_STATED, "cls": "na",
                "tip": "left at the engine's default, which the engine does not state"}
    if asked is None:
        return {"text": f"{_fmt(confirmed)} (default)", "cls": "",
                "tip": "left at the engine's default by kvbench; the value is what the engine states"}
    if not stated:
        return {"text": _fmt(asked), "cls": "", "tip": "asked by kvbench; this engine states none of its settings"}
    if confirmed == asked:
        return {"text": _fmt(asked), "cls": "", "tip": "asked by kvbench and confirmed by the engine"}
    return {"text": f"{_fmt(asked)} / {_fmt(confirmed)}", "cls": "",
            "tip": "asked by kvbench / what the engine states it runs"}


def _ran(asked: Any, confirmed: Any) -> Any:
    """The value an engine ran: its own word where it gave one, else what it was asked."""
    return confirmed if confirmed is not None else asked


def _table(columns: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in ROWS]
    extra = sorted({k for c in columns for part in ("asked", "confirmed") for k in (c.get(part) or {})
                    if k not in keys})
    labels = dict(ROWS)
    rows = []
    for key in [*keys, *extra]:
        pairs = [_values(c, key) for c in columns]
        if all(a is None and b is None for a, b in pairs):
            continue  # no engine was asked it nor states it: a row of "not stated" says nothing
        cells = [_cell(a, b, isinstance(c.get("confirmed"), dict) and bool(c["confirmed"]))
                 for c, (a, b) in zip(columns, pairs, strict=True)]
        unmatched = False
        for group in dict.fromkeys(c["group"] for c in columns):
            ran: dict[str, set[str]] = {}
            for c, (a, b) in zip(columns, pairs, strict=True):
                if c["group"] == group and _ran(a, b) is not None:
                    ran.setdefault(_fmt(_ran(a, b)), set()).add(c["engine"])
            engines = {e for names in ran.values() for e in names}
            unmatched = unmatched or (len(ran) > 1 and len(engines) > 1 and key not in GRANULARITY)
        rows.append({"label": labels.get(key, key), "cells": cells, "flag": NOT_MATCHED if unmatched else ""})
    engines = [{"label": c["label"],
                "version": f"{c.get('package') or ''} {c['version']}".strip() if c.get("version") else NOT_STATED,
                "launch": shlex.join(redact_argv(c["launch"])) if isinstance(c.get("launch"), list) else NOT_STATED,
                "confirmed": bool(c.get("confirmed"))}
               for c in columns]
    return {"columns": [c["label"] for c in columns], "rows": rows, "engines": engines,
            "unmatched": [r["label"] for r in rows if r["flag"]]}


def _signature(table: Mapping[str, Any]) -> tuple:
    return (tuple(table["columns"]), tuple((r["label"], tuple(c["text"] for c in r["cells"]), r["flag"])
                                           for r in table["rows"]),
            tuple((e["label"], e["version"], e["launch"]) for e in table["engines"]))


def section(results: Results) -> dict[str, Any] | None:
    """The section's view: ``tables`` (each with ``title``, ``href``, ``columns``, ``rows``, ``engines``,
    ``unmatched``), ``unrecorded`` (scenarios whose results hold no settings) and ``unmatched_in`` (the titles of
    the tables with a row not matched); None when no scenario holds any (a results file written before settings
    were recorded)."""
    tables, unrecorded = [], []
    for i, sc in enumerate(results.scenarios):
        columns = _columns(sc)
        if not columns:
            unrecorded.append(words.scenario_title(sc["name"]))
            continue
        tables.append({"title": words.scenario_title(sc["name"]), "href": f"#scenario-{i + 1}", **_table(columns)})
    if not tables:
        return None
    if len(tables) > 1 and len({_signature(t) for t in tables}) == 1:
        tables = [{**tables[0], "title": f"Every scenario ({len(tables)})", "href": None}]
    return {"tables": tables, "unrecorded": unrecorded, "unmatched_in": [t["title"] for t in tables if t["unmatched"]]}


__all__ = ["NOT_MATCHED", "NOT_STATED", "ROWS", "section"]
