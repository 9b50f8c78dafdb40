"""The engine's policies, each constructible from plain numbers (no model, no tensors):

- :mod:`~reference_engine.policies.preemption`: ``preemption_mode="auto"``'s rule: a victim's facts in, a
  :class:`~reference_engine.policies.preemption.Decision` out (swap or recompute, whether it fell back, why)
- :mod:`~reference_engine.policies.preemption_costs`: where auto's prices come from (:class:`LinearCosts`,
  :class:`ModelCosts`, behind the :class:`PreemptionCosts` protocol)
- :mod:`~reference_engine.policies.startup_costs`: the prices an engine measures (or loads) at start-up
- :mod:`~reference_engine.policies.admission`: admission control (``admission_policy``)

The scheduler calls them; they never call the scheduler. What they do, and what was measured of them:
docs/simulator.md#preemption-aware-policies.
"""
