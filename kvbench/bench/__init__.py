"""Benchmarks: workloads, metrics, scenarios, results and the regression gate.

Imports ``kvbench.engines`` and ``kvbench.core``; never the simulator's side, the report or the conformance checks.
"""
