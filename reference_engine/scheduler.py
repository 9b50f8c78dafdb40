"""The scheduler: one rule, applied every step.

    Each scheduled request's ``num_computed_tokens`` catches up with its ``num_tokens``,
    within the token budget (``max_num_batched_tokens``) and ``max_num_seqs``.

There is no prefill phase and no decode phase: a decode is a request one token behind, a
chunked prefill one whose gap exceeds the budget, a prefix hit one admitted with some tokens
already computed, and a recompute one whose computed tokens were reset to zero.

Order within a step: running decodes, then running prefill chunks, then swapped requests
(resumed before any new admission, and never in a step that preempted), then waiting ones.
When a running request cannot get a block, a victim is preempted: FCFS takes the latest
admitted, the priority policy the least important (highest ``priority`` value, then latest
arrival). ``recompute`` frees the victim's blocks (shared and cached blocks survive through
their refcounts) and puts it back at the head of the waiting queue; ``swap`` moves them to the
host pool, or falls back to recompute when the host pool is full.

Constructible from plain numbers: no model, no tensors.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from reference_engine.block_manager import BlockManager
from reference_engine.events import EngineEvent
from reference_engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start`` are computed this step.

    ``completes`` (the chunk reaches the end of the sequence, so a token is sampled) is fixed when the
    chunk is scheduled: after ``update`` appends the sampled token the request is one token longer.
    """

    request: Request
    start: int
    num_tokens: int
    completes: bool


