"""Benchmarks: workloads, metrics, scenarios, results and the regression gate; and what the benchmark
commands of ``kvbench`` run on them: engines side by side (:mod:`~kvbench.bench.interleaved_rounds`,
``kvbench head-to-head``), ratios per sweep point (:mod:`~kvbench.bench.point_ratios`, ``kvbench ratios``),
admission settings against static admission (:mod:`~kvbench.bench.admission_tradeoff`,
``kvbench admission-sweep``) and the reference engine's CUDA paths (:mod:`~kvbench.bench.gpu_measure`,
``kvbench measure-gpu``, the one module here that drives the reference engine directly).

Imports ``kvbench.core``, ``drivers``, ``models`` and ``engines``; never the simulator's side, the report or the
conformance checks.
"""
