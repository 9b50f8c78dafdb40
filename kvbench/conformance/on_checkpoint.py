"""The engine under test again, on another checkpoint: for a check that needs a model of its own (one whose
greedy output reaches EOS at known positions, :mod:`kvbench.models.eos_checkpoint`).

A new adapter of the same class with the same options (a fault included) and the session's run settings
(liveness, admission default, override reports): in process a new engine, for a server kvbench starts a new
server. A server kvbench did not start (``openai:url=``) runs the checkpoint it was started with, so a
check there cannot have its own model: :func:`same_engine_on` returns None for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvbench.engines.base import EngineAdapter
from kvbench.engines.http.openai import OpenAIAdapter


def same_engine_on(engine: EngineAdapter, model_dir: str) -> EngineAdapter | None:
    """``engine``'s kind and options on ``model_dir`` (close it after use); None where the checkpoint is fixed."""
    if isinstance(engine, OpenAIAdapter):
        return None
    options = dict(engine.options)
    fault = getattr(engine, "fault", None)  # the faulty adapters keep it apart from their options
    if fault is not None:
        options["fault"] = fault
    adapter = type(engine)(model_dir, options, name=engine.name)
    adapter.configure_run(liveness=engine.liveness, admission_off_by_default=engine.admission_off_by_default,
                          reports_knob_overrides=engine.reports_knob_overrides)
    if hasattr(adapter, "beside") and hasattr(engine, "start_coming"):  # a server adapter: while this one serves,
        adapter.beside = engine  # the session adapter's starts ahead go on (the plan's tests need them next)
    return adapter


@contextmanager
def engine_on(engine: EngineAdapter, model_dir: str) -> Iterator[EngineAdapter | None]:
    """:func:`same_engine_on`, closed (its servers stopped) on the way out."""
    other = same_engine_on(engine, model_dir)
    try:
        yield other
    finally:
        if other is not None:
            other.close()
