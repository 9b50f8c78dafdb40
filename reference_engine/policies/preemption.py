"""``preemption_mode="auto"``: for each victim, swap or recompute, whichever the prices say is cheaper.

For a victim holding ``B`` device blocks with ``C`` computed tokens, of which ``H`` a recompute would
get back from the prefix cache (see below)::

    swap      = round trip over the host link:  2 x (per_copy_s + B x block_bytes / link rate)
    recompute = the prefill of the discarded tokens:  (C - H) x per-token prefill cost

Swap is chosen when it is cheaper *and* the host pool has room for the ``B`` blocks; otherwise the
victim is recomputed (if swap was cheaper but the host pool was full, that is a swap fallback, counted
and recorded as one). Host blocks are a scarce resource: a swap that would leave less host room than
the next victim in line needs (the scheduler's own victim order over the other running requests, when
swapping that one would save time) goes ahead only if it saves at least as much time per host block as
that one would. So host room is spent where it saves the most per block: a victim that is cheap to
recompute (short, or mostly shared) does not take the room a long one behind it would need. A victim
that shares blocks with a running request is recomputed whatever the prices: a swap-in brings the
shared blocks back as private copies, held for the rest of its life, so the batch holds fewer requests
(in the simulator, swapping such victims cost auto throughput against fixed recompute on a workload
with a shared system prompt).

``H``, the tokens a recompute gets back (the scheduler's ``_surviving_tokens``): the victim's leading
blocks that another running request also holds (they stay on the device), and its own cached blocks
unless the running requests draw them from the free queue before the victim can be readmitted (their
growth until the first of them can finish, less the blocks free now; the victim's last blocks go
first).

The rule is one call, :func:`choose`: the prices (:mod:`reference_engine.policies.preemption_costs`) and
one :class:`VictimFacts` in, one :class:`Decision` out, a value that says what was chosen
(:attr:`Decision.mode`), whether it is a swap fallback (:attr:`Decision.fell_back`) and why
(:attr:`Decision.why`, a :class:`Why`). Each ``preempted`` event of auto carries ``why`` (the
:class:`Why` member's name), ``reason`` (its words), ``estimated_swap_s`` and ``estimated_recompute_s``.
What auto measured against the fixed modes: docs/journal/measurements.md#preemption-policies.

Constructible from plain numbers: the decision needs no model and no tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from reference_engine.policies.preemption_costs import PreemptionCosts


class Why(enum.Enum):
    """Why auto chose what it chose. The value is the words an event shows; nothing parses them."""

    SWAP_CHEAPER = "swap cheaper"
    RECOMPUTE_CHEAPER = "recompute cheaper"
    SHARES_BLOCKS = "shares blocks with a running request (a swap-in brings them back unshared)"
    HOST_POOL_FULL = "swap cheaper but host pool full"  # a swap fallback
    HOST_ROOM_KEPT = "host room kept for the next victim in line"


@dataclass(frozen=True)
class Candidate:
    """One running request as auto prices its preemption."""

    num_blocks: int  # device blocks it holds: what a swap copies out and back
    computed_tokens: int
    surviving_tokens: int  # of those, what a recompute gets back (prefix-cached or shared), <= computed
    shared_blocks: int = 0  # blocks another running request also holds
    num_running: int = 0  # the running decodes its recompute would be priced beside
    context_tokens: int = 0  # their KV tokens in all

    @property
    def recompute_tokens(self) -> int:
        """Computed tokens a recompute would compute again."""
        return max(self.computed_tokens - self.surviving_tokens, 0)


@dataclass(frozen=True)
class VictimFacts:
    """Everything auto's rule reads about one preemption, built by the scheduler in one place.

    ``waiting_tokens``: prompt tokens of waiting requests that the readmission step would prefill anyway
    (at most a step's token budget), which every recompute is priced beside. ``next_in_line``: the
    request the scheduler would preempt after ``victim``, priced as it would be then (None: no other
    running request), whose host room a small victim's swap must not take for less saving per block."""

    victim: Candidate
    free_host_blocks: int
    waiting_tokens: int = 0
    next_in_line: Candidate | None = None


@dataclass(frozen=True)
class Decision:
    """What auto chose for one victim, and why: ``mode`` is what happens to its KV ("swap" |
    "recompute"); a swap fallback (cheaper swap, host pool full) is ``mode="recompute"`` with
    ``why=Why.HOST_POOL_FULL``."""

    mode: str
    why: Why
    estimated_swap_s: float
    estimated_recompute_s: float
    recompute_tokens: int  # computed tokens a recompute would compute again
    surviving_tokens: int = 0  # computed tokens a recompute gets back (for the words of the reason)
    computed_tokens: int = 0

    @property
    def fell_back(self) -> bool:
        """Swap was the cheaper mode but the host pool could not take the victim: a counted swap fallback."""
        return self.why is Why.HOST_POOL_FULL

    @property
    def wanted(self) -> str:
        """The mode auto wanted before the host pool had its say: "swap" for a swap or a fallback."""
        return "swap" if self.mode == "swap" or self.fell_back else "recompute"

    @property
    def reason(self) -> str:
        """The decision in words, for events and people (code reads :attr:`why`)."""
        kept = self.surviving_tokens and self.computed_tokens and self.recompute_tokens < self.computed_tokens
        if self.why is Why.RECOMPUTE_CHEAPER and kept:
            return (f"{self.why.value} ({self.surviving_tokens} of {self.computed_tokens} tokens kept by the "
                    f"prefix cache)")
        return self.why.value

    def event_data(self) -> dict[str, Any]:
        """What the victim's ``preempted`` event carries of the decision."""
        return {"why": self.why.name.lower(), "reason": self.reason, "estimated_swap_s": self.estimated_swap_s,
                "estimated_recompute_s": self.estimated_recompute_s}


def _recompute_seconds(costs: PreemptionCosts, candidate: Candidate, waiting_tokens: int) -> float:
    return costs.recompute_seconds(candidate.recompute_tokens, candidate.num_running, candidate.context_tokens,
                                   waiting_tokens)


def _host_room_to_keep(costs: PreemptionCosts, facts: VictimFacts) -> tuple[int, float]:
    """The host blocks to keep for the next victim in line and what swapping it saves per block; (0, 0.0)
    when there is none, it shares blocks (it would be recomputed), or swapping it saves nothing."""
    following = facts.next_in_line
    if following is None or not following.num_blocks or following.shared_blocks:
        return 0, 0.0
    saving = _recompute_seconds(costs, following, facts.waiting_tokens) - costs.swap_seconds(following.num_blocks)
    return (following.num_blocks, saving / following.num_blocks) if saving > 0 else (0, 0.0)


def choose(costs: PreemptionCosts, facts: VictimFacts) -> Decision:
    """Swap or recompute ``facts.victim``, priced by ``costs``. Ties go to recompute (it holds no host
    memory). A victim sharing blocks is recomputed; a cheaper swap that does not fit the host pool is a
    fallback (``Decision.fell_back``); a swap that would leave less host room than the next victim in line
    needs is made only if it saves at least as much per host block (see the module docstring)."""
    victim = facts.victim
    swap_s = costs.swap_seconds(victim.num_blocks)
    recompute_s = _recompute_seconds(costs, victim, facts.waiting_tokens)

    def decided(mode: str, why: Why) -> Decision:
        return Decision(mode, why, swap_s, recompute_s, victim.recompute_tokens, victim.surviving_tokens,
                        victim.computed_tokens)

    if not swap_s < recompute_s:
        return decided("recompute", Why.RECOMPUTE_CHEAPER)
    if victim.shared_blocks > 0:
        return decided("recompute", Why.SHARES_BLOCKS)
    if victim.num_blocks > facts.free_host_blocks:
        return decided("recompute", Why.HOST_POOL_FULL)
    reserve_blocks, reserve_saving_per_block = _host_room_to_keep(costs, facts)
    saving = (recompute_s - swap_s) / max(victim.num_blocks, 1)
    if facts.free_host_blocks - victim.num_blocks < reserve_blocks and saving < reserve_saving_per_block:
        return decided("recompute", Why.HOST_ROOM_KEPT)
    return decided("swap", Why.SWAP_CHEAPER)
