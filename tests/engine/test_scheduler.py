"""The scheduler on its own: plain numbers in, exact schedules out, no model and no tensors.

A fake model (:class:`FakeModel`) runs each step: it calls ``schedule()``, checks the step against
the scheduler's limits, answers one token for every chunk that reaches the end of its sequence
(``completes``), calls ``update()`` and then checks the block manager's and the queues' invariants.
Block size 4 throughout, so block counts are easy to follow by hand::

    prompt of 8 tokens    [ b | b ]        2 blocks; its first decode (token 9) needs a 3rd
    prompt of 6 tokens    [ b | b ]        2 blocks; decodes of tokens 7 and 8 need none
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from reference_engine.block_manager import BlockManager, cdiv
from reference_engine.request import Request, RequestStatus
from reference_engine.sampling_params import SamplingParams
from reference_engine.scheduler import Held, Preemption, Scheduler, SchedulerOutput, _StepBuilder, size_admission

BLOCK_SIZE = 4
DEFAULT_TOKEN = 7
_fresh = itertools.count(1000)  # prompt token ids, distinct across requests so nothing shares a prefix by accident


def make_scheduler(num_gpu_blocks: int = 64, num_cpu_blocks: int = 0, *, caching: bool = False,
                   max_num_seqs: int = 16, max_num_batched_tokens: int = 64, max_model_len: int = 64,
                   chunked: bool = False, mode: str = "recompute", policy: str = "fcfs") -> Scheduler:
    bm = BlockManager(num_gpu_blocks, num_cpu_blocks, BLOCK_SIZE, caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked, preemption_mode=mode,
                     scheduling_policy=policy, clock=lambda: 0.0)


def make_request(rid: str, prompt: int | Sequence[int], max_tokens: int = 16, *, priority: int = 0,
                 arrival: float = 0.0, eos: int | None = None, stop: tuple[int, ...] = (),
                 ignore_eos: bool = False) -> Request:
    """``prompt`` is a length (fresh token ids) or the token ids themselves."""
    tokens = [next(_fresh) for _ in range(prompt)] if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=ignore_eos)
    return Request(rid, tokens, params, arrival, priority, eos)


def spans(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """The step's chunks as (request id, start, num_tokens), in schedule order."""
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def events(sched: Scheduler, kind: str, step: int | None = None) -> list:
    return [e for e in sched.events if e.kind == kind and (step is None or e.step == step)]


class FakeModel:
    """Drives a scheduler step by step, checking every step; ``tokens`` scripts what a request samples."""

    def __init__(self, sched: Scheduler, tokens: dict[str, list[int]] | None = None):
        self.sched = sched
        self.tokens = {rid: list(seq) for rid, seq in (tokens or {}).items()}
        self.sampled: dict[str, int] = {}  # what the last step sampled (``completes`` is stale after update)

    def step(self) -> SchedulerOutput:
        sched = self.sched
        out = sched.schedule()
        self._check_step(out)
        sampled = {c.request.request_id: self._next_token(c.request.request_id) for c in out.chunks if c.completes}
        sched.update(out, sampled)
        self.sampled = sampled
        sched.bm.check_invariants()
        check_queues(sched)
        return out

    def run(self, max_steps: int = 1000) -> int:
        """Step until nothing is left; returns the number of steps."""
        for n in range(1, max_steps + 1):
            self.step()
            if not self.sched.has_unfinished():
                assert self.sched.bm.is_whole()
                return n
        raise AssertionError(f"still unfinished after {max_steps} steps: {sorted(self.sched.requests)}")

    def _next_token(self, rid: str) -> int:
        script = self.tokens.get(rid)
        return script.pop(0) if script else DEFAULT_TOKEN

    def _check_step(self, out: SchedulerOutput) -> None:
        sched, bm = self.sched, self.sched.bm
        assert out.num_tokens <= sched.max_num_batched_tokens, f"step {out.step}: over the token budget"
        assert len(sched.running) <= sched.max_num_seqs, f"step {out.step}: over max_num_seqs"
        assert not (out.swap_in and out.swap_out), f"step {out.step} swapped both ways: {out}"
        ids = [c.request.request_id for c in out.chunks]
        assert len(set(ids)) == len(ids), f"step {out.step}: a request has two chunks"
        for c in out.chunks:
            req = c.request
            assert req.status is RequestStatus.RUNNING and c.num_tokens >= 1
            assert c.start == req.num_computed_tokens, f"{req.request_id}: chunk does not start at computed tokens"
            assert c.start + c.num_tokens <= req.num_tokens
            assert len(bm.block_tables[req.request_id]) * bm.block_size >= c.start + c.num_tokens, "no slots"
            if not sched.chunked:
                assert c.completes, f"{req.request_id}: a partial chunk without chunked prefill"


