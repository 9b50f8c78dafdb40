"""Do an engine's counters tell the truth? They must agree with each other, with the engine's own
events and with what kvbench saw from outside (the outputs).

* per-request preemption counts add up to the totals, and the events count the same by mode;
* ``recomputed_tokens`` equals the KV discarded by recompute preemptions and computed again,
  less what the prefix cache served on resume (:func:`recomputed_from_events`);
* swap byte and request counters equal the sums of the swap events;
* ``generated_tokens`` equals the output tokens kvbench received.

Counts an engine tells twice are checked against each other without its events
(:func:`told_twice_disagreements`): the engine's single preemption total against its by-mode counts and
against its per-request counts, per-request preemption and prefix-cache counts against the run's totals,
generated tokens against the tokens received; and prefix-cache hits against the reuse the requests can
give, from below (:func:`prefix_hit_floor`, what the requests were built to produce) and from above
(:func:`prefix_hit_ceiling`, the most they can give, once per admission). A count an engine tells only
once (vLLM's one preemption total, read as its recompute count) is never compared with itself
(:func:`told_twice`).

What kvbench itself sent and received is a second telling of every count the engine keeps about it
(:func:`client_view_counts`): tokens received against generated tokens, prompt tokens sent against the
prompt-token counter, finishes by reason against the engine's finishes by reason.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
            reuse = [min(cap, common_prefix(r, q) // block_size * block_size) for j, q in enumerate(prompts) if j != i]
            floors.append(min(reuse) if reuse else 0)
        total += sum(sorted(floors)[:max(0, len(floors) - max_num_seqs)])
    return total


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def first_hit_cap(requests: Sequence[GenRequest], result: GenResult, index: int, block_size: int | None) -> int:
    """The most prompt tokens of ``requests[index]``'s first admission a prefix cache could serve: the whole
    blocks its prompt shares with another request's sequence (prompt and output: whichever ran first),
    short of its last prompt token (never a 100% hit). With ``block_size`` unknown (None), any shared prefix
    counts, to the token."""
    prompt = list(requests[index].prompt_token_ids)
    shared = max((common_prefix(prompt, [*r.prompt_token_ids, *o.token_ids])
                  for i, (r, o) in enumerate(zip(requests, result.outputs, strict=True)) if i != index), default=0)
    shared = min(shared, len(prompt) - 1)
    return shared // block_size * block_size if block_size else shared


def prefix_hit_ceiling(requests: Sequence[GenRequest], result: GenResult, block_size: int) -> int | None:
    """The most prefix-cache hits (tokens) ``result`` can have counted for ``requests``, each admission counted
    once; None when the run's admissions cannot be bounded (preemptions happened, or may have, and the engine
    says neither how many nor whose).

    A request's first admission can reuse only whole blocks of its prompt that some other request's sequence
    (its prompt and output, whichever ran first) shares with it, short of its last prompt token (never a 100%
    hit). Each later admission (after a preemption) can reuse at most its own sequence so far, short of its
    last token. Per-request preemption counts bound the later admissions of each request; a run total bounds
    them with the longest sequence. A lookup retried while the request waits for room is not an admission:
    an engine that counts its hits again at each retry overshoots this bound."""
    outputs = result.outputs
    total = sum(first_hit_cap(requests, result, i, block_size) for i in range(len(requests)))
    resumed_caps = [max(0, len(r.prompt_token_ids) + len(o.token_ids) - 1) // block_size * block_size
                    for r, o in zip(requests, outputs, strict=True)]
    counts = [o.num_preemptions for o in outputs]
    if counts and None not in counts:
        return total + sum(n * cap for n, cap in zip(counts, resumed_caps, strict=True))  # type: ignore[operator]
    c = result.counters
    preemptions = c.preemptions if c.preemptions is not None else c.preemptions_total
    if preemptions is None:
        return None
    return total + preemptions * max(resumed_caps, default=0)


def hits_over_ceiling(result: GenResult, ceiling: int | None) -> str | None:
    """The disagreement, naming both figures, when ``result``'s prefix-cache hits exceed ``ceiling``
    (:func:`prefix_hit_ceiling`); None when they do not, or either is unknown."""
    hits = result.counters.prefix_cache_hits
    if ceiling is None or hits is None or hits <= ceiling:
        return None
    return (f"prefix_cache_hits={hits} exceeds the {ceiling} tokens the requests can reuse, each admission counted "
            "once (a hit counted again when an admission was retried, or one that never happened)")


@dataclass(frozen=True)
class ToldTwice:
    """One count told two ways: the engine's figure (``counter``) and the other telling of it (``other``, what
    it is in ``source``); they agree when they are equal."""

    counter: str
    engine: float
    other: float
    source: str

    @property
    def agrees(self) -> bool:
        return self.engine == self.other

    def problem(self) -> str:
        """The disagreement, naming both figures."""
        return f"{self.counter}={self.engine:g} but {self.source} = {self.other:g}"


def client_view_counts(requests: Sequence[GenRequest], result: GenResult) -> list[ToldTwice]:
    """Each count the engine keeps about what kvbench sent and received, beside kvbench's own figure; only
    the counts the engine exposes. Prompt tokens count once per request that was given at least one token
    (cached prompt tokens included, as vLLM and the reference server count them); finishes are the requests
    kvbench saw finish ``length`` or ``stop``, not those refused before they reached the engine."""
    c, outputs = result.counters, result.outputs
    counts = []
    if c.generated_tokens is not None:
        counts.append(ToldTwice("generated_tokens", c.generated_tokens, sum(len(o.token_ids) for o in outputs),
                                "the output tokens kvbench received"))
    if c.prompt_tokens is not None:
        sent = sum(len(r.prompt_token_ids) for r, o in zip(requests, outputs, strict=True) if o.token_ids)
        counts.append(ToldTwice("prompt_tokens", c.prompt_tokens, sent,
                                "the prompt tokens kvbench sent in the requests that were answered"))
    for reason in ("length", "stop"):
        counter = f"finished_{reason}"
        value = getattr(c, counter)
        if value is not None:
            seen = sum(1 for o in outputs if o.finish_reason == reason)
            counts.append(ToldTwice(counter, value, seen, f"the requests kvbench saw finish {reason!r}"))
    return counts


def told_twice(result: GenResult) -> tuple[list[str], list[str]]:
    """(the counts ``result`` tells two ways, those it tells once), by name, as
    :func:`told_twice_disagreements` compares them."""
    c, outputs = result.counters, result.outputs
    tellings = {
        "preemptions_total": c.preemptions_total is not None and c.preemptions is not None,
        "request_preemptions": c.request_preemptions is not None
        and (c.preemptions_total is not None or c.preemptions is not None),
        "per-request preemptions": c.preemptions is not None and bool(outputs)
        and all(o.num_preemptions is not None for o in outputs),
        "generated_tokens": c.generated_tokens is not None,
        "per-response cached tokens": c.prefix_cache_hits is not None and bool(outputs)
        and all(o.cached_tokens is not None for o in outputs),
    }
    twice = [what for what, both in tellings.items() if both]
    once = []
    if c.preemptions_total is None and c.preemptions is not None and "request_preemptions" not in twice \
            and "per-request preemptions" not in twice:
        once.append("preemptions (one count, by mode or in total, and no other telling of it)")
    if c.prefix_cache_hits is not None and "per-response cached tokens" not in twice:
        once.append("prefix_cache_hits (no response says its cached tokens)")
    return twice, once


def told_twice_disagreements(result: GenResult, hit_floor: int | None = None,
                             hit_ceiling: int | None = None) -> list[str]:
    """Every disagreement between counts ``result`` states two ways, or between a count and what kvbench
    knows from outside (the tokens it received; ``hit_floor``, :func:`prefix_hit_floor` of the requests,
    where the run was built to produce that reuse; ``hit_ceiling``, :func:`prefix_hit_ceiling`, the most
    reuse the run can give). Needs no events: it holds any engine, a server too. A count told once is not
    compared with itself (:func:`told_twice`)."""
    c, problems = result.counters, []
    if c.preemptions_total is not None and c.preemptions is not None and c.preemptions_total != c.preemptions:
        problems.append(f"preemptions_total={c.preemptions_total} (the engine's own total) but its by-mode counts "
                        f"add up to {c.preemptions} ({c.preemptions_recompute} recompute + {c.preemptions_swap} swap)")
    total = c.preemptions_total if c.preemptions_total is not None else c.preemptions
    if c.request_preemptions is not None and total is not None and c.request_preemptions != total:
        problems.append(f"request_preemptions={c.request_preemptions} (each finished request's own count, summed) "
                        f"but the engine's preemption count is {total}")
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
    elif per_request is not None and c.prefix_cache_hits is not None and total == 0 \
            and per_request != c.prefix_cache_hits:
        problems.append(f"prefix_cache_hits={c.prefix_cache_hits} but the responses' cached tokens add up to "
                        f"{per_request}, in a run without preemptions (every admission was a request's first)")
    if (over := hits_over_ceiling(result, hit_ceiling)) is not None:
        problems.append(over)
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
    admitted = [e for e in events if e.kind == "admitted"]
    if admitted and all("cached_tokens" in e.data for e in admitted):
        differ("the cached tokens of the admitted events (one per admission)", "prefix_cache_hits",
               sum(int(e.data["cached_tokens"]) for e in admitted))
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
