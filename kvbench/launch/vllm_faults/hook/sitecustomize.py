"""Start-up hook of a vLLM launched with a kvbench fault: this folder comes first on the server's
``PYTHONPATH``, so every Python process of the server (the API server, the EngineCore process, its workers,
spawned or forked) runs this at start-up.

With ``KVBENCH_VLLM_FAULT`` set it arms that fault (:mod:`kvbench_vllm_faults`, beside this file); an
unknown name ends the process with status 2, since a server that ran without the fault it was asked for
would let a check pass for the wrong reason. Without the variable it does nothing. Either way it then
runs the ``sitecustomize`` this one shadows, if the interpreter has one further along ``sys.path``.

Standard library only: vLLM's environment need not have kvbench installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _arm_from_environment() -> None:
    name = os.environ.get("KVBENCH_VLLM_FAULT")
    if not name:
        return
    import kvbench_vllm_faults

    try:
        kvbench_vllm_faults.arm(name)
    except ValueError as e:
        sys.stderr.write(f"{kvbench_vllm_faults.LOG_PREFIX} {e}\n")
        sys.stderr.flush()
        os._exit(2)


def _run_the_shadowed_one() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_arm_from_environment()
_run_the_shadowed_one()