def check_queues(sched: Scheduler) -> None:
    """Each unfinished request is in exactly one queue, matching its status and what it holds."""
    bm = sched.bm
    waiting, running, swapped = list(sched.waiting), list(sched.running), list(sched.swapped)
    everyone = [r.request_id for r in waiting + running + swapped]
    assert len(everyone) == len(set(everyone)), "a request is in two queues"
    assert set(everyone) == set(sched.requests)
    for r in waiting:
        assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0
        assert r.request_id not in bm.block_tables and r.request_id not in bm.host_tables
    for r in running:
        assert r.status is RequestStatus.RUNNING and r.request_id not in bm.host_tables
        assert len(bm.block_tables[r.request_id]) >= cdiv(r.num_computed_tokens, bm.block_size)
    for r in swapped:
        assert r.status is RequestStatus.SWAPPED and r.request_id not in bm.block_tables
        assert len(bm.host_tables[r.request_id]) >= cdiv(r.num_computed_tokens, bm.block_size)
    if sched.policy == "priority":
        keys = [r.priority_key() for r in waiting]
        assert keys == sorted(keys), "priority waiting queue out of order"


# ---------------------------------------------------------------------- continuous batching and limits
def test_requests_join_and_leave_between_steps() -> None:
    sched = make_scheduler()
    model = FakeModel(sched)
    sched.add(make_request("a", 4, max_tokens=2))
    sched.add(make_request("b", 6, max_tokens=4))
    assert spans(model.step()) == [("a", 0, 4), ("b", 0, 6)]
    assert spans(model.step()) == [("a", 4, 1), ("b", 6, 1)]
    assert sched.requests.keys() == {"b"}, "a finished after its 2nd token and left the batch"
    assert "a" not in sched.bm.block_tables
    sched.add(make_request("c", 5, max_tokens=1))
    assert spans(model.step()) == [("b", 7, 1), ("c", 0, 5)], "c joins while b decodes"
    assert spans(model.step()) == [("b", 8, 1)]
    assert not sched.has_unfinished() and sched.bm.is_whole()
    assert [e.request_id for e in events(sched, "finished")] == ["a", "c", "b"]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=2)
    model = FakeModel(sched)
    for rid, max_tokens in (("r0", 1), ("r1", 3), ("r2", 2), ("r3", 2)):
        sched.add(make_request(rid, 4, max_tokens=max_tokens))
    assert spans(model.step()) == [("r0", 0, 4), ("r1", 0, 4)]
    assert spans(model.step()) == [("r1", 4, 1), ("r2", 0, 4)], "r0 left, so r2 takes its seat"
    assert spans(model.step()) == [("r1", 5, 1), ("r2", 4, 1)]
    assert [r.request_id for r in sched.waiting] == ["r3"]
    assert spans(model.step()) == [("r3", 0, 4)]
    assert spans(model.step()) == [("r3", 4, 1)]
    assert not sched.has_unfinished()


STORM_CONFIGS = [
    dict(chunked=chunked, mode=mode, caching=caching, policy=policy)
    for chunked in (False, True) for mode in ("recompute", "swap") for caching in (False, True)
    for policy in ("fcfs", "priority")
]


