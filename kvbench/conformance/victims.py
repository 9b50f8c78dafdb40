"""The preemption-victim rule: which running request a declared scheduling policy must preempt.

* ``fcfs``: the latest admitted of the requests running when the victim was chosen.
* ``priority``: the least important one: highest ``priority`` value (lower is more important, as
  in vLLM), then the latest arrival. Never a request more important than another one running.

Proved from :class:`~kvbench.core.engine_events.PreemptionRecord` s whose ``running`` lists the requests
running at that moment in admission order (the victim included).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbench.core.engine_events import PreemptionRecord
from kvbench.core.requests import GenRequest

POLICIES = ("fcfs", "priority")


def victim_violations(records: Sequence[PreemptionRecord], policy: str,
                      requests: Sequence[GenRequest]) -> list[str]:
    """One line per preemption whose victim the policy does not name. ``requests`` in arrival order
    (the order they were submitted) give each request's priority and arrival rank."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is invalid: expected one of {POLICIES}")
    arrival = {r.request_id: i for i, r in enumerate(requests)}
    priority = {r.request_id: r.priority for r in requests}
    problems = []
    for rec in records:
        if rec.running is None:
            raise ValueError(f"preemption {rec.order} of {rec.request_id} does not say which requests were running")
        if rec.request_id not in rec.running:
            problems.append(f"preemption {rec.order}: victim {rec.request_id} was not among the running "
                            f"{list(rec.running)}")
            continue
        if policy == "fcfs":
            latest = rec.running[-1]
            if rec.request_id != latest:
                problems.append(f"preemption {rec.order} (step {rec.step}): FCFS must preempt the latest admitted "
                                f"{latest}, but preempted {rec.request_id} (running, oldest first: "
                                f"{list(rec.running)})")
            continue

        def importance(rid: str) -> tuple[int, int]:
            return (priority[rid], arrival[rid])  # larger = less important

        least = max(rec.running, key=importance)
        if rec.request_id != least:
            kind = ("more important than" if priority[rec.request_id] < priority[least]
                    else "of the same priority but an earlier arrival than")
            problems.append(f"preemption {rec.order} (step {rec.step}): the priority policy must preempt the least "
                            f"important {least} (priority {priority[least]}), but preempted {rec.request_id} "
                            f"(priority {priority[rec.request_id]}), {kind} it")
    return problems
