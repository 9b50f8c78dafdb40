"""The simulator's kvbench side: the ``sim`` adapter and what ``kvbench calibrate``, ``simulate``,
``validate-sim`` and ``predict`` run (their faces are modules of :mod:`kvbench.cli`).

:mod:`~kvbench.sim.adapter` (the ``sim`` kind: the reference engine's policies on a cost model's
clock), :mod:`~kvbench.sim.front_end` (a serving front end's delivery on the virtual clock),
:mod:`~kvbench.sim.calibration` (a hardware profile fitted to the reference engine as the driver
serves it), :mod:`~kvbench.sim.client_calibration` (one fitted from what a client of a server sees),
:mod:`~kvbench.sim.simulate` (workloads at scale, one run or a sweep of knobs) and
:mod:`~kvbench.sim.capacity_plan` (the sweep read into a plan); checking the simulator:
:mod:`~kvbench.sim.validation` (against the reference engine, leave-one-out),
:mod:`~kvbench.sim.predict_engines` (against real engines) and :mod:`~kvbench.sim.accuracy` (a
prediction's error beside the measured rounds' spread). The engine half is
:mod:`reference_engine.sim`.

Imports ``kvbench.core``, ``drivers``, ``models``, ``engines`` and ``bench``; the report (which renders the plan
as plan.html) and the two faces import it. Engines, benchmarks and conformance never do.
"""