@pytest.mark.parametrize("config", STORM_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_seeded_storm_keeps_every_limit_and_finishes_everything(config: dict) -> None:
    """Arrivals, shared prefixes, aborts and a pool small enough to preempt: every step within the
    budget and max_num_seqs (checked by FakeModel), and every request ends with the right length."""
    rng = random.Random(42)
    budget = 16 if config["chunked"] else 40
    sched = make_scheduler(num_gpu_blocks=10, num_cpu_blocks=6, max_num_seqs=4, max_num_batched_tokens=budget,
                           max_model_len=40, **config)
    model = FakeModel(sched)
    shared = [next(_fresh) for _ in range(8)]
    added: list[Request] = []
    aborted: set[str] = set()
    step = 0
    while len(added) < 40 or sched.has_unfinished():
        step += 1
        assert step < 2000, "the scheduler stopped making progress"
        if len(added) < 40 and rng.random() < 0.5:
            prompt = (shared if rng.random() < 0.5 else []) + [next(_fresh) for _ in range(rng.randint(1, 16))]
            req = make_request(f"r{len(added)}", prompt, max_tokens=rng.randint(1, 24),
                               priority=rng.randint(0, 3), arrival=float(len(added)))
            if cdiv(min(req.num_tokens + req.sampling_params.max_tokens, 40) - 1, BLOCK_SIZE) <= 10:
                sched.add(req)  # the engine rejects the others; the scheduler would wait for them forever
            added.append(req)
        if rng.random() < 0.03 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            assert sched.abort(rid) is not None
            aborted.add(rid)
        model.step()
    assert sched.bm.is_whole()
    assert sched.counters.preemptions_recompute + sched.counters.preemptions_swap > 0, "no pressure"
    for req in added:
        if req.request_id in aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
        elif req.status is not RequestStatus.WAITING:  # WAITING: never added (too big for the pool)
            assert req.status is RequestStatus.FINISHED_LENGTH
            assert len(req.output_token_ids) == min(req.sampling_params.max_tokens, 40 - req.num_prompt_tokens)


# ---------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_alone_takes_the_whole_budget_each_step() -> None:
    sched = make_scheduler(chunked=True, max_num_batched_tokens=32, max_model_len=128)
    model = FakeModel(sched)
    sched.add(make_request("long", 100, max_tokens=1))
    chunks, sampled = [], []
    for _ in range(4):
        chunks += spans(model.step())
        sampled.append(bool(model.sampled))
    assert chunks == [("long", 0, 32), ("long", 32, 32), ("long", 64, 32), ("long", 96, 4)]
    assert sampled == [False, False, False, True], "a token is sampled only by the chunk that ends the prompt"
    assert sched.counters.prefill_chunks == 3 and not sched.has_unfinished()


def test_chunked_prefill_shares_steps_with_decodes_which_go_first() -> None:
    sched = make_scheduler(chunked=True, max_num_batched_tokens=32, max_model_len=128)
    model = FakeModel(sched)
    sched.add(make_request("d1", 4, max_tokens=10))
    sched.add(make_request("d2", 4, max_tokens=10))
    assert spans(model.step()) == [("d1", 0, 4), ("d2", 0, 4)]
    sched.add(make_request("long", 100, max_tokens=2))
    expected = [
        [("d1", 4, 1), ("d2", 4, 1), ("long", 0, 30)],
        [("d1", 5, 1), ("d2", 5, 1), ("long", 30, 30)],
        [("d1", 6, 1), ("d2", 6, 1), ("long", 60, 30)],
        [("d1", 7, 1), ("d2", 7, 1), ("long", 90, 10)],
        [("d1", 8, 1), ("d2", 8, 1), ("long", 100, 1)],
    ]
    for step, want in enumerate(expected):
        out = model.step()
        assert spans(out) == want, f"step {step}"
    assert sched.requests["d1"].output_token_ids == [DEFAULT_TOKEN] * 6
    assert "long" not in sched.requests, "sampled once at the end of its prefill and once after"


def test_without_chunking_a_prompt_longer_than_the_remaining_budget_waits() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=128)
    model = FakeModel(sched)
    sched.add(make_request("d", 4, max_tokens=3))
    model.step()
    sched.add(make_request("long", 64, max_tokens=2))
    sched.add(make_request("short", 2, max_tokens=1))
    # 63 tokens of budget are left next to the decode: the 64-token prompt waits, and FCFS lets
    # nobody overtake it.
    assert spans(model.step()) == [("d", 4, 1)]
    assert spans(model.step()) == [("d", 5, 1)]
    assert [r.request_id for r in sched.waiting] == ["long", "short"]
    assert spans(model.step()) == [("long", 0, 64)], "whole prompt in one step once the budget is free"
    assert spans(model.step()) == [("long", 64, 1), ("short", 0, 2)]


# ---------------------------------------------------------------------- recompute preemption
def _two_running(sched: Scheduler, model: FakeModel) -> None:
    """r0 (prompt 8, 3 tokens) and r1 (prompt 6, 5 tokens) fill a 4-block pool; r0's next decode needs
    a 3rd block, r1's next two do not."""
    sched.add(make_request("r0", 8, max_tokens=3))
    sched.add(make_request("r1", 6, max_tokens=5))
    assert spans(model.step()) == [("r0", 0, 8), ("r1", 0, 6)]
    assert sched.bm.num_free_gpu_blocks == 0


