"""Which of a run's aborts reached a request that was still running: the only ones a check may hold an
engine to.

An abort the client sends after the engine has finished the request is no abort at all, and an engine must
not be blamed for not counting it. So a check counts an abort only where the run itself shows that the
request could not have finished yet (:func:`confirmed_aborts`), by the one rule its driver allows:

* **the step clock** (in process): the driver sends a request's abort before step ``release +
  step_index(abort_at)``; a request gains at most one token a step, so one whose abort comes fewer steps
  after its release than its ``max_tokens`` is still in flight when the abort reaches the engine;
* **a closed stream** (over HTTP, an engine whose aborts race finishes): the client's own record of the close
  (``RequestTrace.abort_sent``, ``tokens_at_abort``, :mod:`kvbench.drivers.http_driver`): a stream closed
  after its first token, with no finish seen, and with at least half of its ``max_tokens`` (and
  :data:`ABORT_MARGIN`) still to come, was running and far from its end when the client let go of it. How
  far is far enough is the engine's speed against the time a close takes to reach it: the reference server
  makes a token in about a millisecond on two cores, and finished 8-token requests before their closes
  arrived, so a check that counts on it closes long requests early;
* **otherwise** (an in-process engine on the wall clock): the requests its adapter reports aborted, as
  the adapter saw them.

What the engine did with the confirmed aborts is the engine's own evidence (its finish reasons in process,
its counters and gauges over HTTP), never the client's record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.core.trace import Trace
from kvbench.drivers.release import step_index

#: a closed stream counts as a confirmed abort only this many tokens or more short of its max_tokens: the
#: engine would have had to produce them all between the client's last read and the close
ABORT_MARGIN = 4


@dataclass(frozen=True)
class AbortsSeen:
    """A run's aborts: ``asked`` (the workload asked for them), ``sent`` (the driver sent them to requests
    that had not ended, where the trace says so: a closed stream), ``confirmed`` (they reached a request
    the engine cannot have finished), and ``how`` they were confirmed, in words for a check's messages."""

    asked: tuple[str, ...]
    sent: tuple[str, ...]
    confirmed: tuple[str, ...]
    how: str


def confirmed_aborts(trace: Trace, requests: Sequence[Any], races: bool, margin: int = ABORT_MARGIN) -> AbortsSeen:
    """The aborts of a run of ``requests`` (WorkloadRequest-like) recorded in ``trace`` (see the module
    docstring); ``races``: the engine's aborts race its finishes (``EngineAdapter.aborts_race_finishes``: a
    closed HTTP stream)."""
    by_id = {r.request_id: r for r in requests}
    asked = tuple(rid for rid, r in by_id.items() if r.abort_at is not None and rid in trace.requests)
    if races:
        sent = tuple(rid for rid in asked if trace.requests[rid].abort_sent is not None)
        confirmed = tuple(rid for rid in sent if _far_from_its_end(trace.requests[rid].tokens_at_abort,
                                                                    by_id[rid].max_tokens, margin))
        return AbortsSeen(asked, sent, confirmed, f"closed after its first token with half its max_tokens (and "
                                                  f"at least {margin}) still to come, no finish seen")
    if trace.step_seconds is not None:
        confirmed = tuple(rid for rid in asked
                          if step_index(by_id[rid].abort_at, trace.step_seconds) < by_id[rid].max_tokens)
        return AbortsSeen(asked, confirmed, confirmed, "sent on the step clock fewer steps after its release than "
                                                       "its max_tokens, so before it could have finished")
    reported = tuple(rid for rid in asked if trace.requests[rid].finish_reason == "abort")
    return AbortsSeen(asked, reported, reported, "reported aborted by the adapter")


def _far_from_its_end(tokens: int | None, max_tokens: int, margin: int) -> bool:
    return tokens is not None and tokens >= 1 and max_tokens - tokens >= max(margin, max_tokens / 2)
