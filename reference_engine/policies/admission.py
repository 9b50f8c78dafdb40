"""Admission control to a preemption budget: admit a waiting request only if it is not likely to
force a preemption soon.

Preemptions happen because admission looks only at *now*: ``admission_policy="none"`` (and vLLM's rule,
``full_prompt``, which asks the same of the whole prompt) admits whatever fits the free blocks this step,
although every running request will need more blocks
as it decodes. Two policies look ahead:

``watermark`` (projected KV use). Prompt lengths are known and output growth is bounded by
``max_tokens``; over the next ``H = admission_horizon`` steps each running request grows by at most
``min(H, tokens it may still generate)`` tokens. Admit request ``r`` only if::

    used blocks + sum over running of growth blocks(H) + blocks(r's tokens + its growth over H)
        <= (1 - admission_headroom) x pool blocks

``aimd`` (additive increase, multiplicative decrease of admitted concurrency). A cap on running
requests: halved (at least 1) on a step that preempted when the preemptions of the last 100 steps
exceed ``preemption_budget``; raised by one after every 100 steps without a preemption. Admission
is refused while ``len(running) >= cap``.

``full_prompt`` (vLLM V1's ``scheduler_reserve_full_isl``, on by default in vLLM 0.32). With chunked
prefill the first chunk's blocks are all ``none`` asks for; this admits a request only if the blocks of
its whole sequence so far (prompt, plus the output of a preempted one) fit the free blocks now, so a
long prompt waits at the head of the queue instead of being admitted, preempted and readmitted.

All three always admit into an empty running batch: a gate that could refuse the only request would stall
the engine. Both gate only new admissions and readmissions after a recompute; swapped requests resume
as before. The scheduler calls :meth:`AdmissionPolicy.admits` before admitting, and
:meth:`AdmissionPolicy.after_step` once per scheduled step with the step's preemption count.

Constructible from plain numbers (a :class:`~reference_engine.block_manager.BlockManager` and requests).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from reference_engine.block_manager import BlockManager
from reference_engine.request import Request

#: steps of the preemption window of ``aimd`` (the budget is per this many steps)
WINDOW_STEPS = 100


class AdmissionPolicy:
    """Admit everything that fits now (``admission_policy="none"``)."""

    name = "none"

    def admits(self, request: Request, running: Sequence[Request], bm: BlockManager) -> bool:
        """Whether ``request`` may be admitted now, on top of ``running``."""
        return True

    def after_step(self, num_preempted: int) -> None:
        """Called once per scheduled step with the preemptions that step made."""

    def state(self) -> dict[str, float]:
        """The policy's state for stats and events (empty for ``none``)."""
        return {}


def remaining_growth(request: Request, horizon: int, max_model_len: int | None = None) -> int:
    """Tokens ``request`` may add over the next ``horizon`` steps: one per step, at most what
    ``max_tokens`` (and ``max_model_len``) still allow."""
    left = request.sampling_params.max_tokens - len(request.output_token_ids)
    if max_model_len is not None:
        left = min(left, max_model_len - request.num_tokens)
    return max(min(horizon, left), 0)


class Watermark(AdmissionPolicy):
    """Admit only if the projected KV use over the horizon stays under ``1 - headroom`` of the pool."""

    name = "watermark"

    def __init__(self, horizon: int, headroom: float, max_model_len: int | None = None):
        self.horizon = horizon
        self.headroom = headroom
        self.max_model_len = max_model_len
        self.last_projection = 0.0  # projected use (fraction of the pool) of the latest refusal

    def projected_blocks(self, request: Request, running: Sequence[Request], bm: BlockManager) -> int:
        used = bm.num_gpu_blocks - bm.num_free_gpu_blocks
        growth = 0
        for r in running:
            held = len(bm.block_tables.get(r.request_id, ()))
            need = bm.blocks_needed(r.num_tokens + remaining_growth(r, self.horizon, self.max_model_len))
            growth += max(need - held, 0)
        new = bm.blocks_needed(request.num_tokens + remaining_growth(request, self.horizon, self.max_model_len))
        return used + growth + new

    def admits(self, request: Request, running: Sequence[Request], bm: BlockManager) -> bool:
        if not running:
            return True
        projected = self.projected_blocks(request, running, bm)
        if projected <= (1.0 - self.headroom) * bm.num_gpu_blocks:
            return True
        self.last_projection = projected / bm.num_gpu_blocks
        return False

    def state(self) -> dict[str, float]:
        return {"admission_last_refused_projection": self.last_projection}


class AIMD(AdmissionPolicy):
    """A cap on running requests, halved when preemptions exceed the budget, raised when quiet."""

    name = "aimd"

    def __init__(self, max_num_seqs: int, budget_per_window: float, window: int = WINDOW_STEPS):
        self.max_cap = max_num_seqs
        self.cap = float(max_num_seqs)
        self.budget = budget_per_window
        self.window = window
        self._recent: deque[tuple[int, int]] = deque()  # (step, preemptions) of steps that preempted
        self._step = 0
        self._quiet = 0  # steps since the last preemption

    def admits(self, request: Request, running: Sequence[Request], bm: BlockManager) -> bool:
        return not running or len(running) < int(self.cap)

    def after_step(self, num_preempted: int) -> None:
        self._step += 1
        while self._recent and self._recent[0][0] <= self._step - self.window:
            self._recent.popleft()
        if num_preempted:
            self._recent.append((self._step, num_preempted))
            self._quiet = 0
            if sum(n for _, n in self._recent) > self.budget:
                self.cap = max(1.0, self.cap / 2)
            return
        self._quiet += 1
        if self._quiet >= self.window:
            self._quiet = 0
            self.cap = min(float(self.max_cap), self.cap + 1)

    def state(self) -> dict[str, float]:
        return {"admission_cap": self.cap}


class FullPrompt(AdmissionPolicy):
    """Admit only if the request's whole sequence fits the free blocks now (vLLM's reserve-full-ISL gate)."""

    name = "full_prompt"

    def __init__(self, max_model_len: int | None = None):
        self.max_model_len = max_model_len

    def admits(self, request: Request, running: Sequence[Request], bm: BlockManager) -> bool:
        if not running:
            return True
        tokens = request.num_tokens if self.max_model_len is None else min(request.num_tokens, self.max_model_len)
        return bm.blocks_needed(tokens) <= bm.num_free_gpu_blocks


def make_admission(policy: str, *, max_num_seqs: int, horizon: int, headroom: float, budget: float,
                   max_model_len: int | None = None) -> AdmissionPolicy:
    """The policy ``EngineConfig.admission_policy`` names, from its fields."""
    if policy == "watermark":
        return Watermark(horizon, headroom, max_model_len)
    if policy == "aimd":
        return AIMD(max_num_seqs, budget)
    if policy == "full_prompt":
        return FullPrompt(max_model_len)
    if policy == "none":
        return AdmissionPolicy()
    raise ValueError(f"admission_policy={policy!r} is invalid: expected 'none', 'watermark', 'aimd' or 'full_prompt'")
