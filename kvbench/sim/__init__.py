"""The simulator's kvbench side: the ``sim`` adapter, ``kvbench calibrate`` and ``kvbench simulate``.

:mod:`~kvbench.sim.adapter` (the ``sim`` kind: the reference engine's policies on a cost model's
clock), :mod:`~kvbench.sim.calibration` (a hardware profile fitted to the reference engine as the
driver serves it), :mod:`~kvbench.sim.simulate` (workloads at scale, one run or a sweep of knobs) and
:mod:`~kvbench.sim.capacity_plan` (the sweep read into a plan). The engine half is
:mod:`reference_engine.sim`.

Imports ``kvbench.core``, ``kvbench.engines`` and ``kvbench.bench``; the report (which renders the plan
as plan.html) and the two faces import it. Engines, benchmarks and conformance never do.
"""
