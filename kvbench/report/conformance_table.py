"""A run's conformance verdicts as a Markdown table: one row per check, one column per engine.

What ``kvbench conformance RESULTS.json`` prints (a page of docs/, a pull request's description, an
issue). Each cell is the verdict in words (passed, **FAILED**, expected failure, skipped...) followed,
for anything but a pass, by a short reason taken from the record (the skip's reason, the pinned cause,
the failure's first line), and, where a pinned finding's precondition did not hold in the run, that the pin
was not exercised (a pass there is not the finding fixed); with ``footnotes`` the reasons become numbered
notes under the table, so the table stays narrow. Nothing is re-run: the records are the ones the run saved.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

#: a record's outcome (:data:`kvbench.bench.results.CONFORMANCE_OUTCOMES`) as the table says it; bold
#: where a reader must act
OUTCOME_WORDS: dict[str, str] = {
    "passed": "passed", "failed": "**FAILED**", "error": "**ERROR**", "xfailed": "expected failure",
    "skipped": "skipped", "undecided": "undecided", "xpassed": "**now passes (stale expectation)**",
}
#: the longest reason a cell (or a footnote) shows; the results file keeps the whole of it
REASON_CHARS = 140


def short_reason(reason: str | None, engine: str) -> str:
    """The reason's gist: its first line, the engine's name replaced by "the engine" (the column says
    which), without a leading exception name (``kvbench.x.KnobsNotSettable: ``), a shipped expectations file
    named by its place in the package (not the checkout's absolute path), cut at :data:`REASON_CHARS`."""
    text = (reason or "").replace(engine, "the engine").strip()
    # a shipped expectations file by its place in the package, not the checkout the run happened to use
    text = re.sub(r"/\S*/(kvbench/conformance/expectations/[\w.-]+\.toml)", r"\1", text)
    text = re.sub(r"^(kvbench\.[\w.]+\.)?\w+(Error|NotSettable|Exception): ", "", text)
    text = text.split("\n", 1)[0]
    return text[:REASON_CHARS] + ("..." if len(text) > REASON_CHARS else "")


def conformance_table(records: Sequence[Mapping[str, Any]], *, footnotes: bool = False) -> str:
    """The Markdown table of ``records`` (a results file's ``conformance`` list): checks in the order
    they first ran, engines likewise; "-" where an engine has no record of a check. ValueError when
    there are no records (an empty table would read as "nothing failed")."""
    if not records:
        raise ValueError("no conformance records: the run checked no engine (pytest suites/conformance "
                         "writes them)")
    engines = list(dict.fromkeys(r["engine"] for r in records))
    checks = list(dict.fromkeys(r["check"] for r in records))
    cells = {(r["check"], r["engine"]): r for r in records}
    notes: list[str] = []
    lines = ["| check | " + " | ".join(e.replace("|", "/") for e in engines) + " |",
             "|---" * (len(engines) + 1) + "|"]
    for check in checks:
        row = [f"`{check}`"]
        for engine in engines:
            record = cells.get((check, engine))
            if record is None:
                row.append("-")
                continue
            word = OUTCOME_WORDS.get(record["outcome"], record["outcome"])
            why = short_reason(record.get("reason"), engine) if record["outcome"] != "passed" else ""
            pin = record.get("pin") or {}
            if pin.get("state") == "not_exercised":
                # a known finding that could not show in this run: said, so a pass is not read as the fix
                not_exercised = f"pinned finding not exercised (needs {pin.get('needs', '?')})"
                why = f"{why}; {not_exercised}" if why else not_exercised
            if why and footnotes:
                notes.append(why)
                row.append(f"{word} [{len(notes)}]")
            else:
                # a "|" inside a cell would end it
                row.append(f"{word}: {why}".replace("|", "/") if why else word)
        lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += [""] + [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines)
