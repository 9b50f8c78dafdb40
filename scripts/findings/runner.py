"""The command line every reproduction script in this folder shares: run each of its findings (or ``--only``
one), print whether each reproduced, and exit with how many did (0: none reproduces any more)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def run_findings(description: str, findings: dict[str, Callable[[], bool]]) -> int:
    """Run ``findings`` (name -> a function that returns whether the finding reproduced) as the command line
    asks; the number that reproduced, for ``sys.exit``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", choices=sorted(findings))
    args = parser.parse_args()
    reproduced = 0
    for name, finding in findings.items():
        if args.only and name != args.only:
            continue
        print(f"\n== {name}")
        found = finding()
        print(f"  -> {'REPRODUCED' if found else 'not reproduced (fixed?)'}")
        reproduced += bool(found)
    return reproduced
