"""What the ``llamacpp`` server preset needs beyond flag rules: where llama-server is, the checkpoint as GGUF,
the KV cache type that keeps the GGUF's precision, and the KV layout of its slots.

llama.cpp's server (``tools/server`` of the sources llama-cpp-python 0.3.36 vendors) keeps one KV cell per
token. Its slots (``--parallel``) either draw on one pool of ``-c`` cells (``--kv-unified``, what it runs when
the slot count is left to it) or each own ``-c / parallel`` of them (``--no-kv-unified``); both sizes are padded
up to a multiple of 256 cells (``src/llama-context.cpp``), and a slot never holds more than the model's trained
context. It has no preemption: a request holds its slot until it ends; what a full cache does is what the
conformance suite finds out (docs/engines.md#the-llamacpp-preset).

The KV cache type: llama-server stores K and V in f16 unless told (``-ctk``/``-ctv``), so a float32 GGUF would be
computed against half-precision keys and values, a different model than the float32 checkpoint the ground
truth runs. kvbench launches it with the cache in the GGUF's own type (f32 for float32, f16, bf16).
"""

from __future__ import annotations

import functools
import os
import shlex
import sys

from kvbench.core.errors import EngineUnavailable
from kvbench.core.kv_budget import KVLayout

#: llama-server's pool padding (``GGML_PAD(n_ctx, 256)`` in src/llama-context.cpp)
CONTEXT_PAD = 256
#: the slots llama-server runs when ``--parallel`` is not given (tools/server/server.cpp: auto -> 4, unified)
AUTO_SLOTS = 4

#: one pool of one-token cells for every slot: what llama-server runs by default
UNIFIED_LAYOUT = KVLayout(only_block_size=1, preferred_block_size=1, pool_multiple=CONTEXT_PAD, slots="unified",
                          default_slots=AUTO_SLOTS)

NO_PREEMPTION = ("llama.cpp never preempts: a request keeps its slot and its KV until it ends (a full unified "
                 "cache fails the requests in flight instead)")
NO_SWAP = ("llama.cpp has no swap pool: --cache-ram keeps idle slots' prompts in host memory for later reuse, never "
           "a running request's KV")

#: the server adapter's ``dtype`` option -> (GGUF dtype, llama.cpp KV cache type)
DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _args(options: dict[str, str]) -> list[str]:
    return shlex.split(options.get("args", ""))


def _flag_value(args: list[str], *names: str) -> str | None:
    """The value of the last ``NAME VALUE`` or ``NAME=VALUE`` among ``args``."""
    value = None
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            value = args[i + 1]
        elif any(arg.startswith(n + "=") for n in names):
            value = arg.split("=", 1)[1]
    return value


def layout(options: dict[str, str]) -> KVLayout:
    """The layout of a server launched with ``options``: unified unless ``args`` turn it off
    (``--no-kv-unified``/``-no-kvu``, the later of it and ``--kv-unified`` winning), then per slot, split among
    ``--parallel`` slots (default :data:`AUTO_SLOTS`, which kvbench then passes: llama-server's automatic slot
    count would turn the unified cache back on)."""
    args = _args(options)
    unified = True
    for arg in args:
        if arg in ("--no-kv-unified", "-no-kvu"):
            unified = False
        elif arg in ("--kv-unified", "-kvu"):
            unified = True
    if unified:
        return UNIFIED_LAYOUT
    slots = _flag_value(args, "--parallel", "-np")
    try:
        n = int(slots) if slots is not None else AUTO_SLOTS
    except ValueError:
        raise ValueError(f"args: --parallel must be an integer, got {slots!r}") from None
    return KVLayout(only_block_size=1, preferred_block_size=1, pool_multiple=CONTEXT_PAD, slots="per_slot",
                    default_slots=n)


def compute_dtype(options: dict[str, str]) -> str:
    """The dtype the server computes in: its GGUF's (the ``dtype`` option, float32 by default)."""
    dtype = options.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"option dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def validate(options: dict[str, str]) -> None:
    """ValueError naming the option that is wrong (``dtype``, ``args``' --parallel)."""
    compute_dtype(options)
    layout(options)


@functools.lru_cache(maxsize=16)
def _gguf(model_dir: str, dtype: str) -> str:
    from kvbench.models.gguf import gguf_checkpoint

    try:
        return str(gguf_checkpoint(model_dir, dtype))
    except ValueError as e:  # a checkpoint the converter does not take: no llama.cpp run of it is possible
        raise EngineUnavailable(f"llama.cpp cannot serve {model_dir}: {e}") from None


def server_path(option: str | None) -> str:
    """llama-server's path (:func:`kvbench.launch.peers.find_llamacpp`); EngineUnavailable says how to make one."""
    from kvbench.launch.peers import PeerMissing, find_llamacpp

    try:
        return str(find_llamacpp(option).server)
    except PeerMissing as e:
        raise EngineUnavailable(str(e)) from None


def threads() -> int | None:
    """The threads llama-server computes with: ``OMP_NUM_THREADS`` where set, else torch's count in this process
    (the benchmarks pin one at quick scale), else None (llama.cpp's default: every core). A server left at every
    core spins its threads on the cores the client measuring it needs."""
    raw = os.environ.get("OMP_NUM_THREADS")
    if raw and raw.isdigit() and int(raw) > 0:
        return int(raw)
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


def launch_values(model_dir: str, options: dict[str, str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """(placeholder values, flags) for one launch: the server, the GGUF of ``model_dir`` in the ``dtype`` option's
    precision and a KV cache of the same type, the cache layout (``--kv-unified``, or ``--no-kv-unified`` with its
    slot count), and the thread count (:func:`threads`)."""
    dtype = compute_dtype(options)
    values = {"llama_server": server_path(options.get("llamacpp")), "model": _gguf(model_dir, dtype),
              "kv_type": DTYPES[dtype]}
    kv = layout(options)
    flags: list[str] = ["--kv-unified"] if kv.slots == "unified" else \
        ["--no-kv-unified", "--parallel", str(kv.default_slots)]
    n = threads()
    if n is not None:
        flags += ["--threads", str(n), "--threads-batch", str(n)]
    return values, tuple(flags)
