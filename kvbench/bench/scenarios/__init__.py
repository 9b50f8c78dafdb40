"""The storm scenarios (docs/benchmarks.md#scenarios) as data, with one small runner and a claim checker
per scenario.

A scenario is a plan (the workloads to serve and the knobs to serve them under, at a ``quick``
or ``full`` scale) plus a judge (what the run must have shown, and the figures it adds). Running
one is always the same: serve every planned :class:`Job` on an engine adapter, then judge::

    outcome = run(PREEMPTION_STORM, adapter, model, "quick", progress)
    record(outcome, results, adapter.describe())        # results entries, sweeps, checks
    assert not outcome.failures(), outcome.explain()    # the scenario did what it claims

Several engines are served together with ``run_interleaved(scenario, {name: adapter, ...}, ...)``:
repeat i of each in the same round, in-process engines in lockstep, so same-run ratios compare
measurements taken under the same load (what the regression gate divides, repeat by repeat).

Contracts:

* **Claims are about what happened, never about time.** A storm must have preempted, a surge must
  have filled the pool, a crossover sweep must hold both modes at every length. Times are
  measured and reported, never asserted. A claim the engine cannot show (it does not expose the
  counter) is ``None``: reported as a note, neither passed nor failed.
* **Same seed, same requests, every engine.** Workloads come from seeded
  :class:`~kvbench.bench.workloads.WorkloadSpec`; pressure comes from engine-neutral
  :class:`~kvbench.engines.base.Knobs` (pool size, block size, budgets, modes).
* **Modes of one engine are measured side by side in one test** (swap vs recompute, chunked vs
  unchunked, caching on vs off), so their ratio never mixes machines or moments.
* **A run's duration ends at its last token or finish**, for every engine alike: an adapter's
  teardown after the last request (a thread join, a garbage collection) is not serving time.

Scales: ``quick`` runs on the built-in ``tiny`` checkpoint (1,024 positions) and fits, all scenarios
on three engines with three repeats, in under ten minutes on two CPU cores. ``full`` runs on
``small`` (4,096 positions) and is sized so that the main job (every scenario, three engines, one
repeat by default) takes about 20 minutes on two CPU cores at one torch thread: every full plan
serves more requests than quick's, with longer sequences (prompts up to 1,152-2,304 tokens where the
tiny model holds 1,024), but not production sizes. On CPU a ``small`` step costs a fixed part plus
a part per prefilled token, and its decode attention reads every key up to the batch's longest
sequence, so the first full sizes (3,000-token prompts, batches of up to 48) were priced at hours per
repeat on the reference engine alone (the step costs and that price:
docs/journal/measurements.md#step-costs-behind-the-scenario-sizes). How the sizes were chosen: the reference
engine's full schedule (every step's batch shape, from the simulator on the step clock, whose counts
are the engine's) priced by that step cost, then one run of each scenario
(``test_every_claim_holds_on_the_reference_engines_schedule`` in tests/kvbench/test_scenarios.py keeps
every claim shown at both scales). Sizes are in the tables below.

Modules: :mod:`~kvbench.bench.scenarios.common` (models, jobs, outcomes, the runner, recording, shared
claims), :mod:`~kvbench.bench.scenarios.surges` (evening surge, flash crowd),
:mod:`~kvbench.bench.scenarios.storms` (preemption storm, swap-space exhaustion),
:mod:`~kvbench.bench.scenarios.crossover` (swap vs recompute), :mod:`~kvbench.bench.scenarios.mechanisms`
(prefix caching, chunked prefill, priority), :mod:`~kvbench.bench.scenarios.policies` (static vs
auto preemption vs admission control), :mod:`~kvbench.bench.scenarios.claims` (how claims read the
engine's own evidence, and the three ways one stays undecided), :mod:`~kvbench.bench.scenarios.closed_loop`
(closed-loop throughput and TTFT at fixed concurrencies under matched knobs, every engine of a session).
Everything public is re-exported here.
"""

from __future__ import annotations