def test_recompute_victim_is_the_latest_admitted_keeps_its_tokens_and_goes_to_the_front() -> None:
    sched = make_scheduler(num_gpu_blocks=4)
    model = FakeModel(sched)
    _two_running(sched, model)
    r1 = sched.requests["r1"]
    sched.add(make_request("r2", 3, max_tokens=1))  # needs 1 block
    out = model.step()
    # r0 needs a block: r1, admitted after it, is preempted; its blocks pay for r0's.
    assert spans(out) == [("r0", 8, 1)] and out.num_preempted == 1
    (ev,) = events(sched, "preempted")
    assert ev.request_id == "r1" and ev.data == {"mode": "recompute", "wanted": "recompute", "blocks": 2,
                                                 "tokens_discarded": 6}
    assert r1.status is RequestStatus.WAITING and r1.num_computed_tokens == 0
    assert r1.output_token_ids == [DEFAULT_TOKEN], "generated tokens survive a recompute preemption"
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"], "the victim goes to the FRONT of waiting"
    # A block is free and r2 would fit in it, but a step that preempted admits nobody.
    assert sched.bm.num_free_gpu_blocks == 1 and not events(sched, "admitted", out.step)

    out = model.step()
    assert spans(out) == [("r0", 9, 1)], "r1 (2 blocks) does not fit in 1, and r2 may not overtake it"
    out = model.step()  # r0 finished last step: r1 re-prefills prompt + its generated token, r2 follows
    assert spans(out) == [("r1", 0, 7), ("r2", 0, 3)]
    assert r1.num_recomputed_tokens == 6 and sched.counters.recomputed_tokens == 6
    assert r1.output_token_ids == [DEFAULT_TOKEN] * 2
    (admitted,) = [e for e in events(sched, "admitted", out.step) if e.request_id == "r1"]
    assert {k: admitted.data[k] for k in ("cached_tokens", "resumed", "num_running")} == {
        "cached_tokens": 0, "resumed": True, "num_running": 0}  # r0 had finished: an empty batch
    used = sched.bm.num_gpu_blocks - sched.bm.num_free_gpu_blocks
    assert admitted.data["kv_usage"] <= used / sched.bm.num_gpu_blocks  # r2 was admitted after it
    model.run()
    assert r1.num_preemptions == 1 and len(r1.output_token_ids) == 5
    assert sched.counters.recomputed_tokens == 6, "tokens never computed before are not recompute"


def test_the_requester_preempts_itself_when_it_is_the_latest_admitted() -> None:
    sched = make_scheduler(num_gpu_blocks=4)
    model = FakeModel(sched)
    sched.add(make_request("early", 6, max_tokens=2))
    sched.add(make_request("late", 8, max_tokens=2))
    model.step()
    out = model.step()
    # "late" needs a 3rd block; it is the latest admitted, so it is its own victim. "early" runs on.
    assert spans(out) == [("early", 6, 1)]
    assert [e.request_id for e in events(sched, "preempted")] == ["late"]
    assert spans(model.step()) == [("late", 0, 9)]


def test_a_request_alone_that_outgrows_the_pool_preempts_itself_and_waits() -> None:
    """The engine rejects requests that could never fit alone; the scheduler itself just waits."""
    sched = make_scheduler(num_gpu_blocks=2)
    model = FakeModel(sched)
    sched.add(make_request("big", 8, max_tokens=4))
    assert spans(model.step()) == [("big", 0, 8)]
    out = model.step()
    assert out.chunks == () and out.num_preempted == 1
    assert [r.request_id for r in sched.waiting] == ["big"] and sched.running == []
    assert model.step().is_empty, "9 tokens need 3 blocks of 2: it cannot be admitted again"
    assert sched.abort("big") is not None and sched.bm.is_whole()


@pytest.mark.parametrize("caching", [False, True])
def test_update_counts_recomputed_tokens_exactly(caching: bool) -> None:
    """Recompute = tokens computed again below the highest point ever reached. With prefix caching the
    victim's first (full, hashed) block survives in the cache, so only positions 4-5 are recomputed."""
    sched = make_scheduler(num_gpu_blocks=4, caching=caching)
    model = FakeModel(sched)
    _two_running(sched, model)
    model.step(), model.step(), model.step()  # r1 preempted, r0 finishes, then r1 is back
    r1 = sched.requests["r1"]
    start = 4 if caching else 0
    assert (r1.num_cached_tokens, r1.num_computed_tokens) == (start, 7)
    assert r1.num_recomputed_tokens == sched.counters.recomputed_tokens == 6 - start
    model.run()
    assert sched.counters.recomputed_tokens == 6 - start
    assert sched.counters.computed_tokens == 8 + 6 + 2 + (7 - start) + 3  # r0, r1, r0's decodes, redo, r1


