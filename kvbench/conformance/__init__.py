"""Conformance: prove-it-fired, the equivalence rule, the refcount state machine, expectations.

Imports ``kvbench.engines`` and ``kvbench.core`` (and the workloads of ``kvbench.bench``);
nothing below imports it.
"""