from kvbench.bench.scenarios.claims import (
    DID_NOT_FIRE,
    NOT_EXPOSED,
    NOT_REACHED,
    Decision,
    PreemptionSplit,
    kv_filled,
    preempted_after,
    preemption_split,
)
from kvbench.bench.scenarios.closed_loop import HEAD_TO_HEAD, HeadToHead, run_head_to_head
from kvbench.bench.scenarios.common import (
    BLOCK_SIZE,
    DOUBLED,
    FULL_POOL,
    MODEL_PRESETS,
    SCALES,
    UNDECIDED_REASON,
    Job,
    Model,
    Outcome,
    Progress,
    ResultEntry,
    Scenario,
    Served,
    SweepPoint,
    all_finished,
    build_workload,
    describe_spec,
    last_event,
    percentile,
    positive,
    preemptions_between,
    record,
    run,
    run_interleaved,
    serve,
    ttft_by,
)
from kvbench.bench.scenarios.crossover import (
    VICTIM,
    CrossoverSize,
    ResumeCost,
    SwapVsRecompute,
    check_crossover_length,
    resume_cost,
    summarize_costs,
)
from kvbench.bench.scenarios.declare import COST_CLOCK_CLAIM
from kvbench.bench.scenarios.mechanisms import (
    HIGH,
    LOW,
    ChunkedPrefillStalls,
    ChunkedSize,
    PrefixCachingRecompute,
    PrefixSize,
    PriorityOnlineOffline,
    PrioritySize,
    chunked_claims,
    chunked_decisions,
    class_figures,
    first_token_steps,
    prefix_claims,
    prefix_decisions,
    priority_claims,
    priority_decisions,
    priority_vs_fcfs_claims,
    priority_vs_fcfs_decisions,
    stall_steps,
)
from kvbench.bench.scenarios.policies import PoliciesSize, PreemptionPolicies, auto_vs_fixed_claims
from kvbench.bench.scenarios.storms import (
    ExhaustionSize,
    PreemptionStorm,
    StormSize,
    SwapSpaceExhaustion,
    exhaustion_claims,
    exhaustion_decisions,
    first_fallback,
    knee_within,
    storm_claims,
    storm_decisions,
)
from kvbench.bench.scenarios.surges import (
    EveningSurge,
    FlashCrowd,
    FlashSize,
    SurgeSize,
    arrival_rate_ratio,
    before_after,
)

EVENING_SURGE = EveningSurge()
FLASH_CROWD = FlashCrowd()
PREEMPTION_STORM = PreemptionStorm()
SWAP_VS_RECOMPUTE = SwapVsRecompute()
PREFIX_CACHING = PrefixCachingRecompute()
CHUNKED_PREFILL = ChunkedPrefillStalls()
PRIORITY = PriorityOnlineOffline()
SWAP_EXHAUSTION = SwapSpaceExhaustion()
PREEMPTION_POLICIES = PreemptionPolicies()

#: every scenario by name, in the order of docs/benchmarks.md#scenarios
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    EVENING_SURGE, FLASH_CROWD, PREEMPTION_STORM, SWAP_VS_RECOMPUTE, PREFIX_CACHING, CHUNKED_PREFILL, PRIORITY,
    SWAP_EXHAUSTION, PREEMPTION_POLICIES, HEAD_TO_HEAD)}

__all__ = [
    "BLOCK_SIZE",
    "CHUNKED_PREFILL",
    "COST_CLOCK_CLAIM",
    "DID_NOT_FIRE",
    "DOUBLED",
    "EVENING_SURGE",
    "FLASH_CROWD",
    "FULL_POOL",
    "HEAD_TO_HEAD",
    "HIGH",
    "LOW",
    "MODEL_PRESETS",
    "NOT_EXPOSED",
    "NOT_REACHED",
    "PREEMPTION_POLICIES",
    "PREEMPTION_STORM",
    "PREFIX_CACHING",
    "PRIORITY",
    "SCALES",
    "SCENARIOS",
    "SWAP_EXHAUSTION",
    "SWAP_VS_RECOMPUTE",
    "UNDECIDED_REASON",
    "VICTIM",
    "ChunkedPrefillStalls",
    "ChunkedSize",
    "CrossoverSize",
    "Decision",
    "EveningSurge",
    "ExhaustionSize",
    "FlashCrowd",
    "FlashSize",
    "HeadToHead",
    "Job",
    "Model",
    "Outcome",
    "PoliciesSize",
    "PreemptionPolicies",
    "PreemptionSplit",
    "PreemptionStorm",
    "PrefixCachingRecompute",
    "PrefixSize",
    "PriorityOnlineOffline",
    "PrioritySize",
    "Progress",
    "ResultEntry",
    "ResumeCost",
    "Scenario",
    "Served",
    "StormSize",
    "SurgeSize",
    "SwapSpaceExhaustion",
    "SwapVsRecompute",
    "SweepPoint",
    "all_finished",
    "arrival_rate_ratio",
    "auto_vs_fixed_claims",
    "before_after",
    "build_workload",
    "check_crossover_length",
    "chunked_claims",
    "chunked_decisions",
    "class_figures",
    "describe_spec",
    "exhaustion_claims",
    "exhaustion_decisions",
    "first_fallback",
    "first_token_steps",
    "knee_within",
    "kv_filled",
    "last_event",
    "percentile",
    "positive",
    "preempted_after",
    "preemption_split",
    "preemptions_between",
    "prefix_claims",
    "prefix_decisions",
    "priority_claims",
    "priority_decisions",
    "priority_vs_fcfs_claims",
    "priority_vs_fcfs_decisions",
    "record",
    "resume_cost",
    "run",
    "run_head_to_head",
    "run_interleaved",
    "serve",
    "stall_steps",
    "storm_claims",
    "storm_decisions",
    "summarize_costs",
    "ttft_by",
]