def test_chunked_recompute_reprefills_prompt_and_generated_tokens_in_chunks() -> None:
    sched = make_scheduler(num_gpu_blocks=5, chunked=True, max_num_batched_tokens=8)
    model = FakeModel(sched)
    sched.add(make_request("r0", 8, max_tokens=5))
    sched.add(make_request("r1", 7, max_tokens=5))
    assert spans(model.step()) == [("r0", 0, 8)]
    assert spans(model.step()) == [("r0", 8, 1), ("r1", 0, 7)]
    assert spans(model.step()) == [("r0", 9, 1), ("r1", 7, 1)]
    out = model.step()
    # r1's 9th token needs a 3rd block; r1 is the latest admitted, so it is its own victim.
    assert spans(out) == [("r0", 10, 1)] and events(sched, "preempted")[0].data["tokens_discarded"] == 8
    r1 = sched.requests["r1"]
    assert r1.output_token_ids == [DEFAULT_TOKEN] * 2 and r1.max_computed_tokens == 8
    # r0 decodes first; r1 re-prefills prompt (7) + generated (2) = 9 tokens in budget-sized chunks.
    assert spans(model.step()) == [("r0", 11, 1), ("r1", 0, 7)]
    assert r1.num_recomputed_tokens == 7
    assert spans(model.step()) == [("r1", 7, 2)] and model.sampled == {"r1": DEFAULT_TOKEN}
    assert r1.num_recomputed_tokens == sched.counters.recomputed_tokens == 8, "position 8 was never computed"
    model.run()
    assert sched.counters.recomputed_tokens == 8


# ---------------------------------------------------------------------- swap preemption
def test_swap_moves_the_victim_to_host_and_it_resumes_before_new_admissions() -> None:
    sched = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="swap")
    model = FakeModel(sched)
    _two_running(sched, model)
    r1 = sched.requests["r1"]
    r1_blocks = sched.bm.blocks_of("r1")
    sched.add(make_request("r2", 3, max_tokens=1))
    out = model.step()
    assert spans(out) == [("r0", 8, 1)]
    assert out.swap_out == [(r1_blocks[0], 0), (r1_blocks[1], 1)] and out.swap_in == []
    assert out.swap_out_blocks == {"r1": ((r1_blocks[0], 0), (r1_blocks[1], 1))}
    assert out.preempted == (Preemption("r1", "swap"),)
    assert out.block_ids == {"r0": tuple(sched.bm.blocks_of("r0"))}, "block ids of the scheduled requests only"
    assert list(out.swap_out_blocks) == ["r1"]
    assert r1.status is RequestStatus.SWAPPED and r1.num_computed_tokens == 6, "swap keeps the computed KV"
    assert sched.bm.host_tables["r1"] == [0, 1] and sched.bm.num_free_cpu_blocks == 6

    out = model.step()
    # r1 needs 2 blocks back, 1 is free; r2 would fit in it but swapped requests come first.
    assert spans(out) == [("r0", 9, 1)] and out.is_empty is False and not out.swap_in
    assert [r.request_id for r in sched.waiting] == ["r2"]

    out = model.step()  # r0 has finished
    assert list(out.swap_in_blocks) == ["r1"] and [h for h, _ in out.swap_in] == [0, 1]
    assert [d for _, d in out.swap_in] == sched.bm.blocks_of("r1")
    assert spans(out) == [("r1", 6, 1), ("r2", 0, 3)], "r1 decodes on (no recompute), then r2 is admitted"
    assert sched.bm.num_free_cpu_blocks == 8 and r1.num_recomputed_tokens == 0
    model.run()
    c = sched.counters
    assert (c.preemptions_swap, c.swap_outs, c.swap_ins, c.recomputed_tokens) == (1, 1, 1, 0)


def test_no_swap_in_in_a_step_that_swapped_out() -> None:
    sched = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=16, mode="swap")
    model = FakeModel(sched)
    sched.add(make_request("A", 8, max_tokens=10))
    sched.add(make_request("B", 6, max_tokens=12))
    sched.add(make_request("C", 6, max_tokens=10))
    model.step()
    assert list(model.step().swap_out_blocks) == ["C"], "A's first decode needs a block: C (latest) goes"
    for _ in range(3):
        out = model.step()
        assert not out.swap_in, "C needs 2 blocks and none are free"
    out = model.step()
    # A needs a 4th block: B goes, freeing 3. C would now fit, but not in the step that swapped out.
    assert list(out.swap_out_blocks) == ["B"] and out.swap_in == []
    assert sched.bm.num_free_gpu_blocks >= 2 and [r.request_id for r in sched.swapped] == ["C", "B"]
    out = model.step()
    assert list(out.swap_in_blocks) == ["C"], "next step: C first (swapped first), B still does not fit"
    model.run()


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full() -> None:
    sched = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=1, mode="swap")
    model = FakeModel(sched)
    _two_running(sched, model)
    out = model.step()
    assert out.swap_out == [] and out.preempted == (Preemption("r1", "recompute", fallback=True),)
    (fallback,) = events(sched, "swap_fallback")
    assert fallback.request_id == "r1" and fallback.data == {"blocks": 2, "free_cpu_blocks": 1}
    assert (events(sched, "preempted")[0].data["mode"], events(sched, "preempted")[0].data["wanted"]) == \
        ("recompute", "swap"), "the event says a swap was wanted: a fallback, told apart from a plain recompute"
    r1 = sched.requests["r1"]
    assert r1.status is RequestStatus.WAITING and r1.num_computed_tokens == 0 and sched.bm.num_free_cpu_blocks == 1
    c = sched.counters
    assert (c.swap_fallbacks, c.preemptions_recompute, c.preemptions_swap) == (1, 1, 0)
    model.run()


