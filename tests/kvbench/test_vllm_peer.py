"""Real vLLM in the loop: a conformance subset run against vLLM V1's CPU build, launched from its own
environment (``bash scripts/peers.sh vllm``, which the README's set-up step runs) by the ``vllm`` preset.

The subset is run as a user runs it, ``pytest suites/conformance --engine server:preset=vllm
--kvbench-expectations vllm``, in a subprocess, and judged from its ``results.json``: every selected check
must be decided (passed, or failed the way vLLM's shipped expectations pin), and the mechanism checks
must have proved their mechanism fired on vLLM itself (its ``/metrics``). Skipped, saying why, where
vLLM's CPU build cannot run (not Linux x86_64 with AVX2) or its environment was not made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: checks whose mechanism vLLM has and exposes, chosen to need few server launches (each ~1 min on 2 cores)
SUBSET = ("unpressured_matches_ground_truth or recompute_preemption_equivalence "
          "or prefix_caching_equivalence_and_hits or over_long_prompt")
#: check -> the counters that must be > 0 in its evidence (proved from vLLM's own /metrics)
MUST_FIRE = {"recompute_preemption_equivalence": "preemptions_recompute",
             "prefix_caching_equivalence_and_hits": "prefix_cache_hits"}


def _vllm_ready() -> str | None:
    """None when the peer environment is there; else why not (the peers script's own words)."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "peers.sh"), "vllm", "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    return None if done.returncode == 0 else (done.stderr.strip() or f"peers.sh exited {done.returncode}")


@pytest.mark.server
@pytest.mark.slow
def test_conformance_subset_against_real_vllm(tmp_path: Path) -> None:
    why = None if os.environ.get("KVBENCH_VLLM") else _vllm_ready()
    if why:
        pytest.skip(f"vLLM's CPU build is not available here: {why}")
    cmd = [sys.executable, "-m", "pytest", "suites/conformance", "-p", "no:cacheprovider", "-q",
           "--engine", f"server:preset=vllm,log_dir={tmp_path / 'logs'}", "--kvbench-expectations", "vllm",
           "-k", SUBSET, "--report-dir", str(tmp_path / "reports"), "--timeout", "600"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1500)
    tail = "\n".join(done.stdout.splitlines()[-40:])
    assert done.returncode == 0, f"{' '.join(cmd)}\nexited {done.returncode}:\n{tail}\n{done.stderr[-2000:]}"
    results = next((tmp_path / "reports").glob("*/results.json"))
    records = json.loads(results.read_text())["conformance"]
    assert records, f"no conformance record was written:\n{tail}"
    undecided = [(r["check"], r["reason"]) for r in records if r["outcome"] == "skipped"]
    assert not undecided, f"checks vLLM has the mechanism for were skipped: {undecided}"
    for record in records:
        counter = MUST_FIRE.get(record["check"])
        if counter and record["outcome"] == "passed":
            assert (record["evidence"] or {}).get(counter, 0) > 0, f"{record['check']}: {counter} not proved"
    assert any(r["outcome"] == "passed" for r in records if r["check"] in MUST_FIRE), \
        f"no mechanism check passed on vLLM: {[(r['check'], r['outcome']) for r in records]}"