@dataclass
class SchedulerOutput:
    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    swapped_out_requests: dict[str, int] = field(default_factory=dict)  # request id -> blocks moved
    swapped_in_requests: dict[str, int] = field(default_factory=dict)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not (c.num_tokens == 1 and c.completes))

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.swap_out and not self.swap_in


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = False, preemption_mode: str = "recompute",
                 scheduling_policy: str = "fcfs", clock: Callable[[], float] = time.monotonic):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.policy = scheduling_policy
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.events: list[EngineEvent] = []
        self.step_index = 0
        self._admit_seq = 0
        self.counters: dict[str, int] = dict.fromkeys(
            ("preemptions_recompute", "preemptions_swap", "swap_fallbacks", "swap_outs", "swap_ins",
             "prefill_chunks", "computed_tokens", "recomputed_tokens", "generated_tokens"), 0)

    # ------------------------------------------------------------------ queues
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue_waiting(request, front=False)

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        request.status = RequestStatus.WAITING
        if self.policy == "priority":
            keys = [r.priority_key() for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, request.priority_key()), request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def record_event(self, kind: str, request_id: str, **data) -> None:
        self.events.append(EngineEvent(kind, request_id, self.step_index, self.clock(), data))

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        out = SchedulerOutput(self.step_index)
        self._budget = self.max_num_batched_tokens
        self._scheduled: dict[str, ScheduledChunk] = {}
        self._out = out
        self._schedule_running()
        if out.num_preempted == 0:
            self._schedule_swapped()
        # Swapped requests resume before new admissions, and a step that had to preempt admits
        # nobody (admitting then would only preempt again next step).
        if not self.swapped and out.num_preempted == 0:
            self._schedule_waiting()
        out.chunks = list(self._scheduled.values())
        for chunk in out.chunks:
            if not chunk.completes:
                self.counters["prefill_chunks"] += 1
        return out

    def _schedule_running(self) -> None:
        # Decodes first, then partial prefills, each in admission order.
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.admitted_seq))
        for req in order:
            if req.status is not RequestStatus.RUNNING or self._budget == 0:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, self._budget)
            while not self.bm.allocate_slots(req, num_new):
                victim = self._pick_victim(candidates=self.running)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self._add_chunk(req, num_new)

    def _schedule_swapped(self) -> None:
        if self.policy == "priority" and len(self.swapped) > 1:
            # Resume the most important first (stable: equal keys keep their swap-out order).
            self.swapped = deque(sorted(self.swapped, key=Request.priority_key))
        while self.swapped and self._budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            remaining = req.num_tokens - req.num_computed_tokens
            if not self.chunked and remaining > self._budget:
                return
            num_new = min(remaining, self._budget)
            held = len(self.bm.host_tables[req.request_id])
            extra = self.bm.blocks_needed(req.num_computed_tokens + num_new) - held
            if not self.bm.can_swap_in(req.request_id, max(extra, 0)):
                return
            self.swapped.popleft()
            mapping = self.bm.swap_in(req)
            self._out.swap_in.extend(mapping)
            self._out.swapped_in_requests[req.request_id] = len(mapping)
            self.counters["swap_ins"] += 1
            allocated = self.bm.allocate_slots(req, num_new)
            assert allocated, "can_swap_in checked the capacity"
            self._make_running(req)
            self._add_chunk(req, num_new)

    def _schedule_waiting(self) -> None:
        while self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self.bm.find_cached_prefix(req)
            num_new = req.num_tokens - len(hits) * self.bm.block_size
            if not self.chunked and num_new > self._budget:
                return
            num_new = min(num_new, self._budget)
            while not self.bm.allocate_slots(req, num_new, hits):
                victim = self._pick_priority_victim_for(req)
                if victim is None:
                    return
                self._preempt(victim)
            self.waiting.popleft()
            cached = len(hits) * self.bm.block_size
            req.num_computed_tokens = cached
            req.num_cached_tokens = cached
            req.num_prefix_hit_tokens += cached
            self.bm.record_prefix_query(req.num_tokens, cached)
            if cached:
                self.record_event("prefix_hit", req.request_id, tokens=cached)
            self.record_event("admitted", req.request_id, cached_tokens=cached, resumed=req.num_preemptions > 0)
            self._make_running(req)
            self._add_chunk(req, num_new)

    def _make_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self._admit_seq += 1
        req.admitted_seq = self._admit_seq
        self.running.append(req)

    def _add_chunk(self, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        self._scheduled[req.request_id] = ScheduledChunk(req, start, num_new, start + num_new == req.num_tokens)
        self._budget -= num_new

    # ------------------------------------------------------------------ preemption
    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority_key(), r.admitted_seq))
        return max(candidates, key=lambda r: r.admitted_seq)

    def _pick_priority_victim_for(self, req: Request) -> Request | None:
        """Under the priority policy, a running request strictly less important than ``req``.

        None in a step that swapped in: a swap-out now could take the host blocks just freed by the
        swap-in before its copy has read them (or swap the resumed request straight back out).
        """
        if self.policy != "priority" or self._out.swap_in:
            return None
        lower = [r for r in self.running if r.priority_key() > req.priority_key()]
        return self._pick_victim(lower) if lower else None

    def _preempt(self, victim: Request) -> None:
        chunk = self._scheduled.pop(victim.request_id, None)
        if chunk is not None:  # scheduled earlier this step: give its budget back
            self._budget += chunk.num_tokens
        self.running.remove(victim)
        victim.num_preemptions += 1
        self._out.num_preempted += 1
        num_blocks = len(self.bm.block_tables.get(victim.request_id, []))
        if self.preemption_mode == "swap":
            if self.bm.can_swap_out(victim.request_id):
                self._out.swap_out.extend(self.bm.swap_out(victim.request_id))
                self._out.swapped_out_requests[victim.request_id] = num_blocks
                victim.status = RequestStatus.SWAPPED
                self.swapped.append(victim)
                self.counters["preemptions_swap"] += 1
                self.counters["swap_outs"] += 1
                self.record_event("preempted", victim.request_id, mode="swap", blocks=num_blocks)
                return
            self.counters["swap_fallbacks"] += 1
            self.record_event("swap_fallback", victim.request_id, blocks=num_blocks,
                        free_cpu_blocks=self.bm.num_free_cpu_blocks)
        discarded = victim.num_computed_tokens
        self.bm.free(victim.request_id)
        victim.num_computed_tokens = 0
        self.counters["preemptions_recompute"] += 1
        self.record_event("preempted", victim.request_id, mode="recompute", blocks=num_blocks,
                          tokens_discarded=discarded)
        self._enqueue_waiting(victim, front=True)

    # ------------------------------------------------------------------ after the model ran
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, cache full blocks, append sampled tokens, finish requests.

        Returns the requests that got a new token or finished this step.
        """
        touched: list[Request] = []
        for chunk in out.chunks:
            req = chunk.request
            end = chunk.start + chunk.num_tokens
            req.num_computed_tokens = end
            self.counters["computed_tokens"] += chunk.num_tokens
            if chunk.start < req.max_computed_tokens:
                redo = min(end, req.max_computed_tokens) - chunk.start
                req.num_recomputed_tokens += redo
                self.counters["recomputed_tokens"] += redo
            req.max_computed_tokens = max(req.max_computed_tokens, end)
            self.bm.cache_full_blocks(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            self.counters["generated_tokens"] += 1
            touched.append(req)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
        return touched

    def _stop_reason(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if token in params.stop_token_ids or (not params.ignore_eos and token == req.eos_token_id):
            return RequestStatus.FINISHED_STOP
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
        previous = req.status
        req.status = status
        self.bm.forget(req.request_id)
        self.requests.pop(req.request_id, None)
        if status is RequestStatus.FINISHED_ABORTED:
            self.record_event("aborted", req.request_id, state=previous.value)
        else:
            self.record_event("finished", req.request_id, reason=status.value, output_tokens=len(req.output_token_ids))

    def abort(self, request_id: str) -> Request | None:
        """Abort a request in any state, freeing its device and host blocks. None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
