"""The one small protocol every engine adapter implements.

An adapter wraps one engine (in-process or remote) and offers two things:

* ``generate(requests, knobs)``: batch generation for conformance checks. All requests are
  submitted before the engine runs; the result carries the outputs and whatever counters the
  engine exposes (preemptions by mode, swap-ins, prefix hits, prefill chunks...), so a check can
  prove that the mechanism it is about actually fired.
* ``serve(workload, recorder, knobs)``: timed serving for benchmarks. Requests are released at
  their arrival times on the wall clock and the adapter reports what happened to a
  :class:`kvbench.core.trace.TraceRecorder`.

Pressure is forced through :class:`Knobs`, kvbench's engine-neutral names for the levers every
paged-KV engine has. Each adapter maps them onto its own configuration and lists the knobs it
cannot map in ``unsupported_knobs`` so that checks can skip with that reason.
"""

from __future__ import annotations

import abc
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvbench.core.errors import EngineUnavailable  # re-exported: part of the adapter protocol

# The protocol's vocabulary lives in kvbench.core; it is re-exported here so that an adapter needs
# one import.
from kvbench.core.knobs import DEFAULT_KNOBS, Knobs
from kvbench.core.kv_budget import ANY_LAYOUT, KVBudget, KVLayout, in_engine_terms, pool_knobs
from kvbench.core.liveness import DEFAULT_LIVENESS, Liveness
from kvbench.core.requests import GenOutput, GenRequest, GenResult, WorkloadRequest

if TYPE_CHECKING:
    from kvbench.core.trace import TraceRecorder

#: Capabilities an adapter may declare. A check needing one the engine lacks is skipped.
CAPABILITIES = frozenset(
    {
        "recompute",  # can preempt by discarding KV and recomputing it
        "swap",  # can preempt by copying KV to host memory
        "prefix_caching",  # reuses KV of shared prompt prefixes
        "chunked_prefill",  # splits a prefill across steps under a token budget
        "priority",  # honours per-request priorities
        "block_introspection",  # exposes its block manager to the stateful refcount machine
        "events",  # reports preemptions/swaps/hits as they happen
        "sampling",  # seeded temperature sampling
        "abort",  # can abort a request in flight
        "stop_token_ids",  # ends a request at any of its GenRequest.stop_token_ids
    }
)



#: options that are credentials for every adapter; an adapter adds its own in ``secret_options``
ALWAYS_SECRET = frozenset({"api_key"})
#: what a secret option's value is shown as, wherever kvbench prints or writes it
REDACTED = "***"


def redact_options(options: dict[str, str], secret: frozenset[str] | set[str] = ALWAYS_SECRET) -> dict[str, str]:
    """``options`` with the value of every secret one (``secret`` and :data:`ALWAYS_SECRET`) replaced by
    :data:`REDACTED`: what names, test ids, results and reports show."""
    hidden = ALWAYS_SECRET | set(secret)
    return {k: REDACTED if k in hidden else v for k, v in options.items()}


class AdapterRefusal(ValueError):
    """The adapter itself refused a knob value before the engine ever saw it (it cannot translate it, or
    it pre-checks a limit of the engine's). Distinct from the engine's own refusal: a check that judges
    how the *engine* rejects bad configuration (check 8, invalid configuration) skips on this, saying
    the engine's validation went untested, instead of crediting the engine with the adapter's words.

    ``knob`` and ``value`` name what was refused; the message says why."""

    def __init__(self, knob: str, value: Any, why: str):
        self.knob, self.value = knob, value
        super().__init__(why)


