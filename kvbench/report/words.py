"""How the report names things to a reader who has not read kvbench's source.

* A scenario is titled as its declaration titles it ("Evening surge"), never by its key
  (``evening_surge``), which stays in results files and on the command line.
* Each engine kind in a run is explained once, in the header ("hf-cb: Hugging Face transformers'
  continuous batching"), not at every mention.
* A note that every result of a scenario carries is said once for the scenario, not once a result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvbench.report import scoreboard

#: what each engine kind is, in words (an engine whose kind is not here is shown by its name alone)
ENGINE_KINDS: dict[str, str] = {
    "reference": "kvbench's reference engine, run in process",
    "hf": "Hugging Face transformers' generate, one request at a time",
    "hf-cb": "Hugging Face transformers' continuous batching (generate_batch, paged KV cache)",
    "server": "an engine's OpenAI-compatible server that kvbench starts and stops",
    "openai": "an OpenAI-compatible server already running at the given URL",
    "sim": "kvbench's simulator of the reference engine on a hardware profile (simulated seconds)",
}


def scenario_title(name: str) -> str:
    """The scenario's declared title, else its key in words ("swap_space_exhaustion" -> "Swap space exhaustion")."""
    decl = scoreboard.declaration(name)
    title = getattr(decl, "title", "") if decl is not None else ""
    return title or name.replace("_", " ").strip().capitalize()


def engine_glossary(engines: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(kind, what it is) once per engine kind of the run that :data:`ENGINE_KINDS` explains, in run order."""
    kinds = dict.fromkeys(str(e.get("kind") or e.get("name") or "") for e in engines)
    return [(k, ENGINE_KINDS[k]) for k in kinds if k in ENGINE_KINDS]


def common_notes(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The notes every one of two or more results carries: said once for the scenario."""
    if len(results) < 2:
        return []
    first = list(dict.fromkeys(results[0].get("notes") or []))
    return [n for n in first if all(n in (r.get("notes") or []) for r in results[1:])]
