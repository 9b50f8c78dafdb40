"""What an engine ran one job with: the ``settings`` entry of a results file.

One record per job (``results.json``: each scenario result's ``settings``, and each scenario's ``settings`` list
with every distinct record once per engine)::

    {"asked": {"block_size": 32, "num_gpu_blocks": 12},     # the knobs the adapter received (set fields only)
     "confirmed": {"block_size": 32, "num_gpu_blocks": 12},  # what the engine itself states; absent: not read
     "launch": ["vllm", "serve", "...", "--port", "40123"],  # a launched server's command; absent in-process
     "package": "vllm", "version": "0.11.0",                 # the engine's version, where known
     "dtype": "float32"}                                     # what kvbench runs it in (launch flag), where known

``asked`` is kvbench's word, ``confirmed`` the engine's (:meth:`EngineAdapter.confirmed_settings`): it is never
filled in from ``asked``, and a failure to read it leaves it out. Nothing here raises: a record is evidence about a
run that already happened, and a run is not failed for want of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

from kvbench.core.jsonable import jsonable
from kvbench.engines.base import REDACTED, EngineAdapter, Knobs, redact_options

#: flags whose value is a credential, in any launch command (beside the adapter's own secret options)
SECRET_FLAGS = ("--api-key", "--api_key", "--token", "--hf-token", "--password", "--secret")

#: an engine family -> the package whose version it runs, where kvbench can ask (engine_version)
_PACKAGES = {"vllm": "vllm", "hf": "transformers", "hf-cb": "transformers", "transformers": "transformers",
             "sglang": "sglang"}
#: families that are kvbench's own code: their version is kvbench's
_OWN = frozenset({"reference", "sim"})


def job_settings(adapter: EngineAdapter, knobs: Knobs) -> dict[str, Any]:
    """The settings record of a job served on ``adapter`` with ``knobs``, as the adapter received them (after
    ``engine_knobs`` and ``knobs_for``). Call it right after the run: a server is read while it still runs."""
    record: dict[str, Any] = {"asked": jsonable(knobs.as_dict())}
    launch, confirmed = _launch_and_confirmed(adapter, knobs)
    if confirmed is not None:
        record["confirmed"] = jsonable(confirmed)
    if launch is not None:
        record["launch"] = redact_argv(launch, _secrets(adapter))
    package, version = engine_version(adapter)
    if version is not None:
        record["package"], record["version"] = package, version
    with contextlib.suppress(Exception):  # what kvbench knows it runs in: the launch's --dtype, the preset's
        if (dtype := adapter.compute_dtype()) is not None:
            record["dtype"] = dtype
    return record


def _launch_and_confirmed(adapter: EngineAdapter, knobs: Knobs) -> tuple[list[str] | None, dict[str, Any] | None]:
    """(launch command, what the engine confirms); either None where there is none or it could not be read. A
    launched server is read through the server that served the run (``running_launch``), never by asking for one:
    that could start another."""
    running = getattr(adapter, "running_launch", None)
    if callable(running):
        try:
            found = running(knobs)
        except Exception:  # a launch that cannot be restated: nothing known of it
            return None, None
        if found is None:  # the server is gone (it died, or was stopped): it says nothing now
            return None, None
        argv, remote = found
        return list(argv), _confirmed(remote, knobs)
    return None, _confirmed(adapter, knobs)


def _confirmed(adapter: Any, knobs: Knobs) -> dict[str, Any] | None:
    try:
        said = adapter.confirmed_settings(knobs)
    except Exception:  # unreadable is unknown, never a failed run
        return None
    return dict(said) if isinstance(said, dict) else None


def _secrets(adapter: EngineAdapter) -> list[str]:
    """The values of ``adapter``'s secret options (what a launch command must not show)."""
    options = dict(getattr(adapter, "options", None) or {})
    redacted = redact_options(options, getattr(adapter, "secret_options", frozenset()))
    return [str(v) for k, v in options.items() if v and redacted.get(k) == REDACTED]


def redact_argv(argv: Sequence[str], secrets: Iterable[str] = ()) -> list[str]:
    """``argv`` with every secret value (longest first, inside any word) and the value of every
    :data:`SECRET_FLAGS` flag (``--api-key X`` and ``--api-key=X``) shown as ``***``."""
    values = sorted({s for s in secrets if s}, key=len, reverse=True)
    out: list[str] = []
    hide_next = False
    for word in map(str, argv):
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = word.partition("=")
        if flag in SECRET_FLAGS:
            if eq:
                out.append(f"{flag}={REDACTED}")
                continue
            hide_next = True
        for value in values:
            word = word.replace(value, REDACTED)
        out.append(word)
    return out


def engine_version(adapter: EngineAdapter) -> tuple[str | None, str | None]:
    """(package, version) of what ``adapter`` runs: kvbench's own for the reference engine (in-process or its
    server) and the simulator, the launched llama-server's build, else the package its family names, as the
    adapter reports it (a server reports what the *server* runs). (None, None) where unknown."""
    import kvbench

    try:
        family = adapter.family()
    except Exception:
        return None, None
    if family in _OWN:
        return "kvbench", kvbench.__version__
    if family == "llamacpp":
        return "llama.cpp", _llamacpp_version(adapter)
    package = _PACKAGES.get(family)
    if package is None:
        return None, None
    try:
        return package, adapter.engine_version(package)
    except Exception:
        return package, None


def _llamacpp_version(adapter: Any) -> str | None:
    """llama-server's own version line, as the server adapter finds it (``engine_version("llama.cpp")``)."""
    try:
        return adapter.engine_version("llama.cpp")
    except Exception:  # a version is decoration here: never the reason a run fails
        return None


def distinct(records: Iterable[tuple[str | None, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each distinct record once, with ``modes``: the modes of the jobs that ran it (in order, None left out). A
    sweep's many jobs under one knob set make one record (results stay small)."""
    out: list[dict[str, Any]] = []
    for mode, record in records:
        if not record:
            continue
        same = next((o for o in out if {k: v for k, v in o.items() if k != "modes"} == record), None)
        if same is None:
            same = {**record, "modes": []}
            out.append(same)
        if mode is not None and mode not in same["modes"]:
            same["modes"].append(mode)
    return out
