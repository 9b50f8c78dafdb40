"""The kvbench command-line options, in groups written as functions (``add_*_options(group)``) so the
plugin and any other argparse-style front end can share them; :func:`pytest_addoption` adds them all
to the group "kvbench"."""

from __future__ import annotations

from typing import Any

import pytest

SCALES = ("quick", "full")
#: ``--benchmark-repeats`` when not given, by scale. One at full: the full scale is sized for one
#: repeat of the main job on 2 CPU cores (:mod:`kvbench.bench.scenarios`), three would triple it;
#: results still record the number
#: (``parameters.repeats``, one entry per repeat), and the gate falls back to its thresholds alone when
#: a point has no spread.
DEFAULT_REPEATS = {"quick": 3, "full": 1}


def add_options(group: Any) -> None:
    """The kvbench options; shared by the plugin and the CLI (both use argparse-style ``addoption``)."""
    group.addoption("--engine", action="append", default=None, metavar="KIND[:KEY=VALUE,...]",
                    help="engine under test, repeatable (default: reference). Kinds: reference, hf, hf-cb and "
                         "any registered in the 'kvbench.engines' entry-point group; or MODULE:CLASS[:KEY=VALUE,...] "
                         "for an EngineAdapter subclass")
    group.addoption("--benchmark", action="store_true", default=False,
                    help="run the storm benchmarks too and write <report-dir>/<run>/report.html")
    group.addoption("--benchmark-scale", choices=SCALES, default="quick",
                    help="benchmark size: quick (minutes on 2 CPU cores) or full")
    group.addoption("--report-dir", default="reports", metavar="DIR", help="where benchmark runs are written")
    group.addoption("--baseline", default=None, metavar="RESULTS.json",
                    help="compare with a saved run; a regression past a threshold fails the session")
    group.addoption("--threshold", action="append", default=None, metavar="EXPR",
                    help="regression threshold such as throughput:-10%% or preemptions:+0 (repeatable)")
    group.addoption("--slo", default=None, metavar="EXPR", help='goodput SLOs, e.g. "ttft<=0.5,tbt<=0.1"')
    group.addoption("--benchmark-repeats", type=int, default=None, metavar="N",
                    help="serve every timed benchmark point N times; results keep each repeat, the median and "
                         "the spread (default 3 at quick scale, 1 at full)")
    group.addoption("--gate-absolute", action="store_true", default=False,
                    help="with --baseline: gate absolute times too, not only same-run ratios to the reference engine")
    group.addoption("--gate-noise-k", type=float, default=3.0, metavar="K",
                    help="with --baseline: a time's change must exceed K pooled spreads of the repeats (default 3)")
    group.addoption("--kvbench-model", default=None, metavar="DIR",
                    help="Hugging Face Llama checkpoint (safetensors) to run engines on; default: built-in tiny")


def add_conformance_options(group: Any) -> None:
    """Liveness limits and expected failures (conformance only)."""
    group.addoption("--kvbench-deadline", type=float, default=None, metavar="SECONDS",
                    help="fail an engine run (one generate/serve) that takes longer than this (default: none)")
    group.addoption("--kvbench-stall-steps", type=int, default=200, metavar="N",
                    help="fail an engine run after N steps with no token and no request state change (default 200)")
    group.addoption("--kvbench-stall-seconds", type=float, default=60.0, metavar="SECONDS",
                    help="fail an engine run after this long with no token and no state change (default 60)")
    group.addoption("--kvbench-near-tie-tolerance", type=float, default=None, metavar="LOGITS",
                    help="excuse a divergence from the ground truth where its top-1/top-2 logit margin is below "
                         "this (default: per the dtype the engine computes in: 1e-3 float32, 2.0 bfloat16, "
                         "0.25 float16; kvbench/conformance/equivalence.py)")
    group.addoption("--kvbench-expectations", action="append", default=None, metavar="FILE",
                    help="TOML file of checks expected to fail per engine kind, each pinned to its failure "
                         "message; they run as strict xfails "
                         "(repeatable; a bare engine kind such as hf-cb or hf names the file kvbench ships, "
                         "kvbench/conformance/expectations/<kind>.toml)")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvbench", "kvbench: paged-KV engine conformance and benchmarks")
    add_options(group)
    add_conformance_options(group)
    add_distribution_options(group)
    add_soak_options(group)


def add_distribution_options(group: Any) -> None:
    """Splitting a run across machines by hand (within one machine, pytest-xdist's ``-n``)."""
    group.addoption("--kvbench-shard", default=None, metavar="I/N",
                    help="run only shard I of N (1 <= I <= N): a deterministic round-robin over the sorted test ids; "
                         "merge the shards' results.json with 'kvbench merge'")


def add_soak_options(group: Any) -> None:
    """Runs past minutes: the ``soak`` tests (suites/soak)."""
    group.addoption("--soak", action="store_true", default=False,
                    help="run the soak tests (marker soak; skipped without this flag, so a plain pytest and CI never "
                         "run them)")
    group.addoption("--soak-minutes", type=float, default=10.0, metavar="MINUTES",
                    help="how long the HTTP soak loads the server, in total over the preemption modes (default 10)")
