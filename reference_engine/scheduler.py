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
host pool, or falls back to recompute when the host pool is full; ``auto`` chooses per victim by
cost (:mod:`reference_engine.policies.preemption`: the victim's facts in, a decision value out). An
admission policy (:mod:`reference_engine.policies.admission`) may hold waiting requests back to keep
preemptions rare. A waiting request is admitted in two parts: :func:`size_admission` (pure: how many
tokens it may compute this step, or why not now) and the bookkeeping (blocks, preemptions for it under
the priority policy, events).

Prefill pacing (``prefill_pacing_tokens``, off when None): while some running request decodes, a step computes
at most that many prefill tokens beside the decodes, so a burst of new prompts does not stretch the decodes'
inter-token gap. Without chunked prefill a prompt is never split: one longer than the cap is admitted only as
the step's only prefill (at most one long prefill per step; :attr:`_StepBuilder.prefill_scheduled` is that
fact of the step). With chunked prefill new admissions and continuing prefill chunks are cut to the room left.
Steps without decodes are not paced (nobody waits between tokens), and swapped requests resume as before.

What a step decides lives in that step: ``schedule()`` builds a :class:`_StepBuilder` (budget
left, chunks, swaps, preemptions), hands it to its helpers, and returns it frozen as a
:class:`SchedulerOutput` that says everything the engine and the runner need. Only the queues,
the requests and the cumulative :class:`~reference_engine.engine_counters.EngineCounters` outlive a step.

Constructible from plain numbers: no model, no tensors.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from reference_engine.block_manager import BlockManager
from reference_engine.block_pool import KVBlock
from reference_engine.events import DEFAULT_MAX_EVENTS, EngineEvent, EventLog
from reference_engine.policies.admission import AdmissionPolicy, remaining_growth
from reference_engine.policies.preemption import Candidate, Decision, VictimFacts, choose
from reference_engine.policies.preemption_costs import DEFAULT_COSTS, PreemptionCosts
from reference_engine.request import Request, RequestStatus

BlockPairs = tuple[tuple[int, int], ...]  # (source block, destination block) copies


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

    @property
    def is_decode(self) -> bool:
        """One token that samples the next: a decode. Anything else is (a piece of) a prefill."""
        return self.num_tokens == 1 and self.completes


@dataclass(frozen=True)
class Preemption:
    """``request_id`` was preempted this step. ``mode`` is what happened to its KV: "swap" (moved to
    the host pool) or "recompute" (discarded); ``fallback`` when swap was wanted but the host pool
    was full."""

    request_id: str
    mode: str
    fallback: bool = False


