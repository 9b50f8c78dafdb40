"""What kvbench sees inside transformers' continuous batching: the probe, the log capture, the cross-check.

transformers' ``ContinuousBatchingManager`` keeps no counters, so :class:`Probe` wraps six methods of
the engine's own *instances* (never its classes) and counts from their arguments and results, on the
engine's generation thread. It is white-box and tied to the internals of the version it was written
for (:data:`TESTED_TRANSFORMERS`), so every part of it is guarded:

* a hook whose method is missing, or whose parameters changed (:data:`HOOK_SIGNATURES`), is not
  installed; a hook whose reading of the engine's state raises stops observing. Either way the
  run goes on untouched and the counters that depend on it (:data:`COUNTER_HOOKS`) become ``None``
  with a note naming the hook and why: never a crashed run, never a number we cannot vouch for;
* outside the tested versions the counters are still collected, with a note "untested transformers
  version X" (:func:`transformers_version_note`);
* the probe's counts are held against the engine's own log lines where both exist
  (:func:`cross_check`): ``Offloaded {n} requests ({c} to CPU, {s} soft reset)`` (INFO) for the two
  preemption modes, ``Found a prefix match of {n} tokens`` (DEBUG) for prefix hits, ``Restored
  CPU-offloaded request`` (DEBUG) for swap-ins. A disagreement makes that counter ``None`` and puts
  both numbers in the evidence.

What each counter means is the contract's (:mod:`kvbench.core.counters`). ``prefill_chunks`` in
particular counts the scheduled prefill pieces that did not finish their prompt (transformers marks
the piece that finishes it ``FutureRequestState.has_new_token``): k pieces count k - 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from kvbench.core.counters import Counters
from kvbench.core.trace import StepRecord

LOGGER_NAME = "ContinuousBatchingLogger"
#: transformers release series the probe was written against and tested with
TESTED_TRANSFORMERS: tuple[str, ...] = ("5.24",)

SCHEDULE = "scheduler.schedule_batch"
PREFIX = "cache.search_prefix_match"
OFFLOAD = "offloading_manager.offload_requests"
RESTORE = "offloading_manager.restore_scheduled_requests"
PREPARE = "prepare_next_batch"
UPDATE = "update_batch"
#: not a method: the attribute of a scheduled piece that says it finished its prompt
HAS_NEW_TOKEN = "FutureRequestState.has_new_token"

#: hook -> the parameters (after ``self``) the wrapped method takes in transformers 5.24. A hook whose
#: method takes others is not installed: its arguments may no longer mean what the hook reads from them.
HOOK_SIGNATURES: dict[str, tuple[str, ...]] = {
    SCHEDULE: ("token_budget", "cache_budget"),
    PREFIX: ("request_id", "prompt_ids"),
    OFFLOAD: (),
    RESTORE: ("requests_in_batch",),
    PREPARE: (),
    UPDATE: (),
}

#: counter -> what the probe needs to count it (hooks, or HAS_NEW_TOKEN). Prefix hits enter
#: ``recomputed_tokens`` only with prefix sharing on (see :meth:`Probe.counters`).
COUNTER_HOOKS: dict[str, tuple[str, ...]] = {
    "computed_tokens": (SCHEDULE,),
    "prefill_chunks": (SCHEDULE, HAS_NEW_TOKEN),
    "recomputed_tokens": (SCHEDULE,),
    "preemptions_recompute": (OFFLOAD,),
    "preemptions_swap": (OFFLOAD,),
    "swap_outs": (OFFLOAD,),
    "swap_fallbacks": (OFFLOAD,),
    "swapped_out_bytes": (OFFLOAD,),
    "swap_ins": (RESTORE,),
    "swapped_in_bytes": (RESTORE,),
    "prefix_cache_queries": (PREFIX,),
    "prefix_cache_hits": (PREFIX,),
}

#: log lines worth quoting in evidence (substrings of ContinuousBatchingLogger messages)
_EVIDENCE_PATTERNS = ("Offloaded", "Paged cache initialized", "CPU swap pool", "No requests can be scheduled",
                      "Error in generation loop", "Clamping", "too small")
_MAX_EVIDENCE_LOG_LINES = 20
#: INFO+ lines kept per session (a long serve must not grow without bound; counts are kept apart)
_MAX_KEPT_LOG_LINES = 2000
_OFFLOADED_RE = re.compile(r"Offloaded \d+ requests \((\d+) to CPU, (\d+) soft reset\)")
_PREFIX_MATCH_RE = re.compile(r"Found a prefix match of (\d+) tokens for request")
_RESTORED_RE = re.compile(r"Restored CPU-offloaded request")


def transformers_version_note(version: str | None = None) -> str | None:
    """``None`` for a tested transformers version, else the evidence line saying it is untested.

    ``version`` defaults to the installed distribution's (read from its metadata: transformers itself
    is not imported).
    """
    if version is None:
        try:
            version = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return "hf-cb probe: transformers is not installed"
    series = ".".join(version.split(".")[:2])
    if series in TESTED_TRANSFORMERS:
        return None
    tested = ", ".join(f"{s}.x" for s in TESTED_TRANSFORMERS)
    return (f"hf-cb probe: untested transformers version {version} (written for {tested}): counters are "
            f"still collected, every hook is guarded and cross-checked against the engine's log lines")


# ----------------------------------------------------------------------------------------------------------
# Log capture
# ----------------------------------------------------------------------------------------------------------


class _BelowLevel(logging.Filter):
    """Drops records below ``level``: keeps the engine's own handlers as quiet as they were."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