class EngineAdapter(abc.ABC):
    """Base class of engine adapters. Subclasses set ``kind``, ``capabilities``, ``option_keys``."""

    #: the kind named on the command line, e.g. "reference", "hf", "hf-cb"
    kind: str = ""
    #: what this engine can do (subset of CAPABILITIES)
    capabilities: frozenset[str] = frozenset()
    #: option keys accepted in ``--engine kind:key=value`` with a one-line help each
    option_keys: dict[str, str] = {}  # noqa: RUF012 - read-only class-level table
    #: Knobs fields this adapter cannot map, with the reason
    unsupported_knobs: dict[str, str] = {}  # noqa: RUF012
    #: why the engine has no per-request length limit at all (a prompt past the model's positions is run,
    #: not refused), or None when it has one: the over-long-prompt check then lacks its prerequisite and skips
    no_length_limit: str | None = None
    #: True when kvbench drives the engine's steps itself, so ``serve`` accepts ``step_seconds`` and
    #: releases arrivals by engine step (deterministic counts, see kvbench.drivers.step_loop). Servers and
    #: engines with their own loop thread are not steppable: their counts are gated like times.
    steppable: bool = False
    #: True when an abort is a message the engine may act on after the request already finished (a closed
    #: HTTP stream): the engine then counts fewer aborts than the client asked for, and check 6 allows that
    #: (never more, and at least one).
    aborts_race_finishes: bool = False
    #: what the engine says, word for word, when it fails a request because its KV pool had no room left (an
    #: engine that fails requests in flight rather than preempt them): :meth:`says_pool_full` reads an error by it
    pool_full_errors: tuple[str, ...] = ()
    #: options that are credentials: their values never reach the terminal, test ids, results.json,
    #: junitxml or the report (shown as ``***``). ``api_key`` always is one (:data:`ALWAYS_SECRET`).
    secret_options: frozenset[str] = ALWAYS_SECRET
    #: what KV pools the engine accepts (block sizes, whether its pool must hold max_model_len, head sizes):
    #: checks state their pressure in tokens (kvbench.core.kv_budget) and :meth:`pool_knobs` turns it into
    #: this engine's terms
    kv_layout: KVLayout = ANY_LAYOUT
    #: True for a simulator: its tokens are placeholders and its times simulated seconds. The one place that
    #: says so: conformance checks skip such an engine, and :meth:`describe` tags its results ``simulated``
    #: for the report
    simulated: bool = False
    #: capability -> why the engine lacks it, in the engine's terms ("vLLM V1 preempts by recompute only"), for
    #: the skip a check needing it gives
    lacking: dict[str, str] = {}  # noqa: RUF012

    #: Knobs field -> the option key it overrides, where the names differ (e.g. ``num_gpu_blocks`` ->
    #: ``num_gpu_blocks_override``). A knob named like an option key overrides that option without an entry.
    knob_options: dict[str, str] = {}  # noqa: RUF012
    #: limits of the no-progress watchdog every engine-driving loop runs under (the plugin sets them per
    #: session from --kvbench-deadline / --kvbench-stall-steps / --kvbench-stall-seconds, through
    #: :meth:`configure_run`)
    liveness: Liveness = DEFAULT_LIVENESS
    #: whether runs whose knobs leave ``admission_policy`` unset run with admission control off (set by
    #: :meth:`configure_run`; see :meth:`knobs_for`)
    admission_off_by_default: bool = False
    #: whether ``generate`` and ``serve`` report the engine options their knobs override to the running
    #: test's evidence collector (set by :meth:`configure_run`)
    reports_knob_overrides: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every entry point a subclass defines that takes knobs (:data:`KNOB_ENTRY_POINTS`) runs
        :meth:`_run_with` first: the one place where the session's run settings meet each call, so that
        every adapter, a third-party one included, follows them without writing a line for it."""
        super().__init_subclass__(**kwargs)
        for name, position in KNOB_ENTRY_POINTS.items():
            method = cls.__dict__.get(name)
            if inspect.isfunction(method) and not getattr(method, "__isabstractmethod__", False):
                setattr(cls, name, _entry_point(name, position, method))

    def configure_run(self, *, liveness: Liveness | None = None, admission_off_by_default: bool | None = None,
                      reports_knob_overrides: bool | None = None) -> None:
        """How this adapter's runs go for the session that owns it; what is not given stays as it is.

        ``liveness``: the no-progress watchdog's limits. ``admission_off_by_default``: conformance checks
        force preemptions on purpose and prove them, and admission control exists to avoid them, so the
        plugin's ``engine`` fixture turns it off unless a check's knobs ask for it (and the records say so,
        as a knob override; benchmarks keep the engine's setting). ``reports_knob_overrides``: adapters
        made from an ``--engine`` spec (:func:`kvbench.engines.registry.make_adapter`) report the options
        each call's knobs override (:func:`kvbench.core.evidence.record_knob_overrides`), so results can
        say when a check ran with other values than the spec named."""
        if liveness is not None:
            self.liveness = liveness
        if admission_off_by_default is not None:
            self.admission_off_by_default = admission_off_by_default
        if reports_knob_overrides is not None:
            self.reports_knob_overrides = reports_knob_overrides

    def knobs_for(self, knobs: Knobs) -> Knobs:
        """The knobs a run is driven with for ``knobs`` asked: admission control off when
        :attr:`admission_off_by_default` is set and ``knobs`` leave it unset; else ``knobs`` themselves."""
        if self.admission_off_by_default and knobs.admission_policy is None:
            return knobs.merged(Knobs(admission_policy="none"))
        return knobs

    def _run_with(self, entry_point: str, knobs: Knobs | None) -> Knobs | None:
        """Before each call of an entry point: the knobs it runs with (None: as asked, the method's own
        default) after :meth:`knobs_for`, with the overrides reported where :meth:`configure_run` says so."""
        used = self.knobs_for(DEFAULT_KNOBS if knobs is None else knobs)
        if self.reports_knob_overrides and entry_point in ("generate", "serve"):
            from kvbench.core.evidence import record_knob_overrides

            record_knob_overrides(self.knob_overrides(used))
        return None if knobs is None and used is DEFAULT_KNOBS else used

    def __init__(self, model_dir: str, options: dict[str, str] | None = None, name: str | None = None):
        """Raises ValueError naming the option, as :meth:`validate_options` does."""
        self.model_dir = model_dir
        self.options = dict(options or {})
        self.name = name or self.kind
        type(self).validate_options(self.options)

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        """Check every option (``--engine kind:key=value`` strings) without starting the engine.

        Called when ``--engine`` is parsed, before any test runs, and again by ``__init__``. Raises
        ValueError (or TypeError) whose message names the option and the values allowed. Subclasses
        extend it with the engine's *own* validation (call ``super().validate_options(options)`` first);
        the base checks only that every key is in ``option_keys``.
        """
        unknown = set(options) - set(cls.option_keys)
        if unknown:
            raise ValueError(f"engine {cls.kind!r}: unknown option(s) {sorted(unknown)}; "
                             f"allowed: {sorted(cls.option_keys)}")

    def pool_knobs(self, budget: KVBudget, block_size: int | None = None) -> Knobs:
        """``budget`` (a KV pool in tokens) as this engine's knobs: block size, pool in blocks and, where the
        engine needs it, ``max_model_len``. ``block_size`` asks for a size (rounded up to one it takes)."""
        return pool_knobs(budget, self.kv_layout, block_size)

    def engine_knobs(self, knobs: Knobs, needs: Sequence[int]) -> Knobs:
        """``knobs`` whose pools are stated in blocks of another size restated in this engine's terms, the
        same pools in tokens (:func:`kvbench.core.kv_budget.in_engine_terms`); ``needs``: the workload's
        requests' KV needs in tokens."""
        return in_engine_terms(knobs, self.kv_layout, needs)

    def knob_overrides(self, knobs: Knobs) -> dict[str, tuple[str, Any]]:
        """The engine options that ``knobs`` override: ``{knob: (option value given, knob value used)}``.

        Only options given on the command line and set to something else count: a check that forces
        ``preemption_mode="recompute"`` on ``reference:preemption_mode=swap`` overrides it; the same knob
        on ``reference`` (no such option) or on ``reference:preemption_mode=recompute`` does not.
        """
        overrides: dict[str, tuple[str, Any]] = {}
        for knob, value in knobs.as_dict().items():
            key = self.knob_options.get(knob, knob)
            if key in self.options and not _same_value(self.options[key], value):
                overrides[knob] = (self.options[key], value)
        return overrides

    def describe(self) -> dict[str, Any]:
        """Engine identity and configuration for results files."""
        return {"name": self.name, "kind": self.kind, "options": redact_options(self.options, self.secret_options),
                "capabilities": sorted(self.capabilities), **({"simulated": True} if self.simulated else {})}

    @classmethod
    def check_available(cls, options: dict[str, str]) -> None:
        """Raise :class:`EngineUnavailable` when the engine named with ``options`` cannot be had at all (not
        installed, nothing listening at its URL), with one message that says how to get it.

        Called once per ``--engine`` before any test runs, so a missing engine is one usage error instead
        of a failure per check. Default: always available (in-process engines import with kvbench)."""
        return None

    @classmethod
    def kv_layout_for(cls, options: dict[str, str]) -> KVLayout:
        """The KV layout an engine named with ``options`` will have, known before it starts (the session
        picks a checkpoint whose head size every engine takes). Default: the class's ``kv_layout``."""
        return cls.kv_layout

    def compute_dtype(self) -> str | None:
        """The dtype the engine computes in (``"float32"``, ``"bfloat16"``, ``"float16"``), or None when
        kvbench cannot know it (taken as float32). It picks the near-tie tolerance of the conformance
        checks and the dtype of their ground truth (:func:`kvbench.conformance.equivalence.tolerance_for`).
        Default: None."""
        return None

    def family(self) -> str:
        """The engine this adapter drives, as an expectations entry's ``engine`` may name it: the kind by
        default; an adapter for a server says which engine serves (``"vllm"`` behind ``openai``)."""
        return self.kind

    def engine_version(self, package: str) -> str | None:
        """The version of ``package`` the engine runs (an expectations entry's ``versions`` are checked
        against it), or None when unknown. Default: the distribution installed here; an adapter for a
        server reports what the *server* runs."""
        import importlib.metadata

        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def confirmed_settings(self, knobs: Knobs = DEFAULT_KNOBS) -> dict[str, Any]:
        """The settings the *engine itself* says it runs ``knobs``' runs with (its configuration endpoint, the
        labels of its metrics, its own log), by :class:`Knobs` field name: ``{"max_num_batched_tokens": 16,
        "enable_chunked_prefill": True, ...}``. Only what the engine states: a setting it does not state is
        absent, never filled in from ``knobs`` (what kvbench asked for is not evidence of what ran). A check
        proves a mechanism from outside with it (a prompt longer than a confirmed token budget, served right,
        was prefilled in pieces).

        Default: nothing confirmed, except for an adapter that runs each call through another adapter it keeps
        per knob set (``server_for(knobs)``: the ``server`` adapter and the server it launched for ``knobs``),
        which answers with that adapter's. Call it after a run with the same ``knobs``."""
        server_for = getattr(self, "server_for", None)
        if server_for is None:
            return {}
        return server_for(self.knobs_for(knobs)).confirmed_settings(knobs)

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        """Run all requests to completion (all submitted before the engine steps)."""

    def serve(self, workload: Sequence[WorkloadRequest], recorder: TraceRecorder, knobs: Knobs = DEFAULT_KNOBS) -> None:
        """Serve a timed workload, reporting to ``recorder``. Default: not supported."""
        raise NotImplementedError(f"engine {self.kind!r} does not support timed serving")

    def says_pool_full(self, message: str | None) -> bool:
        """Whether ``message`` (a failed request's error) is the engine's own word that its KV pool had no room
        left (:attr:`pool_full_errors`): evidence of a dry pool from the engine, where its clients cannot tell."""
        return bool(message) and any(words in message for words in self.pool_full_errors)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, servers, device memory)."""

    def check_failed(self) -> None:  # noqa: B027 - optional hook
        """A test using this adapter failed (or errored): drop whatever a later test could inherit from it.
        The plugin calls it; the ``server`` adapter stops the servers it keeps for reuse."""


#: the adapter methods a check or benchmark drives with knobs -> where ``knobs`` sits among their positional
#: arguments after ``self``: generate(requests, knobs), swap_round_trip(requests, knobs), serve(workload,
#: recorder, knobs)
KNOB_ENTRY_POINTS = {"generate": 1, "swap_round_trip": 1, "serve": 2}


def _entry_point(name: str, position: int, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` running :meth:`EngineAdapter._run_with` on its knobs first (once per call: a subclass's
    entry point that calls its base's through ``super()`` has already done it)."""

    @functools.wraps(method)
    def entry(self: EngineAdapter, *args: Any, **kwargs: Any) -> Any:
        if getattr(type(self), name) is not entry:  # reached through super() from the subclass's own
            return method(self, *args, **kwargs)
        positional = "knobs" not in kwargs and len(args) > position
        used = self._run_with(name, args[position] if positional else kwargs.get("knobs"))
        if used is not None and positional:
            args = (*args[:position], used, *args[position + 1:])
        elif used is not None:
            kwargs["knobs"] = used
        return method(self, *args, **kwargs)

    return entry


def _same_value(option: str, value: Any) -> bool:
    """Whether an option string (``"true"``, ``"64"``, ``"swap"``) denotes the knob value ``value``."""
    text = option.strip().lower()
    if isinstance(value, bool):
        return text in (("true", "1", "yes") if value else ("false", "0", "no"))
    if isinstance(value, int | float):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return text == str(value).lower()


__all__ = [
    "CAPABILITIES",
    "DEFAULT_KNOBS",
    "AdapterRefusal",
    "EngineAdapter",
    "EngineUnavailable",
    "GenOutput",
    "GenRequest",
    "GenResult",
    "KVBudget",
    "KVLayout",
    "Knobs",
    "WorkloadRequest",
]
