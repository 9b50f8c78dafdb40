"""Lazy decodes: the simulator's fast path, with the same decisions as a plain step.

Most running requests, most of the time, are *steady decoders*: one token behind, scheduled for one
token per step, getting a placeholder token back. The real scheduler touches each of them every step
(a sort, ``allocate_slots``, a chunk, ``update``, an output): per request per step, that Python work
made a simulation of many thousand requests take minutes. :class:`LazyDecodes` advances a steady decoder
*implicitly*: its fields (``num_computed_tokens``, ``output_token_ids``) are brought up to date
("synced") only when something reads them:

* a block boundary: the step where its next decode needs one more block (``allocate_slots``);
* its finish (``max_tokens`` or ``max_model_len``: known in advance, placeholders never stop early);
* an abort, or a step the fast path does not take (then every lazy request is synced first).

Between those moments a lazy request costs nothing per step: the step's shape adds its decode from
an aggregate (the sum of the lazy requests' computed tokens grows by their number each step), and
its tokens are reported as *spans* (request, first step, last step: one token at the end of each).

Index arithmetic, for a request synced before step ``s0`` with ``c0`` computed tokens, ``o0``
outputs and ``T`` blocks of ``block_size`` tokens::

    before step s:  num_computed = c0 + (s - s0),  outputs = o0 + (s - s0)
    decode at s needs cdiv(c + 1, block_size) blocks: one more than T at s0 + (T * block_size - c0),
        then every block_size steps
    finishing token: at step s0 + remaining - 1, remaining = min(max_tokens - o0, max_model_len - (c0 + 1))

The step itself is :meth:`reference_engine.sim.sim_engine.SimEngine.step_fast`.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference_engine.request import Request, RequestStatus


@dataclass(frozen=True)
class Span:
    """``request_id`` got one token at the end of every step from ``first`` to ``last`` (inclusive)."""

    request_id: str
    first: int
    last: int


class LazyDecodes:
    """The steady decoders of one SimEngine and when each next needs attention."""

    def __init__(self, block_size: int, max_model_len: int, token: int):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.token = token
        self.requests: dict[str, Request] = {}
        self._synced: dict[str, int] = {}  # request id -> the step before which its fields are true
        self._first: dict[str, int] = {}  # request id -> the first step of its open span
        self._cross: dict[str, int] = {}  # request id -> the step whose decode needs a new block
        self._finish: dict[str, int] = {}  # request id -> the step that samples its last token
        self._at_cross: dict[int, list[str]] = {}  # step -> ids (stale entries are skipped)
        self._at_finish: dict[int, list[str]] = {}
        # sum over lazy requests of (c0 - s0): their computed tokens before step s sum to this + n * s
        self._offset_sum = 0
        self.closed: list[Span] = []  # spans of requests that left, for the caller to drain

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def computed_before(self, step: int) -> int:
        """Sum of the lazy requests' computed tokens before ``step``."""
        return self._offset_sum + len(self.requests) * step

    def can_join(self, req: Request) -> bool:
        """A running request one token behind that no stop token can end early (the placeholder is
        none of them) and that never recomputes while decoding."""
        return (req.status is RequestStatus.RUNNING and req.num_tokens - req.num_computed_tokens == 1
                and req.max_computed_tokens <= req.num_computed_tokens
                and self.token not in req.sampling_params.stop_token_ids)

    def join(self, req: Request, table_blocks: int, step: int) -> None:
        """``req`` (true before ``step``, holding ``table_blocks`` blocks) decodes lazily from ``step`` on."""
        rid, c0 = req.request_id, req.num_computed_tokens
        remaining = min(req.sampling_params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
        assert remaining >= 1, f"{rid} should have finished"
        self.requests[rid] = req
        self._synced[rid] = self._first[rid] = step
        self._offset_sum += c0 - step
        self._finish[rid] = finish = step + remaining - 1
        self._at_finish.setdefault(finish, []).append(rid)
        self._schedule_cross(rid, step + max(0, table_blocks * self.block_size - c0))

    def _schedule_cross(self, rid: str, step: int) -> None:
        self._cross[rid] = step
        self._at_cross.setdefault(step, []).append(rid)

    def sync(self, req: Request, step: int) -> None:
        """Bring ``req``'s fields to their true values before ``step``."""
        rid = req.request_id
        n = step - self._synced[rid]
        if n:
            req.num_computed_tokens += n
            req.max_computed_tokens = req.num_computed_tokens
            req.output_token_ids.extend([self.token] * n)
            self._synced[rid] = step

    def crossing(self, step: int) -> list[Request]:
        """The lazy requests whose decode at ``step`` needs one more block, in admission order."""
        ids = self._at_cross.get(step, ())
        return sorted((self.requests[r] for r in ids if self._cross.get(r) == step), key=lambda r: r.admitted_seq)

    def allocated(self, rid: str, step: int) -> None:
        """The block for ``step``'s decode was allocated: the next one is due ``block_size`` steps later."""
        self._schedule_cross(rid, step + self.block_size)

    def finishing(self, step: int) -> list[Request]:
        """The lazy requests whose decode at ``step`` samples their last token, in admission order."""
        ids = self._at_finish.get(step, ())
        return sorted((self.requests[r] for r in ids if self._finish.get(r) == step), key=lambda r: r.admitted_seq)

    def forget_step(self, step: int) -> None:
        """Drop the bookkeeping of a step that has run."""
        self._at_cross.pop(step, None)
        self._at_finish.pop(step, None)

    def leave(self, req: Request, step: int) -> None:
        """``req`` stops being lazy before ``step``: synced, and its span (if any) closed."""
        rid = req.request_id
        self.sync(req, step)
        first = self._first.pop(rid)
        if step > first:
            self.closed.append(Span(rid, first, step - 1))
        self._offset_sum -= req.num_computed_tokens - step
        del self.requests[rid], self._synced[rid], self._cross[rid], self._finish[rid]

    def leave_all(self, step: int) -> None:
        for req in list(self.requests.values()):
            self.leave(req, step)
        self._at_cross.clear()
        self._at_finish.clear()