@dataclass
class LogCounts:
    """What the engine's own log lines say happened (summed over one session)."""

    cpu_offloads: int = 0  # "Offloaded ... (c to CPU, ...)"
    soft_resets: int = 0  # "Offloaded ... (..., s soft reset)"
    offload_lines: int = 0
    prefix_hit_tokens: int = 0  # "Found a prefix match of n tokens" (DEBUG)
    restores: int = 0  # "Restored CPU-offloaded request" (DEBUG)


class LogCapture(logging.Handler):
    """Reads ``ContinuousBatchingLogger`` for the duration of a session.

    The engine logs offloads at INFO and prefix matches and CPU restores at DEBUG, so the logger's
    level is lowered to DEBUG while the session runs; its existing handlers get a filter that keeps
    them at their previous effective level, and everything is restored on exit. INFO and above are
    kept as lines (at most :data:`_MAX_KEPT_LOG_LINES`); every record is parsed into :class:`LogCounts`.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []
        self.dropped_lines = 0
        self.counts = LogCounts()
        self._lock_lines = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        with self._lock_lines:
            self._count(message)
            if record.levelno >= logging.INFO:
                if len(self.lines) < _MAX_KEPT_LOG_LINES:
                    self.lines.append(f"{record.levelname}: {message}")
                else:
                    self.dropped_lines += 1

    def _count(self, message: str) -> None:
        c = self.counts
        if m := _OFFLOADED_RE.search(message):
            c.cpu_offloads += int(m.group(1))
            c.soft_resets += int(m.group(2))
            c.offload_lines += 1
        elif m := _PREFIX_MATCH_RE.search(message):
            c.prefix_hit_tokens += int(m.group(1))
        elif _RESTORED_RE.search(message):
            c.restores += 1

    @contextlib.contextmanager
    def attached(self) -> Iterator[LogCapture]:
        logger = logging.getLogger(LOGGER_NAME)
        previous_level = logger.level
        previous_effective = logger.getEffectiveLevel()
        quieter = _BelowLevel(previous_effective)
        foreign = list(logger.handlers)
        for handler in foreign:
            handler.addFilter(quieter)
        logger.addHandler(self)
        if previous_effective > logging.DEBUG:
            logger.setLevel(logging.DEBUG)
        try:
            yield self
        finally:
            logger.setLevel(previous_level)
            logger.removeHandler(self)
            for handler in foreign:
                handler.removeFilter(quieter)

    def evidence(self) -> list[str]:
        """The lines worth quoting: offloads, cache sizing, errors (at most a screenful, plus a count)."""
        with self._lock_lines:
            picked = [line for line in self.lines
                      if any(p in line for p in _EVIDENCE_PATTERNS) and "psutil" not in line]
        out = [f"log: {line}" for line in picked[:_MAX_EVIDENCE_LOG_LINES]]
        if len(picked) > _MAX_EVIDENCE_LOG_LINES:
            out.append(f"log: ... {len(picked) - _MAX_EVIDENCE_LOG_LINES} more such lines")
        return out


def cross_check(counters: Counters, logs: LogCounts, *, prefix_sharing: bool, cpu_pool: bool
                ) -> tuple[Counters, list[str]]:
    """Hold the probe's counters against what the engine's log lines say; returns (counters, evidence).

    A counter the log disagrees with becomes ``None`` (with those derived from it) and the evidence
    names both numbers: a number two witnesses disagree on is not reported. A counter already
    ``None`` is not checked. Prefix hits are checked only with prefix sharing on and swap-ins only
    with a CPU pool (the engine logs nothing otherwise).
    """
    checks: list[tuple[str, int, str, tuple[str, ...]]] = [
        ("preemptions_recompute", logs.soft_resets, "'Offloaded ... soft reset' INFO lines",
         ("preemptions_recompute", "swap_fallbacks", "recomputed_tokens")),
        ("preemptions_swap", logs.cpu_offloads, "'Offloaded ... to CPU' INFO lines",
         ("preemptions_swap", "swap_outs", "swapped_out_bytes")),
    ]
    if prefix_sharing:
        checks.append(("prefix_cache_hits", logs.prefix_hit_tokens, "'Found a prefix match' DEBUG lines",
                       ("prefix_cache_hits", "recomputed_tokens")))
    if cpu_pool:
        checks.append(("swap_ins", logs.restores, "'Restored CPU-offloaded request' DEBUG lines",
                       ("swap_ins", "swapped_in_bytes")))
    lines: list[str] = []
    dropped: dict[str, None] = {}
    for name, logged, source, affected in checks:
        probed = getattr(counters, name)
        if probed is None:
            continue
        if probed == logged:
            lines.append(f"hf-cb cross-check: {name} = {probed}, as the engine's {source} say")
            continue
        lines.append(f"hf-cb cross-check FAILED: {name}: probe counted {probed}, the engine's {source} say "
                     f"{logged}; not reported ({', '.join(affected)} set to None)")
        dropped.update(dict.fromkeys(affected))
    return dataclasses.replace(counters, **dict.fromkeys(dropped)), lines


# ----------------------------------------------------------------------------------------------------------
# The probe: instance-level wrappers on the engine's own objects, run on its generation thread
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ProbeStats:
    """Written by the generation thread only; read after it has been joined."""

    per_request_computed: Counter = field(default_factory=Counter)
    per_request_queries: Counter = field(default_factory=Counter)
    per_request_hits: Counter = field(default_factory=Counter)
    per_request_preemptions: Counter = field(default_factory=Counter)
    totals: Counter = field(default_factory=Counter)
    num_steps: int = 0
    peak_kv_usage: float = 0.0


class Probe:
    """Watches one ``ContinuousBatchProcessor`` from inside its generation thread.

    Wraps methods on the engine's *instances* (never its classes), records cumulative statistics and
    pushes timestamped events (``time.perf_counter``) onto a thread-safe queue that the caller's
    thread drains: ``("admitted", rid, t)``, ``("preempted", rid, t, mode)``, ``("resumed", rid, t)``,
    ``("step", StepRecord)``. ``missing`` names the hooks (and attributes) that could not be installed,
    or stopped observing, and why. A hook never changes what the engine does: it calls the original
    once with the same arguments and returns its result, and its own reading is inside a guard.
    """

    #: hook -> (where the wrapped method lives, from the batch processor; the method of this class that
    #: builds its wrapper). The hook's name is the 5.24 path; a later version may move the method.
    HOOKS: dict[str, tuple[str, str]] = {  # noqa: RUF012 - read-only table
        SCHEDULE: (SCHEDULE, "_make_schedule_hook"), PREFIX: (PREFIX, "_make_prefix_hook"),
        OFFLOAD: (OFFLOAD, "_make_offload_hook"), RESTORE: (RESTORE, "_make_restore_hook"),
        PREPARE: (PREPARE, "_make_prepare_hook"), UPDATE: (UPDATE, "_make_update_hook"),
    }

    def __init__(self, batch_processor: Any, clock: Callable[[], float] = time.perf_counter,
                 signatures: dict[str, tuple[str, ...]] | None = None):
        self.bp = batch_processor
        self.clock = clock
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = ProbeStats()
        self.missing: dict[str, str] = {}
        self._signatures = HOOK_SIGNATURES if signatures is None else signatures
        self._wrapped: list[tuple[Any, str]] = []
        self._seen_queries: set[tuple[str, int]] = set()
        self._admitted: set[str] = set()
        self._preempted: set[str] = set()
        self._step_t0: float | None = None
        self._step_tokens = (0, 0)
        self._step_preempted = 0
        for name, (target, maker) in self.HOOKS.items():
            self._wrap(name, target, getattr(self, maker))

    # -- installation ----------------------------------------------------------------------------------

    def _wrap(self, name: str, target: str, make: Callable[[Callable], Callable]) -> None:
        owner_path, _, method = target.rpartition(".")
        owner: Any = self.bp
        try:
            for part in owner_path.split(".") if owner_path else []:
                owner = getattr(owner, part)
            original = getattr(owner, method)
        except AttributeError as e:
            self.missing[name] = f"{target} not found in this transformers version ({e})"
            return
        expected = self._signatures.get(name)
        if expected is not None:
            try:
                found = tuple(inspect.signature(original).parameters)
            except (TypeError, ValueError):  # not introspectable: trust the name
                found = expected
            if found != expected:
                self.missing[name] = (f"signature changed: expected ({', '.join(expected)}), "
                                      f"found ({', '.join(found)})")
                return
        setattr(owner, method, make(original))
        self._wrapped.append((owner, method))

    def detach(self) -> None:
        """Remove the instance attributes (the class methods show through again) and break cycles."""
        for owner, method in self._wrapped:
            with contextlib.suppress(AttributeError):
                delattr(owner, method)
        self._wrapped.clear()

    def _observe(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the hook ``name``'s reading ``fn``; if it raises, the hook stops observing (its counters
        become None) and the engine carries on. Returns ``fn``'s result, or None."""
        if name in self.missing:
            return None
        try:
            return fn(*args)
        except Exception as e:  # the engine's internals changed under us: stop reading, never crash it
            self.missing[name] = f"stopped observing: {type(e).__name__}: {e}"
            return None

    # -- hooks -----------------------------------------------------------------------------------------

    def _make_schedule_hook(self, original: Callable) -> Callable:
        def schedule_batch(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self._observe(SCHEDULE, self._on_schedule, result)
            return result

        return schedule_batch

    def _on_schedule(self, result: Any) -> None:
        batch = result[0]
        if batch:
            self._on_batch(batch)

    def _on_batch(self, batch: list[Any]) -> None:
        t = self.clock()
        prefill = decode = 0
        stats = self.stats
        for future in batch:
            state, q = future.state, future.query_length
            rid = state.request_id
            stats.per_request_computed[rid] += q
            # A decode feeds back one generated token; anything else (incl. a soft reset's re-prefill,
            # whose generated tokens became prompt tokens) is prefill work.
            if q == 1 and state.generated_len() > 0:
                decode += q
            else:
                prefill += q
            self._count_chunk(future)
            if rid not in self._admitted:
                self._admitted.add(rid)
                self.events.put(("admitted", rid, t))
            if rid in self._preempted:
                self._preempted.discard(rid)
                self.events.put(("resumed", rid, t))
        stats.totals["computed_tokens"] += prefill + decode
        self._step_tokens = (prefill, decode)

    def _count_chunk(self, future: Any) -> None:
        """The contract's ``prefill_chunks``: a scheduled piece that leaves prompt tokens for later
        (transformers: ``has_new_token`` False, i.e. ``remaining_prefill_tokens`` not empty). A decode,
        and the piece that finishes a prompt, sample a token: not counted."""
        if HAS_NEW_TOKEN in self.missing:
            return
        finishes = getattr(future, "has_new_token", None)
        if not isinstance(finishes, bool):
            self.missing[HAS_NEW_TOKEN] = f"a scheduled piece has has_new_token={finishes!r}, not a bool"
            return
        if not finishes:
            self.stats.totals["prefill_chunks"] += 1

    def _make_prefix_hook(self, original: Callable) -> Callable:
        def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
            matched = original(request_id, prompt_ids)
            self._observe(PREFIX, self._on_prefix_match, request_id, prompt_ids, matched)
            return matched

        return search_prefix_match

    def _on_prefix_match(self, request_id: str, prompt_ids: list[int], matched: int) -> None:
        # A request that is searched but not scheduled is searched again next step: count its
        # query once per (request, prompt length); a soft reset makes a longer prompt, a new query.
        key = (request_id, len(prompt_ids))
        if key not in self._seen_queries:
            self._seen_queries.add(key)
            self.stats.per_request_queries[request_id] += len(prompt_ids)
        self.stats.per_request_hits[request_id] += int(matched)

    def _make_offload_hook(self, original: Callable) -> Callable:
        def offload_requests(*args: Any, **kwargs: Any) -> Any:
            before = self._observe(OFFLOAD, lambda: set(self.bp.scheduler.active_requests))
            result = original(*args, **kwargs)
            if before is not None:
                self._observe(OFFLOAD, self._on_offload, before)
            return result

        return offload_requests

    def _on_offload(self, before: set[str]) -> None:
        t = self.clock()
        scheduler, om = self.bp.scheduler, self.bp.offloading_manager
        cpu_blocks = getattr(om, "_request_id_to_cpu_blocks", {})
        has_cpu_pool = getattr(om, "_cpu_pool", None) is not None
        for rid in sorted(before - set(scheduler.active_requests)):
            state = scheduler.waiting_requests.get(rid)
            if state is None:  # left for another reason (finished, cancelled): not an offload
                continue
            if state.is_cpu_offloaded:
                mode = "swap"
                self.stats.totals["swapped_out_blocks"] += sum(len(b) for b in cpu_blocks.get(rid, {}).values())
            else:
                mode = "recompute"
                if has_cpu_pool:
                    self.stats.totals["swap_fallbacks"] += 1
            self.stats.totals[f"preemptions_{mode}"] += 1
            self.stats.per_request_preemptions[rid] += 1
            self._preempted.add(rid)
            self._step_preempted += 1
            self.events.put(("preempted", rid, t, mode))

    def _make_restore_hook(self, original: Callable) -> Callable:
        def restore_scheduled_requests(requests_in_batch: list[Any]) -> Any:
            seen = self._observe(RESTORE, self._before_restore, requests_in_batch)
            result = original(requests_in_batch)
            if seen is not None:
                self.stats.totals["swap_ins"] += seen[0]
                self.stats.totals["swapped_in_blocks"] += seen[1]
            return result

        return restore_scheduled_requests

    def _before_restore(self, requests_in_batch: list[Any]) -> tuple[int, int]:
        """(requests, blocks) about to come back from the CPU pool (read before the engine pops them)."""
        cpu_blocks = getattr(self.bp.offloading_manager, "_request_id_to_cpu_blocks", {})
        if getattr(self.bp.offloading_manager, "_cpu_pool", None) is None:
            return 0, 0  # the engine returns at once without a pool
        restored = [f.state.request_id for f in requests_in_batch if f.state.is_cpu_offloaded]
        return len(restored), sum(len(b) for rid in restored for b in cpu_blocks.get(rid, {}).values())

    def _make_prepare_hook(self, original: Callable) -> Callable:
        def prepare_next_batch(*args: Any, **kwargs: Any) -> Any:
            t0 = self.clock()
            ready = original(*args, **kwargs)
            if ready:
                self._step_t0 = t0
            return ready

        return prepare_next_batch

    def _make_update_hook(self, original: Callable) -> Callable:
        def update_batch(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self._observe(UPDATE, self._on_step_end)
            return result

        return update_batch

    def _on_step_end(self) -> None:
        t = self.clock()
        scheduler, cache = self.bp.scheduler, self.bp.cache
        waiting = list(scheduler.waiting_requests.values())
        swapped = sum(1 for s in waiting if s.is_cpu_offloaded)
        kv_usage = 1.0 - float(cache.compute_free_capacity())
        cpu_pool = getattr(self.bp.offloading_manager, "_cpu_pool", None)
        cpu_usage = None
        if cpu_pool is not None and cpu_pool.num_sectors:
            cpu_usage = 1.0 - cpu_pool.num_free_sectors / cpu_pool.num_sectors
        prefill, decode = self._step_tokens
        record = StepRecord(t=t, duration=t - (self._step_t0 if self._step_t0 is not None else t),
                            num_running=len(scheduler.active_requests), num_waiting=len(waiting) - swapped,
                            num_swapped=swapped, kv_usage=kv_usage, cpu_kv_usage=cpu_usage,
                            num_prefill_tokens=prefill, num_decode_tokens=decode,
                            num_preempted=self._step_preempted)
        self._step_preempted = 0
        self._step_tokens = (0, 0)
        self.stats.num_steps += 1
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage, kv_usage)
        self.events.put(("step", record))

    # -- results ---------------------------------------------------------------------------------------

    def prefix_sharing(self) -> bool:
        """Whether the engine shares prefix blocks (False if it cannot tell)."""
        return bool(getattr(getattr(self.bp, "cache", None), "use_prefix_sharing", False))

    def has_cpu_pool(self) -> bool:
        return getattr(getattr(self.bp, "offloading_manager", None), "_cpu_pool", None) is not None

    def unavailable(self, counter: str) -> list[str]:
        """The missing hooks ``counter`` depends on (empty: the probe can count it)."""
        needs = list(COUNTER_HOOKS.get(counter, ()))
        if counter == "recomputed_tokens" and self.prefix_sharing():
            needs.append(PREFIX)  # prefix hits are subtracted from the work done
        return [n for n in needs if n in self.missing]

    def counters(self, produced: dict[str, tuple[int, int]]) -> tuple[Counters, dict[str, int], list[str]]:
        """(counters, per-request recomputed tokens, notes). Call after the generation thread stopped.

        ``produced`` maps request id -> (prompt length, tokens generated). A counter whose hooks are
        missing or stopped observing is ``None``, and a note says which hook; so is ``leaked_blocks``
        if the block tables cannot be read. Prefix counters are ``None`` with prefix sharing off
        (the engine does no lookup).
        """
        s = self.stats
        notes: list[str] = []
        per_block = self._read(lambda: int(next(iter(self.bp.cache.cache_allocators.values())).bytes_per_block))
        values: dict[str, Any] = {
            "computed_tokens": s.totals["computed_tokens"],
            "prefill_chunks": s.totals["prefill_chunks"],
            "preemptions_recompute": s.totals["preemptions_recompute"],
            "preemptions_swap": s.totals["preemptions_swap"],
            "swap_outs": s.totals["preemptions_swap"],
            "swap_fallbacks": s.totals["swap_fallbacks"],
            "swapped_out_bytes": None if per_block is None else s.totals["swapped_out_blocks"] * per_block,
            "swap_ins": s.totals["swap_ins"],
            "swapped_in_bytes": None if per_block is None else s.totals["swapped_in_blocks"] * per_block,
        }
        if self.prefix_sharing():
            values["prefix_cache_queries"] = sum(s.per_request_queries.values())
            values["prefix_cache_hits"] = sum(s.per_request_hits.values())
        recomputed: dict[str, int] = {}
        for rid, (prompt_len, generated) in produced.items():
            # Without preemption a request computes its prompt and every generated token but the last.
            ideal = prompt_len + max(generated - 1, 0)
            done = s.per_request_computed[rid] + s.per_request_hits[rid]
            recomputed[rid] = max(done - ideal, 0)
        values["recomputed_tokens"] = sum(recomputed.values())
        for name in list(values):
            if values[name] is not None and (gone := self.unavailable(name)):
                values[name] = None
                notes.append(f"hf-cb probe: {name} not exposed: hook {', '.join(gone)} "
                             f"{'; '.join(self.missing[g] for g in gone)}")
        if values["recomputed_tokens"] is None:
            recomputed = {}
        values["leaked_blocks"] = self._read(lambda: sum(
            len(table) for allocator in self.bp.cache.cache_allocators.values()
            for table in allocator.block_table.values()))
        values["num_gpu_blocks"] = self._read(lambda: int(self.bp.cache.num_blocks))
        if values["leaked_blocks"] is None:
            notes.append("hf-cb probe: leaked_blocks not exposed: the cache's block tables could not be read")
        return Counters.from_dict(values), recomputed, notes

    @staticmethod
    def _read(fn: Callable[[], Any]) -> Any:
        """An end-of-run reading of the engine's state; None if its internals changed."""
        try:
            return fn()
        except Exception:
            return None
