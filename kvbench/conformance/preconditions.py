"""Preconditions of a pinned finding: what the checkpoint or workload must have for a known failure to show.

Some findings only show where the run gives them a chance. llama-server's ``ignore_eos`` bans EOS instead of
only not stopping at it, so its outputs differ from the ground truth only where the ground truth's greedy
choice *is* EOS; on a checkpoint whose greedy outputs never reach EOS the same server passes, and a pin that
reported that pass as "stale" would be a false alarm. An expected failure names such a precondition
(``needs = "greedy_reaches_eos"`` in an expectations file, :mod:`kvbench.conformance.expectations`), the check
records whether it held in its run (:func:`record_precondition`, from evidence the check already has), and the
plugin judges the pin by it (:mod:`kvbench.plugin.expected_failures`): held, the pin is judged as any other
(failed as pinned: expected; passed: stale); not held, the pin was *not exercised* and the check's own verdict
stands; never recorded, the pin is judged as any other (a precondition nobody measured excuses nothing).

A precondition is recorded as the running test's evidence, ``kvbench.evidence.precondition.<name>``: true once
any part of the check saw it hold (a check that compares several runs needs it in one of them for the finding
to show), false when every part that asked saw it fail.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvbench.core.evidence import EVIDENCE_PREFIX, record_evidence, recorded

#: every precondition a pin may name, with what it means (the words a "not exercised" report uses)
PRECONDITIONS: dict[str, str] = {
    "greedy_reaches_eos": ("a ground-truth greedy output the check compared, generated with ignore_eos, contains "
                           "the checkpoint's EOS token"),
    "aborts_reach_running_requests": ("at least one of the workload's aborts was confirmed to reach a request "
                                      "still running (closed after its first token, with tokens still to come); "
                                      "over HTTP the load decides whether the closes land while the requests run"),
    "closed_while_waiting": ("a request's stream was closed before its first token while the bystanders still held "
                             "every slot, long enough after the last close for the engine to act on it; over HTTP "
                             "the load decides it"),
    "preempted": ("the check's pressured run preempted at least once (the engine's preemption counter rose); over "
                  "HTTP how the requests' arrivals overlapped decides it"),
    "pool_ran_dry": ("the check's pressured run ran the KV pool dry: the engine counted a preemption, or failed a "
                     "request in its own words for a full pool, or its streams provably held more KV at once than "
                     "the pool, or a request failed in flight while they held all but one token a stream of it "
                     "(client side); over HTTP how the requests' arrivals overlapped decides it"),
}

#: the evidence name a precondition is recorded under (``kvbench.evidence.`` + this)
EVIDENCE_NAME = "precondition.{}"


def describe(name: str) -> str:
    """What precondition ``name`` means; KeyError naming the known ones for an unknown name."""
    if name not in PRECONDITIONS:
        raise KeyError(f"unknown precondition {name!r} (known: {', '.join(sorted(PRECONDITIONS))})")
    return PRECONDITIONS[name]


def record_precondition(name: str, held: bool) -> bool:
    """Record whether precondition ``name`` held in this part of the running check; returns whether it has held
    in any part so far (the value recorded). Outside a test (a script) nothing is recorded and ``held`` returns."""
    describe(name)  # an unknown name is a bug in the check: fail loudly rather than record what no pin reads
    key = EVIDENCE_NAME.format(name)
    so_far = bool(held) or any(bool(v) for v in recorded(key))
    record_evidence(key, so_far)
    return so_far


def precondition_held(properties: Iterable[tuple[str, Any]], name: str) -> bool | None:
    """From a test's ``user_properties``: whether precondition ``name`` held (True: in some part of the check;
    False: every part that asked saw it fail), or None when the check never recorded it."""
    key = EVIDENCE_PREFIX + EVIDENCE_NAME.format(name)
    values = [bool(v) for n, v in properties if n == key]
    return any(values) if values else None


def eos_token_ids(model_dir: str | Path) -> set[int]:
    """The checkpoint's EOS ids, from ``config.json`` and ``generation_config.json`` (either may give an int or a
    list; transformers takes generation_config's first). Empty when neither names one."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value if isinstance(v, int))
    return ids


def note_greedy_reaches_eos(model_dir: str | Path | None, requests: Sequence[Any],
                            truth_outputs: Sequence[Any]) -> None:
    """Record ``greedy_reaches_eos`` for one comparison: whether a ground-truth output of a greedy request sent with
    ``ignore_eos`` contains one of the checkpoint's EOS ids. Nothing is recorded when the checkpoint is unknown (an
    adapter without ``model_dir``) or nothing was compared."""
    if model_dir is None or not Path(model_dir, "config.json").is_file():
        return
    pairs = [(r, o) for r, o in zip(requests, truth_outputs, strict=False)
             if o is not None and getattr(r, "ignore_eos", True) and not getattr(r, "temperature", 0.0)]
    if not pairs:
        return
    eos = eos_token_ids(model_dir)
    record_precondition("greedy_reaches_eos", any(eos.intersection(o.token_ids) for _, o in pairs))


def note_pool_ran_dry(trace: Any, pool_tokens: int | None,
                      says_pool_full: Callable[[str | None], bool] | None = None) -> bool:
    """Record ``pool_ran_dry`` for a pressured run: the engine counted a preemption, or failed a request in the
    words it has for a full pool only (``says_pool_full``, :meth:`EngineAdapter.says_pool_full
    <kvbench.engines.base.EngineAdapter.says_pool_full>`: llama.cpp's "Context size has been exceeded"), or the
    streams held more KV at once than ``pool_tokens`` (``kvbench.conformance.victims_seen.peak_kv_tokens``: a lower
    bound, from the client's side), or a request failed in flight when the pool was provably all but full
    (:func:`failed_at_a_full_pool`). Returns what it recorded.

    A failure alone is no evidence: it is what a pin on losing work excuses, and a request failing for any other
    reason must not make that pin look exercised. A failure the engine itself puts down to a full pool is: what the
    client sees of the pool misses requests still in their prefill, and those a non-streamed response hides."""
    from kvbench.conformance.victims_seen import peak_kv_tokens

    counters = trace.counters
    preempted = (counters.get("preemptions_recompute") or 0) + (counters.get("preemptions_swap") or 0) > 0
    said = says_pool_full is not None and any(
        says_pool_full(r.error) for r in trace.requests.values() if r.finish_reason == "error")
    held = bool(pool_tokens) and peak_kv_tokens(trace) > pool_tokens
    return record_precondition("pool_ran_dry", preempted or said or held
                               or (bool(pool_tokens) and failed_at_a_full_pool(trace, pool_tokens)))


def failed_at_a_full_pool(trace: Any, pool_tokens: int) -> bool:
    """Whether a request ended with an error at a moment its pool was full, as far as a client can tell: the
    streams in flight then (first token received, not yet ended; the failed one included) held their prompts and
    the tokens received so far, and each may have been one step further in the engine than its client had seen
    (a token on its way), so one token more per stream; the failure counts when that exceeds ``pool_tokens``."""
    streams = [(r, sorted(r.token_times)) for r in trace.requests.values() if r.token_times]
    for failed in trace.requests.values():
        if failed.finish_reason != "error":
            continue
        at = getattr(failed, "finished", None)
        if at is None:
            if not failed.token_times:
                continue
            at = max(failed.token_times)
        need = 0
        for r, times in streams:
            ended = getattr(r, "finished", None)
            ended = times[-1] if ended is None else max(ended, times[-1])
            if r is failed or times[0] <= at <= ended:
                need += r.prompt_len + bisect.bisect_right(times, at) + 1
        if need > pool_tokens:
            return True
    return False
