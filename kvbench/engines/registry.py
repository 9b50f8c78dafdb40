"""Engine specs on the command line, and where adapter classes come from.

An ``--engine`` value names an adapter class and its options, in one of two forms::

    KIND[:KEY=VALUE,...]                  a registered kind:   reference:preemption_mode=swap
    MODULE:CLASS[:KEY=VALUE,...]          an importable class: mypkg.adapters:MyAdapter:url=http://127.0.0.1:8000

A *registered kind* is a name in the ``kvbench.engines`` entry-point group (``importlib.metadata``),
whose value is ``module:Class``. kvbench's own kinds register there in its ``pyproject.toml``, exactly
as a third-party package does in its own, so installing such a package adds its kinds with no change
to kvbench. :data:`BUILTIN_KINDS` mirrors kvbench's own entry points (a test holds the two equal) and
is what kvbench's own kinds resolve to: the checkout's code, not its installed metadata, which goes
stale when a module moves after the last ``pip install -e .``. A kind wins over an import path of the
same spelling.

:func:`parse_engine_spec` resolves the class, checks every key against its ``option_keys`` and every
value with its ``validate_options`` (the engine's own validation), and raises
:class:`EngineSpecError` with a usage message otherwise. Adapter modules are imported only when
named or listed in a usage message: naming ``reference`` never imports transformers.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from kvbench.engines.base import ALWAYS_SECRET, REDACTED, EngineAdapter, redact_options

#: the entry-point group adapters register in: ``[project.entry-points."kvbench.engines"]``
ENTRY_POINT_GROUP = "kvbench.engines"

#: kvbench's own kinds, as its pyproject.toml registers them in :data:`ENTRY_POINT_GROUP`
BUILTIN_KINDS: dict[str, str] = {
    "reference": "kvbench.engines.inprocess.reference:ReferenceAdapter",
    "hf": "kvbench.engines.hf.generate:HFAdapter",
    "hf-cb": "kvbench.engines.hf.continuous_batching:HFContinuousBatchingAdapter",
    "openai": "kvbench.engines.http.openai:OpenAIAdapter",
    "server": "kvbench.engines.http.server:ServerAdapter",
    "sim": "kvbench.sim.adapter:SimAdapter",
}

# module.path:Class (dotted attributes allowed after the colon)
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class EngineSpecError(ValueError):
    """A malformed or invalid ``--engine`` value. The message is a complete usage text."""


@dataclass(frozen=True, repr=False)
class EngineSpec:
    """One ``--engine`` value: ``kind`` is a registered kind or a ``module:Class`` import path.

    ``secret`` names the options that are credentials (the adapter's ``secret_options``): their values
    are kept in ``options`` for the adapter, and shown as ``***`` everywhere else (``name``, the test
    ids and results made from it, ``public_options``, ``repr``)."""

    kind: str
    options: dict[str, str] = field(default_factory=dict)
    secret: frozenset[str] = field(default=ALWAYS_SECRET, compare=False)

    @property
    def public_options(self) -> dict[str, str]:
        """The options with every secret value redacted: what results and reports may show."""
        return redact_options(self.options, self.secret)

    @property
    def name(self) -> str:
        """Canonical display name: the kind plus its options, sorted, secrets redacted (parses back to this
        spec when it has no secret option)."""
        if not self.options:
            return self.kind
        return self.kind + ":" + ",".join(f"{k}={v}" for k, v in sorted(self.public_options.items()))

    def __repr__(self) -> str:
        return f"EngineSpec({self.name!r})"


def engine_kinds() -> dict[str, str]:
    """Every registered kind -> ``module:Class``: the entry-point group over :data:`BUILTIN_KINDS`.

    Raises :class:`EngineSpecError` when two installed distributions register one kind differently.
    """
    kinds = dict(BUILTIN_KINDS)
    seen: dict[str, tuple[str, str]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "?"
        if dist == "kvbench" and ep.name in BUILTIN_KINDS:
            continue  # kvbench's own metadata may predate a move: the checkout's table is the truth
        if ep.name in seen and seen[ep.name][0] != ep.value:
            raise EngineSpecError(f"engine kind {ep.name!r} is registered twice in entry-point group "
                                  f"{ENTRY_POINT_GROUP!r}: {seen[ep.name][0]} (by {seen[ep.name][1]}) and "
                                  f"{ep.value} (by {dist}); uninstall one of them")
        seen[ep.name] = (ep.value, dist)
        kinds[ep.name] = ep.value
    return kinds


def _load(target: str, where: str) -> type[EngineAdapter]:
    """Import ``module:Class`` and check it is a concrete EngineAdapter; errors name ``where``."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # an adapter's own import error, reported, not a traceback
        raise EngineSpecError(f"{where}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EngineSpecError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, EngineAdapter)):
        raise EngineSpecError(f"{where}: {target} is not an engine adapter: it must be a subclass of "
                              f"kvbench.engines.base.EngineAdapter, got {obj!r}")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise EngineSpecError(f"{where}: {target} does not implement {missing}")
    return obj


def adapter_class(kind: str) -> type[EngineAdapter]:
    """The adapter class of a registered kind or of a ``module:Class`` path. Raises EngineSpecError."""
    kinds = engine_kinds()
    if kind in kinds:
        return _load(kinds[kind], f"engine kind {kind!r} ({kinds[kind]})")
    if _IMPORT_PATH.fullmatch(kind):
        return _load(kind, f"engine class {kind!r}")
    raise EngineSpecError(f"unknown engine kind {kind!r}")


def _describe_kind(kind: str) -> list[str]:
    try:
        cls = adapter_class(kind)
    except EngineSpecError as e:  # one broken plugin must not hide the others
        return [f"  {kind}: (cannot be loaded: {e})"]
    doc = (cls.__doc__ or "").strip().splitlines()
    lines = [f"  {kind}: {doc[0] if doc else ''}"]
    lines += [f"      {key}: {help_text}" for key, help_text in cls.option_keys.items()]
    return lines


def usage(kind: str | None = None) -> str:
    """The ``--engine`` syntax, then every registered kind (or only ``kind``) with its option keys."""
    lines = ["--engine takes KIND[:KEY=VALUE,...] or MODULE:CLASS[:KEY=VALUE,...] (an EngineAdapter subclass, "
             f"e.g. mypkg.adapters:MyAdapter). Kinds register in the entry-point group {ENTRY_POINT_GROUP!r}."]
    try:
        kinds = list(engine_kinds()) if kind is None else [kind]
    except EngineSpecError as e:
        return "\n".join([*lines, str(e)])
    lines.append("Kinds and their keys:" if kind is None else "Its keys:")
    for k in kinds:
        lines += _describe_kind(k)
    return "\n".join(lines)


def one_line(error: EngineSpecError) -> str:
    """The error of an ``--engine`` value alone, on one line, as a command line shows it: the kinds and their
    keys that :func:`usage` lists are a request away (``kvbench engines [KIND]``), not printed before it."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else "invalid --engine value"
    return f"{first} (kvbench engines [KIND] lists the engine kinds and their option keys)"


def _split_target(text: str) -> tuple[str, str]:
    """``(kind or module:Class, the options text)``; raises EngineSpecError for an unknown kind."""
    head, sep, tail = text.partition(":")
    if head in engine_kinds():
        return head, tail
    attr, _, rest = tail.partition(":")
    if sep and _IMPORT_PATH.fullmatch(f"{head}:{attr}"):
        return f"{head}:{attr}", rest
    raise EngineSpecError(f"unknown engine kind {head!r} in --engine {text!r}\n{usage()}")


def _redacted(text: str, secret: frozenset[str] | set[str]) -> str:
    """``text`` (an ``--engine`` value, or a message quoting one) with the value of every secret option the
    value names replaced by ``***``."""
    keys = ALWAYS_SECRET | set(secret)
    values = {value.strip() for part in re.split(r"[:,]", text) for key, eq, value in [part.partition("=")]
              if eq and key.strip() in keys and value.strip()}
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


def parse_engine_spec(text: str) -> EngineSpec:
    """Parse and check one ``--engine`` value: the class loads, every key is known, every value valid.

    Raises :class:`EngineSpecError` naming what is wrong (the kind, the key, or the option's field and
    allowed values, in the engine's own words) followed by a usage text. Secret option values
    (``api_key``, the adapter's ``secret_options``) never appear in it.
    """
    text = text.strip()
    shown = _redacted(text, ALWAYS_SECRET)
    try:
        kind, rest = _split_target(text)
        cls = adapter_class(kind)
    except EngineSpecError as e:
        message = str(e).replace(text, shown)
        raise EngineSpecError(message if "\n" in message else f"--engine {shown!r}: {message}\n{usage()}") from None
    secret = ALWAYS_SECRET | frozenset(getattr(cls, "secret_options", ()))
    shown = _redacted(text, secret)
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise EngineSpecError(f"--engine {shown!r}: {_redacted(item, secret)!r} is not KEY=VALUE\n{usage(kind)}")
        if key not in cls.option_keys:
            raise EngineSpecError(f"--engine {shown!r}: {kind} has no option {key!r} "
                                  f"(allowed: {', '.join(sorted(cls.option_keys))})\n{usage(kind)}")
        if key in options:
            raise EngineSpecError(f"--engine {shown!r}: option {key!r} given twice")
        options[key] = value
    try:
        cls.validate_options(dict(options))
    except (ValueError, TypeError) as e:
        message = str(e)
        for key in secret & set(options):  # the engine's own words may quote the value
            message = message.replace(options[key], REDACTED)
        raise EngineSpecError(f"--engine {shown!r}: {message}\n{usage(kind)}") from None
    return EngineSpec(kind, options, secret)


def make_adapter(spec: EngineSpec, model_dir: str) -> EngineAdapter:
    """A new adapter for ``spec`` on the checkpoint ``model_dir``.

    Its ``generate`` and ``serve`` report the engine options each call's knobs override to the evidence
    collector of the running test, if any (:meth:`EngineAdapter.configure_run`), so results can say when
    a check ran with other values than the ``--engine`` spec named.
    """
    adapter = adapter_class(spec.kind)(model_dir, spec.options, name=spec.name)
    adapter.configure_run(reports_knob_overrides=True)
    return adapter
