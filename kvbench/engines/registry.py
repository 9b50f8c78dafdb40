"""Engine specs on the command line: ``kind[:key=value,...]``, e.g. ``reference:preemption_mode=swap``.

``parse_engine_spec`` checks the kind and every key against the adapter's ``option_keys`` and
raises :class:`EngineSpecError` with a usage message that lists the kinds and their keys.
Adapters are imported lazily: naming ``reference`` never imports transformers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from kvbench.engines.base import EngineAdapter

ENGINE_KINDS: dict[str, str] = {
    "reference": "kvbench.engines.reference:ReferenceAdapter",
    "hf": "kvbench.engines.hf:HFAdapter",
    "hf-cb": "kvbench.engines.hf_cb:HFContinuousBatchingAdapter",
}


class EngineSpecError(ValueError):
    """A malformed ``--engine`` value. The message is a complete usage text."""


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """Canonical display name: the kind plus its options, sorted."""
        if not self.options:
            return self.kind
        return self.kind + ":" + ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))


def adapter_class(kind: str) -> type[EngineAdapter]:
    module, _, attr = ENGINE_KINDS[kind].partition(":")
    return getattr(importlib.import_module(module), attr)


def usage() -> str:
    lines = ["--engine takes KIND[:KEY=VALUE,...]. Kinds and their keys:"]
    for kind in ENGINE_KINDS:
        cls = adapter_class(kind)
        lines.append(f"  {kind}: {(cls.__doc__ or '').strip().splitlines()[0] if cls.__doc__ else ''}")
        for key, help_text in cls.option_keys.items():
            lines.append(f"      {key}: {help_text}")
    return "\n".join(lines)


def parse_engine_spec(text: str) -> EngineSpec:
    kind, _, rest = text.strip().partition(":")
    if kind not in ENGINE_KINDS:
        raise EngineSpecError(f"unknown engine kind {kind!r} in --engine {text!r}\n{usage()}")
    options: dict[str, str] = {}
    allowed = adapter_class(kind).option_keys
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise EngineSpecError(f"--engine {text!r}: {item!r} is not KEY=VALUE\n{usage()}")
        if key not in allowed:
            raise EngineSpecError(f"--engine {text!r}: {kind} has no option {key!r} "
                                  f"(allowed: {', '.join(sorted(allowed))})\n{usage()}")
        options[key] = value
    return EngineSpec(kind, options)


def make_adapter(spec: EngineSpec, model_dir: str) -> EngineAdapter:
    return adapter_class(spec.kind)(model_dir, spec.options, name=spec.name)
