"""Do an engine's counters tell the truth? They must agree with each other, with the engine's own
events and with what kvbench saw from outside (the outputs).

* per-request preemption counts add up to the totals, and the events count the same by mode;
* ``recomputed_tokens`` equals the KV discarded by recompute preemptions and computed again,
  less what the prefix cache served on resume (:func:`recomputed_from_events`);
* swap byte and request counters equal the sums of the swap events;
* ``generated_tokens`` equals the output tokens kvbench received.

Counts an engine tells twice are checked against each other without its events
(:func:`told_twice_disagreements`): the engine's single preemption total against its by-mode counts,
per-request preemption and prefix-cache counts against the run's totals, generated tokens against the
tokens received; and prefix-cache hits against the reuse the requests were built to produce
(:func:`prefix_hit_floor`, a lower bound kvbench computes from the requests alone).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from kvbench.core.engine_events import EventRecord, preemption_records
from kvbench.core.requests import GenRequest, GenResult


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


def prefix_hit_floor(requests: Sequence[GenRequest], block_size: int, max_num_seqs: int) -> int:
    """The fewest prefix-cache hits (tokens) a caching engine must count for ``requests`` sent at once to a
    pool that holds them all (nothing evicted, nothing preempted), admitting at most ``max_num_seqs`` at a time.

    Requests are grouped by their first block of tokens. Request ``r`` can reuse from ``q`` the whole
    blocks of their common prefix, short of ``r``'s last prompt token (never a 100% hit):
    ``reuse(r, q)``; ``floor(r)`` is its least over the rest of ``r``'s group. Within a group, the requests
    admitted before any of them finished its prefill all run at once, so at most ``max_num_seqs`` of
    them; every other one is admitted after some member's prompt blocks were computed and hits at least
    ``floor(r)``. The bound: per group, the sum of ``floor(r)`` less its ``max_num_seqs`` largest terms."""
    groups: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)
    for r in requests:
        if len(r.prompt_token_ids) > block_size:
            groups[tuple(r.prompt_token_ids[:block_size])].append(list(r.prompt_token_ids))
    total = 0
    for prompts in groups.values():
        floors = []
        for i, r in enumerate(prompts):
            cap = (len(r) - 1) // block_size * block_size
            reuse = [min(cap, _common(r, q) // block_size * block_size) for j, q in enumerate(prompts) if j != i]
            floors.append(min(reuse) if reuse else 0)
        total += sum(sorted(floors)[:max(0, len(floors) - max_num_seqs)])
    return total


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def told_twice_disagreements(result: GenResult, hit_floor: int | None = None) -> list[str]:
    """Every disagreement between counts ``result`` states two ways, or between a count and what kvbench
    knows from outside (the tokens it received; ``hit_floor``, :func:`prefix_hit_floor` of the requests,
    where the run was built to produce that reuse). Needs no events: it holds any engine, a server too."""
    c, problems = result.counters, []
    if c.preemptions_total is not None and c.preemptions is not None and c.preemptions_total != c.preemptions:
        problems.append(f"preemptions_total={c.preemptions_total} (the engine's own total) but its by-mode counts "
                        f"add up to {c.preemptions} ({c.preemptions_recompute} recompute + {c.preemptions_swap} swap)")
    counts = [o.num_preemptions for o in result.outputs]
    if counts and None not in counts and c.preemptions is not None and sum(counts) != c.preemptions:  # type: ignore[arg-type]
        problems.append(f"per-request preemptions add up to {sum(counts)} but the counters say "  # type: ignore[arg-type]
                        f"{c.preemptions_recompute} recompute + {c.preemptions_swap} swap")
    received = sum(len(o.token_ids) for o in result.outputs)
    if c.generated_tokens is not None and c.generated_tokens != received:
        problems.append(f"generated_tokens={c.generated_tokens} but the output tokens received = {received}")
    if c.prefix_cache_hits is not None and c.prefix_cache_queries is not None \
            and c.prefix_cache_hits > c.prefix_cache_queries:
        problems.append(f"prefix_cache_hits={c.prefix_cache_hits} exceeds prefix_cache_queries="
                        f"{c.prefix_cache_queries}")
    cached = [o.cached_tokens for o in result.outputs]
    per_request = sum(cached) if cached and None not in cached else None  # type: ignore[arg-type]
    if per_request is not None and c.prefix_cache_hits is not None and per_request > c.prefix_cache_hits:
        problems.append(f"the responses' cached tokens add up to {per_request} but prefix_cache_hits="
                        f"{c.prefix_cache_hits}: every cached token a response reports is a hit the counter missed")
    if hit_floor:
        for what, value in (("prefix_cache_hits", c.prefix_cache_hits),
                            ("the responses' cached tokens (summed)", per_request)):
            if value is not None and value < hit_floor:
                problems.append(f"{what} = {value}, below the {hit_floor} tokens of reuse the requests' shared "
                                "prefixes guarantee at this concurrency")
    return problems


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
    problems.extend(told_twice_disagreements(result))
    if "recomputed_tokens" in c and "computed_tokens" in c and c["recomputed_tokens"] > c["computed_tokens"]:
        problems.append(f"recomputed_tokens={c['recomputed_tokens']} exceeds computed_tokens={c['computed_tokens']}")
    return problems
