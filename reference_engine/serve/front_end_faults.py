"""Deliberately broken front ends: each breaks one property of what the server sends a client, so that a
test can show the conformance check about it failing over HTTP (a check that cannot fail proves nothing).

A testing aid, chosen with the hidden flag ``--front-end-fault NAME`` (``python -m reference_engine.serve``),
never in a real deployment. The engine's own faults are patches of a built engine, kept by kvbench
(``kvbench.conformance.faults``); these are in the HTTP process, which holds no engine when the engine runs
in its own process, so they live here, beside the code they break, and each is one small replacement of a
function the server calls, made once in the server process before it serves::

    python -m reference_engine.serve --model DIR --front-end-fault streams_text_without_leading_spaces
"""

from __future__ import annotations

from collections.abc import Callable

#: fault -> what it breaks (the check that must catch it: kvbench's suites/conformance/test_user_view.py)
FRONT_END_FAULTS: dict[str, str] = {
    "streams_text_without_leading_spaces": "each streamed text delta but the last loses the spaces at its start "
                                           "(the space a word-level or sentencepiece token writes before itself): "
                                           "a stream's text is not the decoding of its ids; non-streamed text is "
                                           "right",
    "drops_tokens_of_a_failed_step": "a stream whose request fails skips the tokens queued for it ahead of its "
                                     "failure (those the failed step gave it): they never reach the client before "
                                     "its error event",
}


def _streams_text_without_leading_spaces() -> None:
    from reference_engine.serve import detokenize

    push = detokenize.TextStream.push

    def push_stripped(self: detokenize.TextStream, new_ids) -> str:  # type: ignore[no-untyped-def]
        return push(self, new_ids).lstrip(" ")

    detokenize.TextStream.push = push_stripped  # type: ignore[method-assign]


def _drops_tokens_of_a_failed_step() -> None:
    from reference_engine.serve import app

    latest = app._latest

    def latest_dropping(outputs, item):  # type: ignore[no-untyped-def]
        item, failure = latest(outputs, item)
        return (failure, None) if failure is not None else (item, None)

    app._latest = latest_dropping


_PATCHES: dict[str, Callable[[], None]] = {
    "streams_text_without_leading_spaces": _streams_text_without_leading_spaces,
    "drops_tokens_of_a_failed_step": _drops_tokens_of_a_failed_step,
}


def apply_front_end_fault(name: str) -> None:
    """Break this process's front end with fault ``name``; ValueError naming the faults there are."""
    if name not in _PATCHES:
        raise ValueError(f"--front-end-fault {name!r} is not a front-end fault; those are: "
                         f"{', '.join(sorted(FRONT_END_FAULTS))}")
    _PATCHES[name]()
