"""The report's "Not measured" list: every scenario a run did not measure on an engine, with the run's reason.

Read from ``skipped_scenarios`` of a results file (:mod:`kvbench.bench.results`): a scenario an engine lacks a
capability or a knob for, or one it ran and decided nothing on. Rules (tests/kvbench/test_report_publishable.py):

* one entry per scenario, titled as the report titles it, in the order the run listed them; under it each
  reason once, with the engines it kept off the scenario (one line for all four engines a matched knob skipped);
* a scenario skipped on every engine is listed too: it has no section of its own, so this is the only place the
  reader learns it was not run;
* a reason longer than :data:`SHORT` characters is shown by its first clause (after the scenario's key, which the
  title says), the whole reason folded away beneath it (never cut).

Every string reaches the page through jinja2's autoescape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbench.bench.results import Results
from kvbench.report import words

#: a reason up to this long is shown whole on its line
SHORT = 160


def _split(reason: str, scenario: str) -> tuple[str, str]:
    """(what the line shows, what is folded away) of ``reason``; the fold is "" for a short reason. A reason
    that opens with the scenario's key ("priority_online_offline: nothing decided ...") is shown from the clause
    after it, which the entry's title already names."""
    if len(reason) <= SHORT:
        return reason, ""
    body = reason.removeprefix(f"{scenario}: ")
    head, sep, _ = body.partition(": ")
    head = head if sep and len(head) <= SHORT else reason[:SHORT].rsplit(" ", 1)[0]
    return head, reason


def section(results: Results) -> list[dict[str, Any]]:
    """[{scenario, title, measured, engines: [{engine, reason, short, full}]}] of ``results``' skipped
    scenarios; ``measured``: whether any engine has a result of it in the file; [] when nothing was skipped."""
    measured = {sc["name"] for sc in results.scenarios if sc.get("results")}
    out: dict[str, dict[str, Any]] = {}
    for skip in results.data.get("skipped_scenarios") or []:
        if not isinstance(skip, Mapping):
            continue
        name, engine = str(skip.get("scenario") or ""), str(skip.get("engine") or "")
        reason = str(skip.get("reason") or "no reason recorded")
        entry = out.setdefault(name, {"scenario": name, "title": words.scenario_title(name),
                                      "measured": name in measured, "engines": []})
        # "vllm: vllm lacks capability swap" says the engine twice: the line names it once
        reason = reason.removeprefix(f"{engine} ") if reason.startswith(f"{engine} lacks") else reason
        same = next((e for e in entry["engines"] if e["reason"] == reason), None)
        if same is not None:  # engines skipped for one reason share its line (matched knobs skip them all)
            if engine not in same["engine"].split(", "):
                same["engine"] += f", {engine}"
            continue
        short, full = _split(reason, name)
        entry["engines"].append({"engine": engine, "reason": reason, "short": short, "full": full})
    return list(out.values())