# ---------------------------------------------------------------------- priority
def test_priority_orders_waiting_by_value_then_arrival() -> None:
    sched = make_scheduler(policy="priority")
    for rid, prio, arrival in (("a", 1, 0.0), ("b", 0, 2.0), ("c", 1, -1.0), ("d", 0, 1.0), ("e", 2, -5.0)):
        sched.add(make_request(rid, 4, max_tokens=1, priority=prio, arrival=arrival))
    assert [r.request_id for r in sched.waiting] == ["d", "b", "c", "a", "e"]
    assert [rid for rid, _, _ in spans(FakeModel(sched).step())] == ["d", "b", "c", "a", "e"]


def test_fcfs_ignores_priority() -> None:
    sched = make_scheduler(policy="fcfs")
    for rid, prio in (("a", 3), ("b", 0)):
        sched.add(make_request(rid, 4, priority=prio, arrival=-float(prio)))
    assert [r.request_id for r in sched.waiting] == ["a", "b"]


def test_priority_victim_is_the_least_important_not_the_latest_admitted() -> None:
    sched = make_scheduler(num_gpu_blocks=4, policy="priority")
    model = FakeModel(sched)
    sched.add(make_request("lo", 6, max_tokens=10, priority=2, arrival=0.0))
    model.step()
    sched.add(make_request("hi", 8, max_tokens=10, priority=0, arrival=1.0))
    assert spans(model.step()) == [("lo", 6, 1), ("hi", 0, 8)]
    out = model.step()
    # hi (latest admitted) needs a block: FCFS would preempt hi itself, priority takes lo, whose
    # already scheduled decode is dropped from the step.
    assert [e.request_id for e in events(sched, "preempted")] == ["lo"]
    assert spans(out) == [("hi", 8, 1)] and out.num_tokens == 1
    assert sched.requests["lo"].status is RequestStatus.WAITING


def test_priority_victim_ties_go_to_the_latest_arrival() -> None:
    sched = make_scheduler(num_gpu_blocks=6, policy="priority")
    model = FakeModel(sched)
    sched.add(make_request("first", 6, max_tokens=10, priority=1, arrival=0.0))
    sched.add(make_request("second", 6, max_tokens=10, priority=1, arrival=1.0))
    sched.add(make_request("top", 8, max_tokens=10, priority=0, arrival=2.0))
    assert [rid for rid, _, _ in spans(model.step())] == ["top", "first", "second"]
    model.step()
    assert [e.request_id for e in events(sched, "preempted")] == ["second"]


def test_a_more_important_arrival_preempts_a_less_important_running_request_and_only_that() -> None:
    sched = make_scheduler(num_gpu_blocks=4, policy="priority")
    model = FakeModel(sched)
    sched.add(make_request("lo", 8, max_tokens=20, priority=2, arrival=0.0))
    sched.add(make_request("mid", 8, max_tokens=20, priority=1, arrival=1.0))
    model.step()
    sched.add(make_request("peer", 4, max_tokens=20, priority=1, arrival=2.0))
    sched.add(make_request("urgent", 4, max_tokens=20, priority=0, arrival=3.0))
    out = model.step()
    # mid's decode needs a 3rd block: lo goes (running-phase preemption), and that step admits nobody.
    assert [e.request_id for e in events(sched, "preempted", out.step)] == ["lo"]
    assert spans(out) == [("mid", 8, 1)]
    assert [r.request_id for r in sched.waiting] == ["urgent", "peer", "lo"]
    out = model.step()
    # urgent fits in the free block; peer (same priority as mid) may not preempt mid, so it waits.
    assert spans(out) == [("mid", 9, 1), ("urgent", 0, 4)] and out.num_preempted == 0
    assert [r.request_id for r in sched.waiting] == ["peer", "lo"]


