"""The preemption-victim rule: which running request a declared scheduling policy must preempt.

* ``fcfs``: the latest admitted of the requests running when the victim was chosen.
* ``priority``: the least important one: highest ``priority`` value (lower is more important, as
  in vLLM), then the latest arrival. Never a request more important than another one running.

Proved from :class:`~kvbench.core.engine_events.PreemptionRecord` s whose ``running`` lists the requests
running at that moment in admission order (the victim included): the engine's own events, or the records
:mod:`kvbench.conformance.victims_seen` infers from outside (token arrival times and ``/metrics``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvbench.core.engine_events import PreemptionRecord
from kvbench.core.requests import GenRequest

POLICIES = ("fcfs", "priority")


def check_policy(policy: str) -> None:
    """ValueError naming ``policy`` unless it is one of :data:`POLICIES`."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is invalid: expected one of {POLICIES}")


def importance(request_id: str, priority: Mapping[str, int], arrival: Mapping[str, int]) -> tuple[int, int]:
    """The priority policy's victim key: larger = less important (higher priority value, then later arrival)."""
    return (priority[request_id], arrival[request_id])


def policy_victim(policy: str, running: Sequence[str], priority: Mapping[str, int],
                  arrival: Mapping[str, int]) -> str:
    """The request ``policy`` must preempt among ``running`` (oldest admission first): FCFS the last of them,
    the priority policy the least important (:func:`importance`)."""
    check_policy(policy)
    if policy == "fcfs":
        return running[-1]
    return max(running, key=lambda rid: importance(rid, priority, arrival))


def victim_violations(records: Sequence[PreemptionRecord], policy: str,
                      requests: Sequence[GenRequest]) -> list[str]:
    """One line per preemption whose victim the policy does not name. ``requests`` in arrival order
    (the order they were submitted) give each request's priority and arrival rank."""
    check_policy(policy)
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
        named = policy_victim(policy, rec.running, priority, arrival)
        if rec.request_id == named:
            continue
        if policy == "fcfs":
            problems.append(f"preemption {rec.order} (step {rec.step}): FCFS must preempt the latest admitted "
                            f"{named}, but preempted {rec.request_id} (running, oldest first: "
                            f"{list(rec.running)})")
            continue
        kind = ("more important than" if priority[rec.request_id] < priority[named]
                else "of the same priority but an earlier arrival than")
        problems.append(f"preemption {rec.order} (step {rec.step}): the priority policy must preempt the least "
                        f"important {named} (priority {priority[named]}), but preempted {rec.request_id} "
                        f"(priority {priority[rec.request_id]}), {kind} it")
    return problems
