"""Print a run's conformance verdicts as a Markdown table: one row per check, one column per engine.

    python scripts/conformance_table.py reports/<run>/results.json [--reasons]

Each cell is the verdict (passed, FAILED, expected failure, skipped) followed, for anything but a pass, by a
short reason taken from the record (the skip's reason, the pinned finding, the failure's first line); with
``--reasons`` the reasons are footnotes instead, so the table stays narrow.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

WORDS = {"passed": "passed", "failed": "**FAILED**", "xfailed": "expected failure", "skipped": "skipped",
         "xpassed": "**now passes (stale expectation)**"}


def short(reason: str | None, engine: str) -> str:
    """The reason's gist, without the engine's name (the column says it) or kvbench's exception prefixes."""
    text = (reason or "").replace(engine, "the engine").strip()
    text = re.sub(r"^(kvbench\.[\w.]+\.)?\w+(Error|NotSettable|Exception): ", "", text)
    text = text.split("\n", 1)[0]
    return text[:140] + ("..." if len(text) > 140 else "")


def table(records: list[dict], footnotes: bool) -> str:
    engines = list(dict.fromkeys(r["engine"] for r in records))
    checks = list(dict.fromkeys(r["check"] for r in records))
    cells = {(r["check"], r["engine"]): r for r in records}
    notes: list[str] = []
    lines = ["| check | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|"]
    for check in checks:
        row = [f"`{check}`"]
        for engine in engines:
            record = cells.get((check, engine))
            if record is None:
                row.append("-")
                continue
            word = WORDS.get(record["outcome"], record["outcome"])
            why = short(record.get("reason"), engine) if record["outcome"] != "passed" else ""
            if why and footnotes:
                notes.append(why)
                row.append(f"{word} [{len(notes)}]")
            else:
                row.append(f"{word}: {why}".replace("|", "/") if why else word)
        lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += [""] + [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--reasons", action="store_true", help="reasons as numbered footnotes")
    args = parser.parse_args(argv)
    records = json.loads(args.results.read_text()).get("conformance") or []
    if not records:
        print(f"{args.results}: no conformance results", file=sys.stderr)
        return 1
    print(table(records, args.reasons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
