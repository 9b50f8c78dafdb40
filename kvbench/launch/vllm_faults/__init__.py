"""vLLM launched with a fault in its engine, without touching the installed package:
``--engine "server:preset=vllm,fault=NAME"``.

The launch gets two things more than a plain vLLM (:func:`fault_environment`): the folder :data:`HOOK_DIR`
first on ``PYTHONPATH``, whose ``sitecustomize.py`` every Python process of the server runs at start-up, and
``KVBENCH_VLLM_FAULT=NAME``, which tells it the fault to arm. The fault replaces one function of vLLM V1's
scheduler, KV-cache manager or metrics in whichever process loads it (the EngineCore process for the
scheduler and the block pool, the API server for the metrics), spawned or forked. The catalogue, the patches
and the hook are one self-contained file (``hook/kvbench_vllm_faults.py``) that runs in vLLM's environment,
which need not have kvbench installed; this module reads the same catalogue, so the names kvbench accepts
are the ones the hook patches.

What a fault did is in the server's log: lines beginning :data:`LOG_PREFIX` say where it was armed, which
function it patched, and, once per process, that it fired (:func:`fault_lines`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from kvbench.launch.vllm_faults.hook.kvbench_vllm_faults import FAULT_ENV, FAULTS, LOG_PREFIX, VllmFault

__all__ = ["FAULTS", "FAULT_ENV", "HOOK_DIR", "LOG_PREFIX", "VllmFault", "check_fault", "fault_environment",
           "fault_lines", "fired_in"]

#: the folder put first on a faulted server's PYTHONPATH
HOOK_DIR = Path(__file__).resolve().parent / "hook"


def check_fault(name: str) -> VllmFault:
    """The fault called ``name``; ValueError listing the known ones for any other name."""
    if name not in FAULTS:
        raise ValueError(f"unknown vLLM fault {name!r}; the faults: {', '.join(FAULTS)}")
    return FAULTS[name]


def fault_environment(name: str, env: Mapping[str, str]) -> dict[str, str]:
    """The variables a vLLM launched with fault ``name`` gets on top of ``env`` (the environment it would
    have had): the hook's folder first on ``PYTHONPATH``, ahead of whatever ``env`` puts there, and the fault."""
    check_fault(name)
    path = [str(HOOK_DIR), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {"PYTHONPATH": os.pathsep.join(path), FAULT_ENV: name}


def fault_lines(log: str) -> list[str]:
    """The lines of a server's log that the hook wrote (armed, patched, fired), from the prefix on: the server's
    processes share the log, and another's unfinished line may stand before one of them."""
    return [line[line.index(LOG_PREFIX):] for line in log.splitlines() if LOG_PREFIX in line]


def fired_in(log: str, name: str) -> list[str]:
    """The ``fired`` lines fault ``name`` wrote in a server's log: empty when the fault never changed what
    the engine did (a check that passed then proves nothing about the fault)."""
    pattern = re.compile(rf"^{re.escape(LOG_PREFIX)} {re.escape(name)} fired\b")
    return [line for line in fault_lines(log) if pattern.match(line)]
