"""Do an engine's counters tell the truth? They must agree with each other, with the engine's own
events and with what kvbench saw from outside (the outputs).

* per-request preemption counts add up to the totals, and the events count the same by mode;
* ``recomputed_tokens`` equals the KV discarded by recompute preemptions and computed again,
  less what the prefix cache served on resume (:func:`recomputed_from_events`);
* swap byte and request counters equal the sums of the swap events;
* ``generated_tokens`` equals the output tokens kvbench received.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from kvbench.core.events import EventRecord, preemption_records
from kvbench.core.requests import GenResult


def recomputed_from_events(events: Iterable[EventRecord]) -> int | None:
    """Tokens computed again after recompute preemptions, from ``admitted.cached_tokens`` and
    ``preempted.tokens_discarded`` alone. None when the events cannot tell (a field missing, an abort).

    Per request, a *stint* runs from one admission to the next preemption (or the finish). It starts
    at the tokens the prefix cache served and computes upwards; the highest position ever computed
    before it (``high``) is known from earlier recompute preemptions' ``tokens_discarded``. A stint
    that ends at position ``end`` recomputed ``max(0, min(end, high) - start)``; a finishing stint
    passes ``high``. A swap preemption keeps the KV: the stint goes on.
    """
    high: dict[str, int] = defaultdict(int)
    start: dict[str, int] = {}
    total = 0
    for e in events:
        rid = e.request_id
        if e.kind == "admitted":
            if "cached_tokens" not in e.data:
                return None
            start[rid] = int(e.data["cached_tokens"])
        elif e.kind == "preempted" and e.data.get("mode") == "recompute":
            if "tokens_discarded" not in e.data or rid not in start:
                return None
            end = int(e.data["tokens_discarded"])
            total += max(0, min(end, high[rid]) - start.pop(rid))
            high[rid] = max(high[rid], end)
        elif e.kind == "finished" and rid in start:
            total += max(0, high[rid] - start.pop(rid))
        elif e.kind == "aborted":
            return None
    return total


def metrics_disagreements(result: GenResult) -> list[str]:
    """Every disagreement between ``result``'s counters, its events and its outputs (needs events)."""
    if result.events is None:
        raise ValueError("metrics_disagreements needs the engine's events (GenResult.events is None)")
    c, events, problems = result.counters, result.events, []

    def differ(what: str, counter: str, seen: float) -> None:
        if counter in c and c[counter] != seen:
            problems.append(f"{counter}={c[counter]} but {what} = {seen}")

    records = preemption_records(events)
    by_mode = Counter(r.mode for r in records)
    for mode in ("recompute", "swap"):
        differ(f"the {mode} preemption events", f"preemptions_{mode}", by_mode[mode])
    per_request = Counter(r.request_id for r in records)
    for o in result.outputs:
        if o.num_preemptions is not None and o.num_preemptions != per_request[o.request_id]:
            modes = [r.mode for r in records if r.request_id == o.request_id]
            problems.append(f"{o.request_id} reports {o.num_preemptions} preemptions but the events show "
                            f"{per_request[o.request_id]} ({modes})")
    counts = [o.num_preemptions for o in result.outputs]
    if None not in counts and c.preemptions is not None and sum(counts) != c.preemptions:  # type: ignore[arg-type]
        problems.append(f"per-request preemptions add up to {sum(counts)} but the counters say "  # type: ignore[arg-type]
                        f"{c.preemptions_recompute} recompute + {c.preemptions_swap} swap")
    expected = recomputed_from_events(events)
    if expected is not None:
        differ("the tokens discarded by recompute preemptions less the prefix-cache hits on resume",
               "recomputed_tokens", expected)
    for kind, direction in (("swapped_out", "out"), ("swapped_in", "in")):
        swaps = [e for e in events if e.kind == kind]
        if all("bytes" in e.data for e in swaps):
            total = sum(e.data["bytes"] for e in swaps)
            differ(f"the sum of {kind} events' bytes", f"swapped_{direction}_bytes", total)
        differ(f"the number of {kind} events", f"swap_{direction}s", len(swaps))
    differ("the output tokens received", "generated_tokens", sum(len(o.token_ids) for o in result.outputs))
    if "recomputed_tokens" in c and "computed_tokens" in c and c["recomputed_tokens"] > c["computed_tokens"]:
        problems.append(f"recomputed_tokens={c['recomputed_tokens']} exceeds computed_tokens={c['computed_tokens']}")
    return problems