def test_priority_admission_preempts_for_the_urgent_request_only() -> None:
    sched = make_scheduler(num_gpu_blocks=4, policy="priority")
    model = FakeModel(sched)
    sched.add(make_request("lo", 6, max_tokens=20, priority=2, arrival=0.0))
    sched.add(make_request("mid", 6, max_tokens=20, priority=1, arrival=1.0))
    model.step()
    sched.add(make_request("urgent", 7, max_tokens=20, priority=0, arrival=2.0))
    out = model.step()
    assert [e.request_id for e in events(sched, "preempted", out.step)] == ["lo"]
    assert spans(out) == [("mid", 6, 1), ("urgent", 0, 7)]
    assert [r.request_id for r in sched.waiting] == ["lo"]


def test_priority_swap_never_swaps_out_in_a_step_that_swapped_in() -> None:
    """Regression: a swap-in then a swap-out in one step let the swap-out reuse the host blocks the
    swap-in had just freed (copies run swap-outs first), so the resumed request read garbage KV."""
    sched = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="swap", policy="priority")
    model = FakeModel(sched)  # its step check rejects any step with both swap_in and swap_out
    sched.add(make_request("A", 8, max_tokens=3, priority=1, arrival=0.0))
    sched.add(make_request("S", 8, max_tokens=8, priority=2, arrival=1.0))
    model.step()
    assert list(model.step().swap_out_blocks) == ["S"]
    assert model.step().swap_in == [], "S needs 3 blocks, 1 is free"
    sched.add(make_request("U", 12, max_tokens=2, priority=0, arrival=2.0))  # 3 blocks, more important
    out = model.step()  # A has finished: S comes back
    assert list(out.swap_in_blocks) == ["S"] and out.swap_out == []
    assert spans(out) == [("S", 8, 1)] and [r.request_id for r in sched.waiting] == ["U"]
    out = model.step()  # now U may preempt S
    assert list(out.swap_out_blocks) == ["S"] and out.swap_in == [] and spans(out) == [("U", 0, 12)]
    model.run()


# ---------------------------------------------------------------------- stop conditions
@pytest.mark.parametrize(
    ("kwargs", "script", "max_model_len", "outputs", "status"),
    [
        (dict(max_tokens=3), [], 64, [7, 7, 7], RequestStatus.FINISHED_LENGTH),
        (dict(max_tokens=9, stop=(9,)), [5, 9, 6], 64, [5, 9], RequestStatus.FINISHED_STOP),
        (dict(max_tokens=9, eos=2), [5, 2, 6], 64, [5, 2], RequestStatus.FINISHED_STOP),
        (dict(max_tokens=4, eos=2, ignore_eos=True), [5, 2, 6], 64, [5, 2, 6, 7], RequestStatus.FINISHED_LENGTH),
        (dict(max_tokens=9, eos=2, ignore_eos=True, stop=(2,)), [5, 2], 64, [5, 2], RequestStatus.FINISHED_STOP),
        (dict(max_tokens=2, stop=(9,)), [5, 9], 64, [5, 9], RequestStatus.FINISHED_STOP),  # stop wins the tie
        (dict(max_tokens=100), [], 10, [7, 7], RequestStatus.FINISHED_LENGTH),  # 8 + 2 = max_model_len
    ],
    ids=["max_tokens", "stop_token_ids", "eos", "ignore_eos", "stop_beats_ignore_eos", "stop_on_last_token",
         "max_model_len"],
)
def test_stop_conditions(kwargs: dict, script: list[int], max_model_len: int, outputs: list[int],
                         status: RequestStatus) -> None:
    sched = make_scheduler(max_model_len=max_model_len)
    model = FakeModel(sched, tokens={"r": script})
    req = make_request("r", 8, **kwargs)
    sched.add(req)
    steps = model.run()
    assert req.output_token_ids == outputs and req.status is status and steps == len(outputs)
    (finished,) = events(sched, "finished")
    assert finished.data == {"reason": status.value, "output_tokens": len(outputs)}


# ---------------------------------------------------------------------- abort
def _abort_scenario(state: str) -> tuple[Scheduler, FakeModel, str]:
    """A scheduler with the target request in ``state``."""
    if state in ("waiting", "running", "mid_prefill"):
        sched = make_scheduler(num_gpu_blocks=8, chunked=True, max_num_batched_tokens=8, max_num_seqs=1)
        model = FakeModel(sched)
        sched.add(make_request("t", 12, max_tokens=5))
        sched.add(make_request("other", 4, max_tokens=3))
        if state == "mid_prefill":
            model.step()
            assert 0 < sched.requests["t"].num_computed_tokens < 12
            return sched, model, "t"
        if state == "running":
            model.step(), model.step()
            return sched, model, "t"
        return sched, model, "other"
    sched = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="swap" if state == "swapped" else "recompute")
    model = FakeModel(sched)
    _two_running(sched, model)
    model.step()
    return sched, model, "r1"