def _no_blocks() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything one step does, decided by one ``schedule()`` call. Read-only.

    The engine copies ``swap_out`` first (the device blocks it frees may be written by this very
    step), then ``swap_in``, then runs ``chunks``, whose KV goes into the blocks of ``block_ids``.
    """

    step: int
    chunks: tuple[ScheduledChunk, ...] = ()  # decodes first, then prefill chunks, then resumed and admitted
    # Scheduled request -> its device block ids, covering at least start + num_tokens of its chunk.
    block_ids: Mapping[str, tuple[int, ...]] = field(default_factory=_no_blocks)
    # Request -> the (device, host) block pairs to copy out, and the (host, device) pairs to copy in.
    swap_out_blocks: Mapping[str, BlockPairs] = field(default_factory=_no_blocks)
    swap_in_blocks: Mapping[str, BlockPairs] = field(default_factory=_no_blocks)
    preempted: tuple[Preemption, ...] = ()  # in the order they happened
    num_prefill_tokens: int = 0  # tokens of chunks that are not decodes (ScheduledChunk.is_decode)
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

    @property
    def swap_out(self) -> list[tuple[int, int]]:
        """All (device, host) pairs of the step, request by request."""
        return [pair for pairs in self.swap_out_blocks.values() for pair in pairs]

    @property
    def swap_in(self) -> list[tuple[int, int]]:
        """All (host, device) pairs of the step, request by request."""
        return [pair for pairs in self.swap_in_blocks.values() for pair in pairs]

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.swap_out_blocks and not self.swap_in_blocks


@dataclass
class _StepBuilder:
    """The decisions of the ``schedule()`` call in progress: created by it, passed to its helpers,
    frozen by :meth:`build`. Nothing of it outlives the call."""

    step: int
    budget: int  # tokens still schedulable this step
    # prefill tokens allowed beside this step's decodes (prefill pacing); None: no cap
    prefill_cap: int | None = None
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)  # insertion order = schedule order
    swap_out: dict[str, BlockPairs] = field(default_factory=dict)
    swap_in: dict[str, BlockPairs] = field(default_factory=dict)
    preempted: list[Preemption] = field(default_factory=list)
    num_prefill_tokens: int = 0  # tokens of the step's chunks that are not decodes

    @property
    def prefill_room(self) -> int | None:
        """Prefill tokens still allowed beside this step's decodes (negative once a whole prompt over the
        cap was admitted alone); None: no cap."""
        return None if self.prefill_cap is None else self.prefill_cap - self.num_prefill_tokens

    @property
    def prefill_scheduled(self) -> bool:
        """A prefill (or a piece of one) is already scheduled this step."""
        return self.num_prefill_tokens > 0

    def add_chunk(self, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        chunk = ScheduledChunk(req, start, num_new, start + num_new == req.num_tokens)
        self.chunks[req.request_id] = chunk
        self.budget -= num_new
        if not chunk.is_decode:
            self.num_prefill_tokens += num_new

    def drop_chunk(self, request_id: str) -> None:
        """Unschedule a request preempted after its chunk was scheduled: its budget comes back."""
        chunk = self.chunks.pop(request_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens
            if not chunk.is_decode:
                self.num_prefill_tokens -= chunk.num_tokens

    def build(self, bm: BlockManager) -> SchedulerOutput:
        chunks = tuple(self.chunks.values())
        decode = sum(c.num_tokens for c in chunks if c.is_decode)
        return SchedulerOutput(
            step=self.step, chunks=chunks,
            block_ids=MappingProxyType({rid: tuple(bm.blocks_of(rid)) for rid in self.chunks}),
            swap_out_blocks=MappingProxyType(self.swap_out), swap_in_blocks=MappingProxyType(self.swap_in),
            preempted=tuple(self.preempted),
            num_prefill_tokens=sum(c.num_tokens for c in chunks) - decode, num_decode_tokens=decode)


class Held(enum.Enum):
    """Why the head of the waiting queue gets no tokens this step (from :func:`size_admission`)."""

    OVER_BUDGET = "its prompt is over the step's token budget left, and unchunked prompts are never split"
    PACED = "prefill pacing: no prefill room left beside the step's decodes"


@dataclass(frozen=True)
class AdmissionSize:
    """What :func:`size_admission` allows: ``num_tokens`` to compute this step, or ``held`` (why none)."""

    num_tokens: int = 0
    held: Held | None = None


def size_admission(uncached_tokens: int, *, budget: int, prefill_room: int | None, chunked: bool,
                   prefill_scheduled: bool) -> AdmissionSize:
    """How many of a waiting request's ``uncached_tokens`` (its tokens past its prefix-cache hits) it may
    compute this step, given the step's token ``budget`` left (> 0), its ``prefill_room`` (prefill pacing;
    None: no cap) and whether a prefill is already scheduled this step; or why none. Pure: the blocks,
    the admission policy and the bookkeeping are the caller's.

    Without chunked prefill a prompt is never split: one over the budget waits; one over the pacing room
    is admitted whole only as the step's only prefill. With chunked prefill it is cut to the budget and
    to the room, and waits only when no room is left."""
    if not chunked and uncached_tokens > budget:
        return AdmissionSize(held=Held.OVER_BUDGET)
    num_tokens = min(uncached_tokens, budget)
    if prefill_room is not None and num_tokens > prefill_room:
        if chunked and prefill_room > 0:
            num_tokens = prefill_room
        elif chunked or prefill_scheduled:
            return AdmissionSize(held=Held.PACED)
    return AdmissionSize(num_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = False, preemption_mode: str = "recompute",
                 scheduling_policy: str = "fcfs", clock: Callable[[], float] = time.monotonic,
                 events: EventLog | None = None, preemption_costs: PreemptionCosts | None = None,
                 admission: AdmissionPolicy | None = None, prefill_pacing_tokens: int | None = None):
        """``events``: where events are recorded (a fresh bounded log if None). Counters go to the block
        manager's record (``block_manager.counters``): one record per engine. ``preemption_costs``:
        what ``preemption_mode="auto"`` prices victims with
        (:data:`~reference_engine.policies.preemption_costs.DEFAULT_COSTS` if None; the engine
        replaces it with measured or profiled costs). ``admission``: the admission policy (admit what
        fits now if None). ``prefill_pacing_tokens``: the prefill cap of steps with decodes (see the
        module docstring; None: no cap)."""
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
        self.requests: dict[str, Request] = {}  # unfinished only: a request leaves when it finishes
        self.events = events if events is not None else EventLog(DEFAULT_MAX_EVENTS)
        self.counters = block_manager.counters
        self.preemption_costs: PreemptionCosts = preemption_costs or DEFAULT_COSTS
        self.admission = admission or AdmissionPolicy()
        self.prefill_pacing_tokens = prefill_pacing_tokens
        self._admit_seq = 0

    @property
    def step_index(self) -> int:
        """The number of the latest step (0 before the first): ``counters.steps``."""
        return self.counters.steps

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
        """Record an event of the current step (see :mod:`reference_engine.events` for the kinds)."""
        self.events.append(EngineEvent(kind, request_id, self.step_index, self.clock(), data))

    # ------------------------------------------------------------------ schedule
    def schedule(self, *, decoded_elsewhere: int = 0, running: Sequence[Request] | None = None) -> SchedulerOutput:
        """Decide the next step (the order in the module docstring).

        ``decoded_elsewhere``, ``running``: for a caller that accounts for some running decodes itself
        (the simulator's lazy decodes, :mod:`reference_engine.sim.lazy`): that many tokens come off the
        step's token budget and get no chunk, and only ``running`` (the other running requests) are
        scheduled as running requests are. The caller has already given those decodes the blocks they
        write, and must know the step preempts nobody (a victim is picked from all of ``self.running``).
        """
        self.counters.steps += 1
        step = _StepBuilder(self.step_index, self.max_num_batched_tokens - decoded_elsewhere,
                            prefill_cap=self._prefill_cap())
        self._schedule_running(step, self.running if running is None else running)
        if not step.preempted:
            self._schedule_swapped(step)
        # Swapped requests resume before new admissions, and a step that had to preempt admits
        # nobody (admitting then would only preempt again next step).
        if not self.swapped and not step.preempted:
            self._schedule_waiting(step)
        self.counters.prefill_chunks += sum(1 for c in step.chunks.values() if not c.completes)
        self.admission.after_step(len(step.preempted))
        return step.build(self.bm)

    def _prefill_cap(self) -> int | None:
        """The prefill pacing cap of the step being scheduled: ``prefill_pacing_tokens`` when a running
        request decodes (is one token behind), else None (no cap)."""
        if self.prefill_pacing_tokens is None:
            return None
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        return self.prefill_pacing_tokens if decoding else None

    def _schedule_running(self, step: _StepBuilder, running: Sequence[Request]) -> None:
        # Decodes first, then partial prefills, each in admission order.
        order = sorted(running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.admitted_seq))
        for req in order:
            if req.status is not RequestStatus.RUNNING or step.budget == 0:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
            if num_new > 1 and step.prefill_room is not None:
                # A partial prefill (chunked prefill only) gets what pacing leaves of this step.
                if step.prefill_room <= 0:
                    continue
                num_new = min(num_new, step.prefill_room)
            while not self.bm.allocate_slots(req, num_new):
                victim = self._pick_victim(candidates=self.running)
                self._preempt(victim, step)
                if victim is req:
                    break
            else:
                step.add_chunk(req, num_new)

    def _schedule_swapped(self, step: _StepBuilder) -> None:
        if self.policy == "priority" and len(self.swapped) > 1:
            # Resume the most important first (stable: equal keys keep their swap-out order).
            self.swapped = deque(sorted(self.swapped, key=Request.priority_key))
        while self.swapped and step.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            remaining = req.num_tokens - req.num_computed_tokens
            if not self.chunked and remaining > step.budget:
                return
            num_new = min(remaining, step.budget)
            held = len(self.bm.host_tables[req.request_id])
            extra = self.bm.blocks_needed(req.num_computed_tokens + num_new) - held
            if not self.bm.can_swap_in(req.request_id, max(extra, 0)):
                return
            self.swapped.popleft()
            step.swap_in[req.request_id] = tuple(self.bm.swap_in(req))
            self.counters.swap_ins += 1
            allocated = self.bm.allocate_slots(req, num_new)
            assert allocated, "can_swap_in checked the capacity"
            self._make_running(req)
            step.add_chunk(req, num_new)

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Admit from the head of the waiting queue, in order, while the step has budget and seats; the
        first request that may not be admitted now stops the admissions of this step (FCFS, or the
        priority order: nobody overtakes it)."""
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self.bm.find_cached_prefix(req)
            size = size_admission(req.num_tokens - len(hits) * self.bm.block_size, budget=step.budget,
                                  prefill_room=step.prefill_room, chunked=self.chunked,
                                  prefill_scheduled=step.prefill_scheduled)
            if (size.held is not None or not self.admission.admits(req, self.running, self.bm)
                    or not self._allocate_for_admission(req, size.num_tokens, hits, step)):
                return
            self._admit(req, size.num_tokens, len(hits) * self.bm.block_size, step)

    def _allocate_for_admission(self, req: Request, num_new: int, hits: list[KVBlock], step: _StepBuilder) -> bool:
        """Blocks for ``num_new`` tokens of ``req`` past its ``hits``, preempting strictly less important
        running requests for them under the priority policy; False when they cannot be had."""
        while not self.bm.allocate_slots(req, num_new, hits):
            victim = self._pick_priority_victim_for(req, step)
            if victim is None:
                return False
            self._preempt(victim, step)
        return True

    def _admit(self, req: Request, num_new: int, cached: int, step: _StepBuilder) -> None:
        """The bookkeeping of an admission whose blocks are allocated: off the waiting queue, its
        ``cached`` prefix-hit tokens counted as computed, its events, running, its chunk scheduled."""
        self.waiting.popleft()
        req.num_computed_tokens = cached
        req.num_cached_tokens = cached
        req.num_prefix_hit_tokens += cached
        self.bm.record_prefix_query(req.num_tokens, cached)
        if cached:
            self.record_event("prefix_hit", req.request_id, tokens=cached)
        # kv_usage right after this admission and the batch it joined: what an admission policy's
        # headroom is judged by (a policy admits into an empty batch whatever it holds)
        used = self.bm.num_gpu_blocks - self.bm.num_free_gpu_blocks
        self.record_event("admitted", req.request_id, cached_tokens=cached, resumed=req.num_preemptions > 0,
                          kv_usage=used / self.bm.num_gpu_blocks, num_running=len(self.running))
        self._make_running(req)
        step.add_chunk(req, num_new)

    def _make_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self._admit_seq += 1
        req.admitted_seq = self._admit_seq
        self.running.append(req)

    # ------------------------------------------------------------------ preemption
    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority_key(), r.admitted_seq))
        return max(candidates, key=lambda r: r.admitted_seq)

    def _pick_priority_victim_for(self, req: Request, step: _StepBuilder) -> Request | None:
        """Under the priority policy, a running request strictly less important than ``req``.

        None in a step that swapped in: a swap-out now could take the host blocks just freed by the
        swap-in before its copy has read them (or swap the resumed request straight back out).
        """
        if self.policy != "priority" or step.swap_in:
            return None
        lower = [r for r in self.running if r.priority_key() > req.priority_key()]
        return self._pick_victim(lower) if lower else None

    def _preempt(self, victim: Request, step: _StepBuilder) -> None:
        """Take ``victim`` off the device: to the host pool (swap mode, if it fits) or back to the
        head of the waiting queue with its KV discarded. Counted once, as one mode."""
        step.drop_chunk(victim.request_id)
        self.running.remove(victim)
        victim.num_preemptions += 1
        num_blocks = len(self.bm.block_tables.get(victim.request_id, []))
        fallback = False
        decision = self._auto_decision(victim, num_blocks) if self.preemption_mode == "auto" else None
        wanted = self.preemption_mode if decision is None else decision.wanted
        why = {} if decision is None else decision.event_data()
        if wanted == "swap":
            if self.bm.can_swap_out(victim.request_id):
                step.swap_out[victim.request_id] = tuple(self.bm.swap_out(victim.request_id))
                step.preempted.append(Preemption(victim.request_id, "swap"))
                victim.status = RequestStatus.SWAPPED
                self.swapped.append(victim)
                self.counters.preemptions_swap += 1
                self.counters.swap_outs += 1
                self.record_event("preempted", victim.request_id, mode="swap", wanted="swap", blocks=num_blocks,
                                  **why)
                return
            fallback = True
            self.counters.swap_fallbacks += 1
            self.record_event("swap_fallback", victim.request_id, blocks=num_blocks,
                              free_cpu_blocks=self.bm.num_free_cpu_blocks)
        discarded = victim.num_computed_tokens
        self.bm.free(victim.request_id)
        victim.num_computed_tokens = 0
        step.preempted.append(Preemption(victim.request_id, "recompute", fallback))
        self.counters.preemptions_recompute += 1
        self.record_event("preempted", victim.request_id, mode="recompute", wanted=wanted, blocks=num_blocks,
                          tokens_discarded=discarded, **why)
        self._enqueue_waiting(victim, front=True)

    def _auto_decision(self, victim: Request, num_blocks: int) -> Decision:
        """Auto's decision for ``victim`` (still holding its ``num_blocks`` blocks): one call of the rule
        (:func:`~reference_engine.policies.preemption.choose`) on the facts of :meth:`_victim_facts`."""
        return choose(self.preemption_costs, self._victim_facts(victim, num_blocks))

    def _victim_facts(self, victim: Request, num_blocks: int) -> VictimFacts:
        """What auto's rule reads of this preemption, gathered in one place: the victim and the next victim
        in line (the scheduler's own victim order over the other running requests), each priced as it
        would be recomputed beside the running requests but itself (the next one beside the others but
        the victim and itself), the free host blocks, and the waiting prompts the readmission step would
        prefill anyway."""
        others = [r for r in self.running if r is not victim]
        context = sum(r.num_computed_tokens for r in others)
        lost = self._blocks_lost_before_readmission(others)
        waiting = min(sum(r.num_tokens - r.num_computed_tokens for r in self.waiting), self.max_num_batched_tokens)
        following = None
        if others:
            nxt = self._pick_victim(others)
            following = Candidate(len(self.bm.block_tables.get(nxt.request_id, ())), nxt.num_computed_tokens,
                                  self._surviving_tokens(nxt, lost), self._shared_blocks(nxt), len(others) - 1,
                                  context - nxt.num_computed_tokens)
        candidate = Candidate(num_blocks, victim.num_computed_tokens, self._surviving_tokens(victim, lost),
                              self._shared_blocks(victim), len(others), context)
        return VictimFacts(candidate, self.bm.num_free_cpu_blocks, waiting, following)

    def _shared_blocks(self, request: Request) -> int:
        """Blocks of ``request`` that another running request also holds: a swap-in would bring them
        back as private copies, held for the rest of its life (the prefix cache does not re-share them)."""
        return sum(1 for b in self.bm.block_tables.get(request.request_id, ()) if b.ref_cnt > 1)

    def _blocks_lost_before_readmission(self, others: list[Request]) -> int:
        """How many of a recomputed victim's freed blocks the running ``others`` will draw before it can
        be readmitted: their growth (one token a step each) until the first of them can finish
        (``max_tokens``), less the blocks free now. A readmission needs about the victim's whole size
        free again, which takes a finish, and until then every new block comes off the free queue,
        where the victim's blocks wait behind those free now (its last block first)."""
        if not others:
            return 0
        steps = min(remaining_growth(r, self.max_model_len, self.max_model_len) for r in others)
        drawn = -(-steps * len(others) // self.bm.block_size)
        return max(drawn - self.bm.num_free_gpu_blocks, 0)

    def _surviving_tokens(self, victim: Request, lost: int) -> int:
        """Computed tokens of ``victim`` that a recompute would get back from the prefix cache.

        Its leading blocks that another running request also holds stay on the device; its own cached
        blocks stay findable unless drawn before the readmission: ``lost`` of them, from its last block
        back (:meth:`_blocks_lost_before_readmission`). The readmission's lookup stops at the first miss
        and never covers the last token (always computed). Counting every cached block as kept, as auto
        first did, priced recomputes at a small fraction of the tokens actually recomputed (in the
        simulator, on a mixed workload), and auto recomputed long victims that a swap would have saved."""
        table = self.bm.block_tables.get(victim.request_id, [])
        own = [i for i, block in enumerate(table) if block.ref_cnt == 1]
        drawn = set(own[len(own) - min(lost, len(own)):])
        kept = 0
        for i, block in enumerate(table[: max(victim.num_tokens - 1, 0) // self.bm.block_size]):
            if block.ref_cnt > 1 or (block.block_hash is not None and i not in drawn):
                kept += 1
            else:
                break
        return min(kept * self.bm.block_size, victim.num_computed_tokens)

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
            self.counters.computed_tokens += chunk.num_tokens
            if chunk.start < req.max_computed_tokens:
                redo = min(end, req.max_computed_tokens) - chunk.start
                req.num_recomputed_tokens += redo
                self.counters.recomputed_tokens += redo
            req.max_computed_tokens = max(req.max_computed_tokens, end)
            self.bm.cache_full_blocks(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            self.counters.generated_tokens += 1
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
        """Abort a request in any state, freeing its device and host blocks. None if unknown (or already
        finished: a finished request is no longer held), and then nothing is counted."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.counters.aborts += 1
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