@pytest.mark.parametrize("state", ["waiting", "running", "mid_prefill", "preempted", "swapped"])
def test_abort_in_every_queue_frees_everything(state: str) -> None:
    sched, model, rid = _abort_scenario(state)
    req = sched.requests[rid]
    expected_state = {"mid_prefill": "running", "preempted": "waiting"}.get(state, state)
    assert req.status.value == expected_state
    assert sched.abort(rid) is req
    assert req.status is RequestStatus.FINISHED_ABORTED and req.finish_reason == "abort"
    assert rid not in sched.requests and req not in [*sched.waiting, *sched.running, *sched.swapped]
    assert rid not in sched.bm.block_tables and rid not in sched.bm.host_tables
    assert events(sched, "aborted")[-1].data == {"state": expected_state}
    sched.bm.check_invariants()
    check_queues(sched)
    assert sched.abort(rid) is None, "aborting twice"
    assert sched.abort("never-added") is None
    model.run()
    assert sched.bm.is_whole()


def test_priority_policy_resumes_swapped_requests_most_important_first():
    """Swapped requests come back in priority order, not in the order they were swapped out."""
    from reference_engine.block_manager import BlockManager
    from reference_engine.request import Request
    from reference_engine.sampling_params import SamplingParams
    from reference_engine.scheduler import Scheduler

    bm = BlockManager(num_gpu_blocks=8, num_cpu_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                      preemption_mode="swap", scheduling_policy="priority")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    low = Request("low", [1] * 4, params, arrival_time=0.0, priority=5)
    high = Request("high", [2] * 4, params, arrival_time=1.0, priority=0)
    for req in (low, high):
        sched.add(req)
        out = sched.schedule()
        sched.update(out, {c.request.request_id: 7 for c in out.chunks if c.completes})
    # swap both out by hand, the low-priority one last, then let the scheduler resume one
    for req in (high, low):
        sched._preempt(req, _StepBuilder(step=0, budget=0))
    assert [r.request_id for r in sched.swapped] == ["high", "low"]
    sched.swapped.reverse()  # as if "low" had been swapped out first
    sched.max_num_seqs = 1
    out = sched.schedule()
    assert list(out.swap_in_blocks) == ["high"]
    bm.check_invariants()


# ------------------------------------------------------------------ admission sizing (pure)


@pytest.mark.parametrize(("uncached", "budget", "room", "chunked", "prefill_scheduled", "expected"), [
    (100, 256, None, False, False, (100, None)),  # fits: the whole prompt
    (300, 256, None, False, False, (0, Held.OVER_BUDGET)),  # unchunked over the budget: waits
    (300, 256, None, True, False, (256, None)),  # chunked: cut to the budget
    (100, 256, 40, True, True, (40, None)),  # chunked under pacing: cut to the room
    (100, 256, 0, True, True, (0, Held.PACED)),  # chunked, no room left: waits
    (100, 256, 40, False, False, (100, None)),  # unchunked over the room, no prefill yet: the step's only one
    (100, 256, 40, False, True, (0, Held.PACED)),  # unchunked over the room beside another prefill: waits
    (30, 256, 40, False, True, (30, None)),  # within the room: joins the other prefill
])
def test_size_admission(uncached, budget, room, chunked, prefill_scheduled, expected) -> None:
    size = size_admission(uncached, budget=budget, prefill_room=room, chunked=chunked,
                          prefill_scheduled=prefill_scheduled)
    assert (size.num_tokens, size.held) == expected


def test_a_scheduled_prefill_is_a_fact_of_the_step() -> None:
    step = _StepBuilder(step=1, budget=64, prefill_cap=16)
    decode = Request("d", [1, 2, 3], SamplingParams(max_tokens=4), 0.0)
    decode.num_computed_tokens = 2  # one token behind: a decode
    step.add_chunk(decode, 1)
    assert not step.prefill_scheduled and step.prefill_room == 16
    prompt = Request("p", list(range(10)), SamplingParams(max_tokens=4), 0.0)
    step.add_chunk(prompt, 10)
    assert step.prefill_scheduled and step.prefill_room == 6 and step.budget == 53
    step.drop_chunk("p")
    assert not step.prefill_scheduled and step.prefill_room == 16 and step.budget == 63
