"""Adapter ``server``: kvbench starts an OpenAI-compatible server itself, once per distinct knob set
a check needs, and talks to it as the ``openai`` adapter does.

``--engine server:preset=reference`` (or ``transformers``, ``vllm``, ``sglang``: see
:mod:`kvbench.engines.http.presets`), or ``server:cmd=my-server --model {model} --port {port}`` for
anything else (then no knob can be set: a check needing one is skipped), or both: ``cmd`` replaces the
preset's command and keeps its knob flags. ``args=...`` appends flags (space-separated) to every launch.

For each ``generate``/``serve`` call: the knobs become flags; a knob the preset cannot set to the asked
value skips the check, naming it; a server already running with exactly that launch command (port aside)
is reused, else one is started on a free port of 127.0.0.1 and kvbench waits for ``/health``
(``startup_timeout``). Servers stay up for later calls with the same command, across checks: up to
``keep_servers`` of them (default 8; least recently used stopped first), since starting one (an HTTP
process and an engine process that imports torch) costs more than most checks' runs. Each run's requests
carry a fresh ``cache_salt`` where the server honours one (vLLM, the reference server): a prefix-caching
server then gives a run no hits from an earlier run's blocks, and is reused as a cold one. Two kinds are
not reused at all, because they carry state from one run into the next that a fresh server would not have:
a server that caches prefixes (by the knob, or by its preset's default: vLLM V1's) and takes no salt (its
cached blocks would give the next run hits it did not cause), and a server whose check failed
(:meth:`ServerAdapter.check_failed`, called by the plugin).

The reference preset (its own command, not ``cmd=``) launches with ``--allow-reconfigure``: a call whose
knobs no kept server runs first gives the most recently used server the new launch command's flags
(``POST /kvbench/reconfigure``): the server builds a new engine in its running engine process (far
quicker than a start: docs/journal/measurements.md#the-reference-servers-overhead), with counters at zero and an
empty pool and prefix cache, as a fresh server would have, and checks that the model and its server
flags stay as they are. Whatever it refuses falls back to a fresh start. A peer (vLLM...) and ``cmd=``
are always started from their own command.

``preset=vllm,fault=NAME`` launches vLLM with one function of its engine replaced, to show a check failing
on it (:mod:`kvbench.launch.vllm_faults`): the launch's environment gets the fault's start-up hook first on
``PYTHONPATH`` and the fault's name, and the installed package is left as it is.

While a call sends, kvbench's own client runs off the cores the launched server binds its engine to
(``client_cores=auto``, the default; ``off`` leaves it where the OS puts it): on a small machine the
client is front-end work beside the server, and on the engine's core it was held off the CPU by a
worker that never sleeps (:mod:`kvbench.launch.placement`). ``helper_cores=engine`` also binds the
server's unbound helper processes (vLLM's ``EngineCore`` scheduler, which spins while its worker computes)
to the engine's cores, leaving the front end its own; the default, ``free``, leaves the server's processes
where the server put them.

A peer's launch is always a fresh start (tens of seconds for vLLM on a small machine), so for a
non-reconfigurable launch the adapter makes each one serve as many runs as it honestly can
(:mod:`kvbench.plugin.launch_order` orders the tests so that the runs of one launch come together):

* Behaviour knobs the preset has a server default for (:attr:`Preset.server_defaults`: vLLM's prefix caching,
  chunked prefill and FCFS) are stated as flags on every launch, so a check asking for the default value
  explicitly and one leaving it unset run on the same server, whose state is then stated, not assumed.
* A run marked unpressured (:meth:`mark_run`, :func:`kvbench.conformance.prove.roomy_knobs`) goes to the
  running server of the same launch group (every knob but the pool's size: block count and
  ``max_model_len``) whose pool holds each of its requests, in waves that each fit that pool
  (:meth:`OpenAIAdapter.waves <kvbench.engines.http.openai.OpenAIAdapter.waves>`); where none runs, it gets
  the pool a pressured run of the same requests gets (the largest one twice), in waves, so that the run
  under pressure that follows reuses its server. A streamed run (``serve``) gets the pool it asked for:
  it is not sent in waves. Pressured runs always get exactly the pool they ask for.
* ``keep_servers`` defaults to 1 for vLLM: one server kept up beside those a later test of the plan needs (as
  many as ``ready_ahead`` allows with the starts in flight, see :meth:`_beyond_keep`); before any plan is given
  (a first run, in collection order) up to :data:`UNPLANNED_KEEP_SERVERS`, least recently used stopped first;
  each launch's key is logged
  (:meth:`take_launches`) so that the plugin can order the next run's tests by launch and stop a server no
  later test needs (:meth:`stop_servers_except`).

``close()`` (and interpreter exit, whatever the cause) stops every one with its whole process
group (:mod:`kvbench.launch.process`), all at once. Each server's log is kept (``log_dir``, default a
fresh temporary directory); its path is in the run's evidence.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import sys
import tempfile
from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbench.core.kv_budget import KVBudget, pressured, request_tokens, shared_pool
from kvbench.core.kv_budget import pool_knobs as layout_pool_knobs
from kvbench.core.tls import client_context
from kvbench.core.trace import TraceRecorder
from kvbench.engines.base import (
    DEFAULT_KNOBS,
    EngineAdapter,
    EngineUnavailable,
    GenRequest,
    GenResult,
    Knobs,
    KVLayout,
)
from kvbench.engines.http import llamacpp
from kvbench.engines.http.openai import (
    KnobsNotSettable,
    OpenAIAdapter,
    RunMarks,
    check_client_options,
    metrics_interval,
)
from kvbench.engines.http.presets import (
    CUSTOM,
    PRESETS,
    VLLM_CPU_LAYOUT,
    Preset,
    preload_names,
    vllm_cpu_settings,
    vllm_preload,
)
from kvbench.launch import background
from kvbench.launch.peers import PeerMissing, VllmInstall, find_vllm
from kvbench.launch.placement import helpers_back, helpers_onto_engine_cores, off_the_engine_cores
from kvbench.launch.process import ServerProcess, free_port, stop_servers
from kvbench.launch.vllm_faults import FAULTS as VLLM_FAULTS
from kvbench.launch.vllm_faults import check_fault, fault_environment

#: servers of other knob sets kept running for reuse, by default
DEFAULT_KEEP_SERVERS = 8
#: servers started ahead of the tests that need them at once (:meth:`ServerAdapter.prestart`). Not more in the idle
#: class: four vLLM starts side by side there made the EOS check's own start (normal class) take 110 s, not 35
DEFAULT_START_AHEAD = 2
#: servers started ahead (starting, or up and waiting for their run) at most, starts side by side included: a
#: vLLM server idles at ~2 GB and no CPU, so a few waiting keep the cores busy starting the next ones
DEFAULT_READY_AHEAD = 4
#: presets whose servers are large enough that one at a time is the default (``keep_servers``)
ONE_AT_A_TIME = frozenset({"vllm"})
#: servers such a preset keeps (``keep_servers`` left to its default) until a launch plan says which later tests
#: need which (:meth:`ServerAdapter.plan_ahead`): a first run goes in collection order, where tests alternate
#: between launches, and keeping one restarted a launch at each switch (vLLM: 27 starts for 13 launches, 12 min on
#: 2 cores; 21 and 10 min keeping 4); an idle vLLM server takes ~2 GB and no CPU
UNPLANNED_KEEP_SERVERS = 4
#: knobs that size a pool: a launch group is every other knob (:meth:`ServerAdapter.launch_group`)
POOL_SIZE_KNOBS = frozenset({"num_gpu_blocks", "max_model_len"})
#: behaviour knobs a preset may fix (:attr:`Preset.fixed`) that a launched server's client is told it runs
_FIXED_DECLARED = ("preemption_mode", "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy")
#: options that take one of a few words, the default first
_CHOICES = {"client_cores": ("auto", "off"), "helper_cores": ("free", "engine"), "background_starts": ("auto", "off")}
_PASSED_ON = ("api_key", "model", "tokenizer", "timeout", "settle_timeout", "preemptions_are", "dialect",
              "metrics_interval", "cache_salt")


@dataclass
class _Launched:
    """One server this adapter started and may reuse: the process, the client adapter speaking to it, and
    the knobs it was started with."""

    server: ServerProcess
    remote: OpenAIAdapter
    knobs: dict[str, Any]
    port: int
    reconfigured: bool = False  # running knobs given in place, not at its start
    #: the knobs the server runs with where its launch sets none (:attr:`Preset.server_defaults`)
    defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def carries_state(self) -> bool:
        """Whether a run leaves state here that changes the next run: prefix caching keeps cached blocks, by the
        knob or by the server's default (vLLM V1 caches unless told not to), unless each run's requests carry a
        fresh ``cache_salt`` the server honours, which keeps a run from hitting an earlier run's blocks."""
        caching = self.knobs.get("enable_prefix_caching", self.defaults.get("enable_prefix_caching"))
        return bool(caching) and not self.remote.takes_cache_salt()


@dataclass
class _Starting:
    """A server started ahead of the run that needs it (:meth:`ServerAdapter.prestart`), not yet claimed by one."""

    server: ServerProcess
    port: int
    wanted: dict[str, Any]
    up: bool = False  # /health answered once: it waits, idle, for its run
    idle: bool = False  # started in the idle scheduling class (kvbench.launch.background): back when claimed
    #: and it truly gives way to the normal class (:func:`kvbench.launch.background.yields`): left to run through a
    #: quiet block (:meth:`ServerAdapter.quiet`), where a start that does not give way is paused
    yields: bool = False
    probed: float = -1.0  # when /health was last asked (time.monotonic())

    def still_starting(self) -> bool:
        """Whether it is still busy starting (neither answering /health yet nor exited): what the limit on
        starts side by side counts. One probe of at most a fifth of a second, at most one a second (a pass over
        the coming launches asks again and again); once up, never probed again."""
        import time

        import httpx

        if self.up or not self.server.running():
            return False
        if time.monotonic() - self.probed < 1.0:
            return True
        self.probed = time.monotonic()
        try:
            self.up = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=0.2,
                                verify=client_context()).status_code == 200
        except httpx.HTTPError:
            return True
        return not self.up


class ServerAdapter(EngineAdapter):
    """A server kvbench launches per knob set, from a preset or a command template."""

    aborts_race_finishes = True  # an abort is a closed stream; the server may finish first

    @property
    def head_with_first_token(self) -> bool:
        """Whether the server sends a streamed response's head only with its first token (its preset says)."""
        return self.preset.head_with_first_token

    kind = "server"

    @property
    def pool_full_errors(self) -> tuple[str, ...]:  # type: ignore[override]
        """What the preset's server says when it fails a request for want of KV room."""
        return self.preset.pool_full_errors

    option_keys = {  # noqa: RUF012
        "preset": f"one of {', '.join(PRESETS)}: the command and how knobs map onto its flags",
        "cmd": "command template ({python} {model} {port} are filled in; the server must bind 127.0.0.1:{port})",
        "args": "extra flags appended to every launch, space-separated (e.g. args=--dtype float32)",
        "startup_timeout": "seconds to wait for /health (default 300)",
        "keep_servers": f"servers of other knob sets kept running for reuse (default {DEFAULT_KEEP_SERVERS}, "
                        f"{', '.join(sorted(ONE_AT_A_TIME))}: 1 once a launch plan is known, "
                        f"{UNPLANNED_KEEP_SERVERS} before; 1: only the latest one)",
        "start_ahead": f"servers started ahead of the tests that need them, by the launch plan, where every launch is "
                       f"a fresh start: how many start side by side (default {DEFAULT_START_AHEAD}; 0: each starts "
                       "when needed)",
        "ready_ahead": f"servers started ahead that may be up at once waiting for their tests, those starting included "
                       f"(default {DEFAULT_READY_AHEAD}; never fewer than start_ahead)",
        "background_starts": "auto or off: auto starts servers ahead in Linux's idle scheduling class, back in the "
                             "normal class (their session's autogroup at nice 19) until a run claims them, so a start "
                             "uses only CPU time nothing else wants, even beside a timing-sensitive block; off: in the "
                             "normal class, paused during such blocks (default auto: where kvbench may bring them "
                             "back, as root or with RLIMIT_NICE; kvbench.launch.background)",
        "log_dir": "directory for the servers' logs (default: a new temporary directory)",
        "api_key": "bearer token, if the command makes the server demand one",
        "model": "model name to put in requests (default: the first of /v1/models)",
        "tokenizer": "tokenizer.json to recover ids from text (default: the checkpoint's)",
        "timeout": "seconds one request may take (default 600)",
        "settle_timeout": "seconds to wait after a run for the server's queues to empty (default 30)",
        "metrics_interval": OpenAIAdapter.option_keys["metrics_interval"],
        "cache_salt": OpenAIAdapter.option_keys["cache_salt"],
        "preemptions_are": "recompute or swap: what vllm:num_preemptions_total counts (default: the preset's)",
        "dialect": "vllm or transformers: how requests are said (default: the preset's; vllm for cmd=)",
        "client_cores": "auto or off: while it sends, kvbench's client runs off the cores the launched server "
                        "binds its engine to, as front-end work (default auto; kvbench.launch.placement)",
        "helper_cores": "free or engine: engine binds the launched server's helper processes (those it binds "
                        "to no core but its front end: vLLM's EngineCore scheduler) to its engine's cores, so that a "
                        "helper that spins cannot take the front end's core (default free: as the server starts; "
                        "kvbench.launch.placement)",
        "vllm": "preset=vllm: a Python with vllm installed, its environment folder, or a vllm command "
                "(default: $KVBENCH_VLLM, then the environment scripts/peers.sh vllm made, then vllm on PATH)",
        "llamacpp": "preset=llamacpp: the llama-server binary or the folder scripts/peers.sh llamacpp made (default: "
                    "$KVBENCH_LLAMACPP, then the recorded build, then llama-server on PATH)",
        "dtype": "preset=llamacpp: float32 (default), float16 or bfloat16: the GGUF the checkpoint is converted to, "
                 "and the KV cache type",
        "preload": "preset=vllm: tcmalloc, iomp or tcmalloc+iomp: put in the launched vLLM's LD_PRELOAD, as vLLM's "
                   "CPU installation page asks for its best performance (found in vLLM's environment, then the "
                   "system's library folders; kvbench.engines.http.presets.vllm_preload)",
        "fault": "preset=vllm: a fault patched into the launched vLLM's engine, to show a check failing on it "
                 f"(kvbench.launch.vllm_faults), one of: {', '.join(VLLM_FAULTS)}",
    }

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        super().validate_options(options)
        preset_name, cmd = options.get("preset"), options.get("cmd")
        if not preset_name and not cmd:
            raise ValueError(f"engine {cls.kind!r}: give preset=({'|'.join(PRESETS)}) or cmd=COMMAND")
        if preset_name and preset_name not in PRESETS:
            raise ValueError(f"engine {cls.kind!r}: unknown preset {preset_name!r}; presets: {', '.join(PRESETS)}")
        if cmd and "{port}" not in cmd:
            raise ValueError(f"engine {cls.kind!r}: cmd must contain {{port}} (kvbench picks a free port)")
        check_client_options(cls.kind, options, ("startup_timeout", "timeout", "settle_timeout"))
        metrics_interval(cls.kind, options)
        keep = options.get("keep_servers", str(DEFAULT_KEEP_SERVERS))
        if not (keep.isdigit() and int(keep) >= 1):
            raise ValueError(f"engine {cls.kind!r}: option keep_servers must be an integer >= 1, got {keep!r}")
        for key, default in (("start_ahead", DEFAULT_START_AHEAD), ("ready_ahead", DEFAULT_READY_AHEAD)):
            ahead = options.get(key, str(default))
            if not ahead.isdigit():
                raise ValueError(f"engine {cls.kind!r}: option {key} must be an integer >= 0, got {ahead!r}")
        for key, choices in _CHOICES.items():
            if options.get(key, choices[0]) not in choices:
                raise ValueError(f"engine {cls.kind!r}: option {key} must be {' or '.join(choices)}, "
                                 f"got {options[key]!r}")
        for key in ("vllm", "preload"):
            if key in options and preset_name != "vllm":
                raise ValueError(f"engine {cls.kind!r}: option {key} is for preset=vllm")
        if "preload" in options:
            try:
                preload_names(options["preload"])
            except ValueError as e:
                raise ValueError(f"engine {cls.kind!r}: {e}") from None
        for key in ("llamacpp", "dtype"):
            if key in options and preset_name != "llamacpp":
                raise ValueError(f"engine {cls.kind!r}: option {key} is for preset=llamacpp")
        if preset_name == "llamacpp":
            try:
                llamacpp.validate(options)
            except ValueError as e:
                raise ValueError(f"engine {cls.kind!r}: {e}") from None
        if "fault" in options:
            if preset_name != "vllm":
                raise ValueError(f"engine {cls.kind!r}: option fault is for preset=vllm (the reference server's "
                                 "faults: kvbench.conformance.faults:FaultyServerAdapter)")
            try:
                check_fault(options["fault"])
            except ValueError as e:
                raise ValueError(f"engine {cls.kind!r}: option fault: {e}") from None

    @classmethod
    def check_available(cls, options: dict[str, str]) -> None:
        """preset=vllm without a vLLM to launch is one message saying how to make one."""
        if options.get("preset") == "vllm" and not options.get("cmd"):
            try:
                find_vllm(options.get("vllm"))
            except PeerMissing as e:
                raise EngineUnavailable(str(e)) from None
        if options.get("preset") == "llamacpp" and not options.get("cmd"):
            llamacpp.server_path(options.get("llamacpp"))  # EngineUnavailable saying how to make one

    @classmethod
    def kv_layout_for(cls, options: dict[str, str]) -> KVLayout:
        preset = PRESETS.get(options.get("preset", ""), CUSTOM)
        if preset.name == "vllm" and not options.get("cmd"):
            try:
                if find_vllm(options.get("vllm")).cpu_build:
                    return VLLM_CPU_LAYOUT
            except PeerMissing:
                pass  # check_available says so
        return preset.layout_for(options)

    def __init__(self, model_dir: str, options: dict[str, str] | None = None, name: str | None = None):
        super().__init__(model_dir, options, name)
        self.validate_options(self.options)
        preset_name, cmd = self.options.get("preset"), self.options.get("cmd")
        self.preset: Preset = PRESETS[preset_name] if preset_name else CUSTOM
        self.command = tuple(shlex.split(cmd)) if cmd else None
        self.extra = shlex.split(self.options.get("args", ""))
        # on top of _server_env(), taken at each launch; None unsets a variable (the server's own default)
        self.env_overrides: dict[str, str | None] = {}
        self.vllm: VllmInstall | None = None
        self.kv_layout = self.preset.layout_for(self.options)
        if self.preset.name == "vllm" and not cmd:
            self._locate_vllm()
        #: the fault patched into a launched vLLM (option fault), None for an engine as shipped
        self.vllm_fault: str | None = self.options.get("fault") if self.preset.name == "vllm" else None
        if self.vllm_fault:
            # the hook's folder goes ahead of any PYTHONPATH the server would have had; in the launch key too,
            # so a faulted server is never reused for a plain run
            self.env_overrides.update(fault_environment(self.vllm_fault, {**_server_env(), **self.env_overrides}))
        self.capabilities = self.preset.capabilities
        self.lacking = dict(self.preset.lacking)
        self.unsupported_knobs = dict(self.preset.unsupported) if preset_name else {
            k: "cmd= without a preset: kvbench does not know the server's flags" for k in Knobs().__dataclass_fields__}
        self.startup_timeout = float(self.options.get("startup_timeout", 300))
        self.log_dir = Path(self.options.get("log_dir") or tempfile.mkdtemp(prefix="kvbench-servers-"))
        self.logs: list[str] = []
        default_keep = 1 if self.preset.name in ONE_AT_A_TIME else DEFAULT_KEEP_SERVERS
        self.keep_servers = int(self.options.get("keep_servers", default_keep))
        #: kept until a plan is given (:data:`UNPLANNED_KEEP_SERVERS`), where keep_servers is the one-at-a-time default
        self._unplanned_keep = max(self.keep_servers, UNPLANNED_KEEP_SERVERS) \
            if "keep_servers" not in self.options and self.preset.name in ONE_AT_A_TIME else self.keep_servers
        self._planned = False  # whether a launch plan was given (plan_ahead)
        #: starts ahead go in the idle scheduling class (:mod:`kvbench.launch.background`)
        self.background = self.options.get("background_starts", "auto") == "auto" and background.available()
        self.start_ahead = int(self.options.get("start_ahead", DEFAULT_START_AHEAD))
        self.ready_ahead = max(self.start_ahead, int(self.options.get("ready_ahead", DEFAULT_READY_AHEAD)))
        #: the launches later runs need, in the order they need them (:meth:`plan_ahead`): started ahead as room allows
        self._coming: list[Knobs] = []
        #: the adapter this one was made beside (the same engine on another checkpoint, for one check:
        #: :mod:`kvbench.conformance.on_checkpoint`): while this one serves, that one's starts ahead go on
        self.beside: ServerAdapter | None = None
        #: the launch keys later tests need, as the plan last said (:meth:`plan_ahead`), served ones included
        self._needed_later: set[tuple[str, ...]] = set()
        self._marks = RunMarks()
        self._launch_log: list[tuple[str, ...]] = []  # launch keys served from, since take_launches()
        self._last_run: tuple[Knobs, OpenAIAdapter] | None = None  # (knobs asked, the server's client) of generate
        #: launch command (port left out) -> the running server started with it, least recently used first
        self._launched: OrderedDict[tuple[str, ...], _Launched] = OrderedDict()
        #: launch command -> a server started ahead of the run that will need it (:meth:`prestart`), not yet healthy
        self._starting: dict[tuple[str, ...], _Starting] = {}
        self._held = False  # a timing-sensitive run serves (:meth:`quiet`)
        self._paused: list[ServerProcess] = []  # starts ahead paused for the quiet block (:meth:`quiet`)
        self._quiet_helpers: dict[int, set[int]] = {}  # helpers bound beside the engine for a quiet block
        #: launch command -> the knobs it was launched with (what :meth:`prestart` is later given back for it)
        self.launch_knobs_of: dict[tuple[str, ...], Knobs] = {}
        self._server: ServerProcess | None = None  # the latest one started or reused
        self.reconfigures = 0  # knob sets given to a running server in place of a new one
        #: why the latest reconfigures were refused (a fresh start followed each)
        self.reconfigure_refusals: deque[str] = deque(maxlen=20)

    def _locate_vllm(self) -> None:
        """The vLLM to launch, how to launch it, and what its platform's build accepts."""
        try:
            self.vllm = find_vllm(self.options.get("vllm"))
        except PeerMissing as e:
            raise EngineUnavailable(str(e)) from None
        self.command = (*self.vllm.launcher, *self.preset.command[1:])
        if self.vllm.cpu_build:
            self.kv_layout = VLLM_CPU_LAYOUT
            flags, env = vllm_cpu_settings(dict(os.environ))
            self.extra = [*flags, *self.extra]  # the user's args= come later and win
            self.env_overrides.update(env)
        if "preload" in self.options:  # in the launch key too: a preloaded server is never reused for a plain run
            try:
                libs = vllm_preload(self.options["preload"], str(Path(self.vllm.launcher[0]).parent.parent))
            except ValueError as e:
                raise EngineUnavailable(f"engine {self.kind!r}: {e}") from None
            self.env_overrides["LD_PRELOAD"] = ":".join(x for x in (libs, os.environ.get("LD_PRELOAD")) if x)

    def pool_knobs(self, budget: KVBudget, block_size: int | None = None) -> Knobs:
        """As any engine's, except that where every launch is a fresh start a pressured budget that allows it
        (:attr:`KVBudget.roundable`) gets a pool other checks' budgets round to as well
        (:func:`kvbench.core.kv_budget.shared_pool`): the checks then share launches."""
        if not self.reconfigurable:
            budget = shared_pool(budget, self.kv_layout, block_size, max_len=self._model_positions())
        return super().pool_knobs(budget, block_size)

    def _model_positions(self) -> int | None:
        """The checkpoint's ``max_position_embeddings`` (a longer ``max_model_len`` is refused), None if unknown;
        read once (every pool sizing and unpressured run asks)."""
        if not hasattr(self, "_positions"):
            try:
                config = json.loads((Path(self.model_dir) / "config.json").read_text())
                self._positions: int | None = int(config["max_position_embeddings"])
            except (OSError, ValueError, KeyError, TypeError):
                self._positions = None
        return self._positions

    def family(self) -> str:
        return self.preset.name if self.preset is not CUSTOM else self.kind

    def compute_dtype(self) -> str | None:
        """The server's ``--dtype`` flag as its launch command gives it (the last one wins, as ``args=`` comes
        after the preset's), else the preset's own default where it has one (the reference server computes in
        float32), or None: the server's default is unknown here, or ``auto``."""
        if self.preset.dtype_of is not None:  # the preset knows what its server loads (llama.cpp: the GGUF's dtype)
            return self.preset.dtype_of(self.options)
        return dtype_of_flags([*(self.command or self.preset.command), *self.extra]) or \
            (self.preset.default_dtype if self.command is None else None)

    def engine_version(self, package: str) -> str | None:
        if self.vllm is not None and package in ("vllm", "vllm-cpu"):
            return self.vllm.version
        if self.preset.name == "llamacpp" and package == "llama.cpp" and not self.command:
            from kvbench.launch.peers import PeerMissing, find_llamacpp

            try:  # llama-server's own version line (what peers.sh recorded, else --version)
                return find_llamacpp(self.options.get("llamacpp")).version
            except PeerMissing:
                return None
        if self.preset.name == "llamacpp" and package == "llama-cpp-python" and not self.command:
            # the llama-server launched was built from this source distribution (scripts/peers.sh records it);
            # a llama-server found elsewhere has no package version: None, and a pinned range does not hold
            from kvbench.launch.peers import PeerMissing, find_llamacpp

            try:
                built_from = find_llamacpp(self.options.get("llamacpp")).built_from
            except PeerMissing:
                return None
            return built_from[1] if built_from and built_from[0] == package else None
        return super().engine_version(package)

    def describe(self) -> dict[str, Any]:
        described = {**super().describe(), "preset": self.preset.name, "server_logs": list(self.logs)}
        if self.vllm is not None:
            described["vllm"] = {"version": self.vllm.version, "cpu_build": self.vllm.cpu_build,
                                 "found": self.vllm.source}
        if self.vllm_fault:
            described["fault"] = {"name": self.vllm_fault, "breaks": VLLM_FAULTS[self.vllm_fault].breaks}
        return described

    def argv(self, knobs: Knobs, port: int | str) -> list[str]:
        """The launch command for ``knobs`` (``port`` may be a placeholder); :class:`KnobsNotSettable` names any
        knob the preset cannot set."""
        try:
            return self.preset.argv(self.model_dir, port, knobs.as_dict(), self.extra, self.command, self.options)
        except ValueError as e:
            raise KnobsNotSettable(f"{self.name} cannot set knobs: {e}") from None

    def launch_key(self, knobs: Knobs) -> tuple[str, ...]:
        """What makes two launches the same server: the command line with the port left out, and the
        environment kvbench adds (the knobs as :meth:`launch_knobs` states them)."""
        knobs = self.launch_knobs(knobs)
        return (*self.argv(knobs, "{port}"), *(f"{k}={v}" for k, v in sorted(self.env_overrides.items())))

    def launch_knobs(self, knobs: Knobs) -> Knobs:
        """``knobs`` as a launch states them: where every launch is a fresh start (not :attr:`reconfigurable`),
        each behaviour knob the preset maps and has a server default for (:attr:`Preset.server_defaults`) is
        stated at that default when ``knobs`` leave it unset. The server does the same either way; stated, a
        check that asks for the default and one that leaves it unset share a launch, and the launched server's
        state is what its flags say."""
        if self.reconfigurable:
            return knobs
        unset = {name: value for name, value in self.preset.server_defaults.items()
                 if name in self.preset.rules and getattr(knobs, name, None) is None}
        return knobs.merged(Knobs(**unset)) if unset else knobs

    def launch_group(self, knobs: Knobs) -> frozenset[tuple[str, Any]]:
        """What must match for a launch to serve another's unpressured run: every knob as
        :meth:`launch_knobs` states it except the pool's size (:data:`POOL_SIZE_KNOBS`). Behaviour knobs
        (prefix caching, chunked prefill, the scheduling policy) and the other sizes (block size, sequences,
        token budget) are in it, so a run never lands on a server that behaves otherwise than it asked. A knob the
        preset fixes (:attr:`Preset.fixed`: vLLM always preempts by recompute) is stated at its fixed value where
        ``knobs`` leave it unset: a run that asks for it and one that does not land on the same server, which
        runs it either way (the launch key, its command line, is the same)."""
        knobs = self.launch_knobs(knobs)
        unset = {name: value for name, value in self.preset.fixed.items() if getattr(knobs, name, None) is None}
        stated = knobs.merged(Knobs(**unset)).as_dict() if unset else knobs.as_dict()
        return frozenset((k, v) for k, v in stated.items() if k not in POOL_SIZE_KNOBS)

    @classmethod
    def starts_fresh(cls, options: dict[str, str]) -> bool:
        """Whether every launch of an engine given ``options`` is a fresh start (what :attr:`reconfigurable`
        says of an adapter, known before it is made): the plugin orders such an engine's tests by launch."""
        if not options.get("preset") and not options.get("cmd"):
            return False  # an adapter class that fills in its own preset: not known here, its tests keep their order
        preset = PRESETS.get(options.get("preset", ""), CUSTOM)
        return preset.reconfigure_path is None or bool(options.get("cmd"))

    @property
    def reconfigurable(self) -> bool:
        """Whether a kept server can take another knob set in place (the reference preset's own command; never
        ``cmd=``, whose server kvbench knows nothing of, nor a peer such as vLLM, always started as its users
        start it)."""
        return self.preset.reconfigure_path is not None and self.command is None

    def server_for(self, knobs: Knobs) -> OpenAIAdapter:
        """A healthy server running exactly ``knobs``: one already running with the same launch command, else
        a kept one given ``knobs`` in place (:meth:`_reconfigure`), else a new one (see the module docstring
        for which are kept)."""
        knobs = self.launch_knobs(knobs)
        key = self.launch_key(knobs)
        self._log_launch(key)
        # served now: not to be started ahead again for this test's sake (the plan's next list says whether a
        # later test needs it once more)
        self._coming = [k for k in self._coming if self._key_or_none(k) != key]
        self._start_coming()
        if self.beside is not None:  # the plan's starts are the session adapter's: nothing else asks it meanwhile
            self.beside.start_coming()
        launched = self._launched.get(key)
        # a warm server (prefix caching without a salt to keep runs apart) is never reused as if it were cold
        if launched is not None and launched.server.running() and not launched.carries_state:
            self._launched.move_to_end(key)
            self._server = launched.server
            return launched.remote
        if self.reconfigurable:
            self._stop([k for k, v in self._launched.items() if not v.server.running()])
            if self._launched:  # the most recently used one; if it refuses (knobs the engine refuses, say), a
                # fresh start follows and says why, as it would without reconfigure
                remote = self._reconfigure(next(reversed(self._launched)), key, knobs)
                if remote is not None:
                    return remote
        # what is not reused for another knob set goes now; a dead server of this key goes too; and room is made
        # before the start, so that no more than keep_servers run even while the new one starts
        self._stop([k for k, v in self._launched.items() if k == key or v.carries_state])
        self._stop(self._beyond_keep(self.kept - 1))
        starting = self._starting.pop(key, None) or self._start(key, knobs)
        server, port = starting.server, starting.port
        self._server = server
        server.resume()  # claimed in a quiet block, which pauses the starts in flight (:meth:`quiet`)
        if starting.idle and server.pgid is not None:  # claimed: a run waits for it now
            background.to_normal(server.pgid)
        self._start_coming()  # this one claimed: room for the next start, which overlaps the wait below
        server.wait_healthy(f"http://127.0.0.1:{port}", self.startup_timeout)
        if starting.idle and server.pgid is not None:  # any thread made while the group was being moved
            background.to_normal(server.pgid)
        remote = self._remote(port, starting.wanted)
        self._launched[key] = _Launched(server, remote, starting.wanted, port,
                                        defaults=dict(self.preset.server_defaults))
        self._stop(self._beyond_keep(self.kept))
        return remote

    def _start(self, key: tuple[str, ...], knobs: Knobs, ahead: bool = False) -> _Starting:
        """Start the server of launch ``key`` for ``knobs`` (as :meth:`launch_knobs` states them), not waiting;
        ``ahead`` of the run that needs it: in the idle scheduling class where :attr:`background` allows."""
        port = free_port()
        argv = self.argv(knobs, port)
        log = self.log_dir / f"{self.preset.name}-{len(self.logs) + 1:03d}-port{port}.log"
        env = {**_server_env(), **self.env_overrides}
        server = ServerProcess(argv, log, env={k: v for k, v in env.items() if v is not None})
        self.logs.append(str(log))
        server.start()
        idle = ahead and self.background and server.proc is not None and background.to_idle(server.proc.pid)
        yields = idle and server.proc is not None and background.yields(server.proc.pid)
        self.launch_knobs_of[key] = knobs
        starting = _Starting(server, port, knobs.as_dict(), idle=idle, yields=yields)
        # started ahead in a quiet block, and it would take CPU from it: paused until the block's end
        if ahead and self._held and not yields and server.pause():
            self._paused.append(server)
        return starting

    def prestart(self, knobs: Knobs) -> bool:
        """Start the server a coming run of ``knobs`` will need, without waiting for it, while the current one
        serves: a start is mostly the new processes' imports, on a core the running server leaves idle between
        its runs. Only where every launch is a fresh start (:attr:`reconfigurable` is false) and nothing of that
        launch is running or starting; at most ``start_ahead`` servers busy starting at once (option, default 2:
        a start is mostly imports, one process after another, so two side by side keep two cores busy), and at
        most ``ready_ahead`` started ahead in all, up and waiting included (a waiting server takes memory, no
        CPU). The run that needs it waits for it as for any start (a server that fails to start fails that run,
        with its log, as it would have then). Returns whether one was started."""
        if self.reconfigurable or len(self._starting) >= self.ready_ahead:
            return False
        if sum(s.still_starting() for s in self._starting.values()) >= self.start_ahead:
            return False
        knobs = self.launch_knobs(knobs)
        key = self.launch_key(knobs)
        if key in self.live_launches():
            return False
        self._starting[key] = self._start(key, knobs, ahead=True)
        return True

    def plan_ahead(self, coming: Sequence[Knobs]) -> None:
        """The launches later runs will need, in the order they need them (the launch plan's, given by
        :mod:`kvbench.plugin.launch_order`): each is started ahead (:meth:`prestart`) as room allows, now and
        whenever a run asks for a server, so a start that finishes during a long check lets the next one begin."""
        self._planned = True
        self._coming = list(coming)
        self._needed_later = {key for key in map(self._key_or_none, coming) if key is not None}
        self._start_coming()

    def _key_or_none(self, knobs: Knobs) -> tuple[str, ...] | None:
        try:
            return self.launch_key(knobs)
        except (ValueError, TypeError):
            return None  # knobs no launch takes (a check of a refusal): started when asked for, as asked

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """A run whose reading depends on timing (streams read for stalls, closes placed while requests wait) gets
        the machine's cores to itself and its server, not shared with a vLLM start of tens of CPU-seconds. Seen on
        2 cores: a victim check's streams came in bursts of 16-59 tokens a chunk in every try while later launches
        started at normal priority. A start that truly gives way (``_Starting.yields``: the idle class, its session's
        autogroup reniced, :mod:`kvbench.launch.background`) takes only what the block leaves idle, and goes on
        through it, as do the starts ahead begun meanwhile. One that does not (``background_starts=off``, no
        privilege, a renice refused) is paused for the block (SIGSTOP to its group, :meth:`ServerProcess.pause`)
        and goes on where it was after it; a run in the block that claims a paused one resumes it. (Before the
        autogroup renice, idle-class starts still took an equal share beside the block: three of them broke a
        victim check's streams into 2.8-5.8 tokens a chunk.)

        And for the block the served server's unbound helpers run beside its engine, as ``helper_cores=engine``
        puts them (:func:`kvbench.launch.placement.helpers_onto_engine_cores`), and are unbound again on exit:
        vLLM's scheduler spins while its worker computes, and on the front end's core it held the front end off
        the CPU, so that five staggered streams came out one after another in whole bursts (a victim check saw
        its streams never overlap in three tries). Where a helper runs changes when tokens reach the client,
        never which tokens or which request the scheduler preempts."""
        self._held = True
        self._paused = [s.server for s in self._starting.values()
                        if not s.yields and s.still_starting() and s.server.pause()]
        try:
            yield
        finally:
            self._held = False
            for server in self._paused:
                server.resume()
            self._paused = []
            helpers_back(self._quiet_helpers)
            self._quiet_helpers = {}
            self._start_coming()  # what was held back starts now, not at the next run's ask

    def start_coming(self) -> None:
        """Start ahead what the plan's coming launches need as room allows (:meth:`prestart`): called whenever a
        run asks for a server, here or on an adapter made beside this one (:attr:`beside`), so a start that
        finished during a long check lets the next one begin."""
        self._start_coming()

    def _start_coming(self) -> None:
        if not self._coming or self.reconfigurable or (self._held and not self.background):
            return  # in a quiet block a start ahead begins only where it can give way (see quiet)
        live = self.live_launches()
        for knobs in self._coming:
            key = self._key_or_none(knobs)
            if key is None or key in live:
                continue
            if not self.prestart(knobs):
                return

    # --- launches serving more than one run (every launch a fresh start)

    def _log_launch(self, key: tuple[str, ...]) -> None:
        if not self._launch_log or self._launch_log[-1] != key:
            self._launch_log.append(key)

    def take_launches(self) -> list[tuple[str, ...]]:
        """The launch keys (:meth:`launch_key`) runs were served from since the last call, in order, a key
        repeated only where another came between: what :mod:`kvbench.plugin.launch_order` records per test."""
        taken, self._launch_log = self._launch_log, []
        return taken

    def live_launches(self) -> set[tuple[str, ...]]:
        """The launch keys of the servers running (healthy, reusable) or starting ahead."""
        running = {k for k, v in self._launched.items() if v.server.running() and not v.carries_state}
        return running | set(self._starting)

    @property
    def kept(self) -> int:
        """How many running servers are kept for reuse now: ``keep_servers``, or before any launch plan is given
        where the preset's default is one at a time, :data:`UNPLANNED_KEEP_SERVERS`."""
        return self.keep_servers if self._planned else self._unplanned_keep

    def _beyond_keep(self, keep: int) -> list[tuple[str, ...]]:
        """The running servers to stop so that ``keep`` stay, least recently used first, except those a later test
        of the plan needs (:meth:`plan_ahead`): such a server is kept as one started ahead would be, within
        ``ready_ahead`` with the starts in flight, and stopped once no later test needs it
        (:meth:`stop_servers_except`). Without it, two tests alternating between two launches (checks 3 and 3b:
        caching off, then on, each) started each launch again for the second test."""
        order = list(self._launched)
        excess = order[:max(0, len(order) - keep)]
        needed = self._needed_later
        room = self.ready_ahead - len(self._starting)
        stop = []
        for key in excess:
            if key in needed and room > 0 and self._launched[key].server.running():
                room -= 1
                continue
            stop.append(key)
        return stop

    def stop_servers_except(self, keep: Collection[tuple[str, ...]]) -> None:
        """Stop every running or starting server whose launch key is not in ``keep`` (no later test needs it)."""
        self._stop([k for k in self._launched if k not in keep])
        stop_servers([self._starting.pop(k).server for k in [k for k in self._starting if k not in keep]])

    def mark_run(self, requests: Sequence[GenRequest], *, unpressured: bool) -> None:
        """Say whether the next run of ``requests`` is to be unpressured (see the module docstring: where every
        launch is a fresh start, such a run may be served in waves by a server with a smaller pool).
        :func:`~kvbench.conformance.prove.roomy_knobs` marks a run so, ``pressured_knobs`` the other way."""
        self._marks.mark(requests, unpressured)

    def _is_unpressured(self, requests: Sequence[GenRequest]) -> bool:
        return self._marks.unpressured(requests)

    def _server_for_run(self, knobs: Knobs, requests: Sequence[GenRequest]) -> tuple[OpenAIAdapter, Knobs]:
        """The server for a ``generate`` run of ``requests`` and the knobs to tell it: :meth:`server_for`
        ``knobs``, except for an unpressured run where every launch is a fresh start: the running server of
        the same :meth:`launch_group` whose pool holds each request, else a server with the pool a pressured
        run of these requests gets (:meth:`_wave_pool`); either way in waves that each fit its pool."""
        if self.reconfigurable or not requests:
            return self.server_for(knobs), knobs
        knobs = self._cap_not_reached(knobs, requests)
        # a launch the server is to refuse (a pool of -1 blocks) is served by nothing else: a check of that refusal
        # needs the server to see it exactly as asked (a first run, in collection order, rode such a run on a running
        # server of the same group, and the check saw no error)
        if not self._is_unpressured(requests) or not _plausible(knobs, self.kv_layout):
            remote = self.server_for(knobs)
            # a server keeps the marks of the runs it served: the same requests under pressure go all at once
            remote.mark_run(requests, unpressured=False)
            return remote, knobs
        # a request longer than the model's positions can never be served: it is sent to be refused, and no pool
        # is sized for it (else a check of that refusal would need a launch of its own)
        positions = self._model_positions()
        needs = [request_tokens(len(r.prompt_token_ids), r.max_tokens) for r in requests
                 if positions is None or len(r.prompt_token_ids) < positions] or [1]
        group = self.launch_group(knobs)
        for key in reversed(self._launched):  # the most recently used first
            launched = self._launched[key]
            ran = Knobs(**launched.knobs)
            if launched.server.running() and not launched.carries_state and self.launch_group(ran) == group \
                    and self._holds_each(ran, needs):
                self._log_launch(key)
                self._launched.move_to_end(key)
                self._server = launched.server
                launched.remote.mark_run(requests, unpressured=True)
                return launched.remote, ran
        smaller = self._wave_pool(knobs, needs)
        remote = self.server_for(smaller)
        remote.mark_run(requests, unpressured=True)
        return remote, self.launch_knobs(smaller)

    def _cap_not_reached(self, knobs: Knobs, requests: Sequence[GenRequest]) -> Knobs:
        """``knobs`` without ``max_num_seqs`` where it cannot bind: a ``generate`` run of n requests asking for a
        cap of n or more, on a server whose cap only limits how many run at once and whose default is n or more
        (:attr:`Preset.default_max_num_seqs`), runs every request at once either way, so the run goes to the
        launch that leaves the cap at its default, and checks that differ only there share one server."""
        cap = self.preset.default_max_num_seqs
        asked = knobs.max_num_seqs
        if cap is None or asked is None or not len(requests) <= min(asked, cap):
            return knobs
        flag = self.preset.flags({"max_num_seqs": asked})[0][:1]
        if flag and any(arg.split("=", 1)[0] == flag[0] for arg in (*(self.command or ()), *self.extra)):
            return knobs  # cmd= or args= sets a cap of its own: the default is not what the server would run
        return replace(knobs, max_num_seqs=None)

    def _holds_each(self, knobs: Knobs, needs: Sequence[int]) -> bool:
        """Whether a server launched with ``knobs`` takes each of these requests alone: its pool holds the
        largest (less the block a pool that must hold max_model_len keeps back: vLLM's null block) and its
        max_model_len, where set, is not below it."""
        if knobs.num_gpu_blocks is None or not needs:
            return False  # the server's own pool: its size is not known here
        block = knobs.block_size or self.kv_layout.block_size()
        largest = max(needs)
        usable = knobs.num_gpu_blocks - (1 if self.kv_layout.pool_holds_max_model_len else 0)
        return math.ceil(largest / block) <= usable and (knobs.max_model_len is None or knobs.max_model_len >= largest)

    def _wave_pool(self, knobs: Knobs, needs: Sequence[int]) -> Knobs:
        """``knobs`` with the pool a pressured run of requests of these ``needs`` gets (the largest twice,
        :func:`kvbench.core.kv_budget.pressured`, rounded as :meth:`pool_knobs` rounds it, so that the unpressured
        and the pressured run of one check share a launch) where that is smaller than the pool asked for.
        ``max_model_len`` stays as asked where the check chose it; where it is only the largest request's own
        (what :func:`~kvbench.core.kv_budget.pool_knobs` derives), it becomes the rounded pool's."""
        if knobs.num_gpu_blocks is None or not _plausible(knobs, self.kv_layout) or not needs:
            return knobs  # a launch the server is to refuse is one a check of its refusal needs exactly as asked
        budget = replace(pressured(needs), roundable=True)
        pool = self.pool_knobs(budget, knobs.block_size)
        if pool.num_gpu_blocks is None or pool.num_gpu_blocks >= knobs.num_gpu_blocks:
            return knobs
        smaller = Knobs(num_gpu_blocks=pool.num_gpu_blocks)
        derived = layout_pool_knobs(replace(budget, roundable=False), self.kv_layout, knobs.block_size).max_model_len
        if pool.max_model_len is not None and knobs.max_model_len == derived:
            smaller = smaller.merged(Knobs(max_model_len=pool.max_model_len))
        elif knobs.max_model_len is not None and self.kv_layout.pool_holds_max_model_len:
            # the check's own max_model_len stays: the pool must hold it (and the null block a vLLM keeps back),
            # or the server refuses to start (some of a check's requests, sent alone, need less than it allows)
            block = knobs.block_size or self.kv_layout.block_size()
            holds = math.ceil(knobs.max_model_len / block) + 1
            if holds >= knobs.num_gpu_blocks:
                return knobs
            smaller = Knobs(num_gpu_blocks=max(pool.num_gpu_blocks, holds))
        return knobs.merged(smaller)

    def _remote(self, port: int, wanted: dict[str, Any]) -> OpenAIAdapter:
        """The client adapter for the server on ``port`` running the knobs ``wanted``."""
        options = {k: v for k, v in self.options.items() if k in _PASSED_ON}
        if self.preset.preemptions_are and "preemptions_are" not in options:
            options["preemptions_are"] = self.preset.preemptions_are
        options.setdefault("dialect", self.preset.dialect)
        # what it was started with is declared, so a knob the server does not publish still counts as set;
        # a published label that disagrees (the server adjusted the value) wins and skips the check
        options.update({k: str(v) for k, v in wanted.items()})
        # and what the preset's server always does (vLLM: recompute), where the launch says nothing of it: one launch
        # serves knob sets that differ only there (the flags are the same), so each must find it declared
        options.update({k: str(v) for k, v in self.preset.fixed.items() if k in _FIXED_DECLARED and k not in wanted})
        options["url"] = f"http://127.0.0.1:{port}"
        remote = OpenAIAdapter(self.model_dir, options, name=self.name)
        remote.configure_run(liveness=self.liveness)  # the session's limits: the HTTP watchdog runs under them
        return remote

    def _reconfigure(self, old_key: tuple[str, ...], key: tuple[str, ...], knobs: Knobs) -> OpenAIAdapter | None:
        """Give the kept server of ``old_key`` the knobs ``knobs`` in place: the server builds a new engine in
        its engine process (counters and /metrics at zero, an empty pool and prefix cache: what a fresh server
        would hold) and the server is kept under ``key``. None when the server refuses (it checks that its
        model and server flags stay as they are, and the engine that it can build the new one; it keeps its
        old engine then) or does not answer."""
        import httpx

        launched = self._launched[old_key]
        argv = self.argv(knobs, launched.port)
        url = f"http://127.0.0.1:{launched.port}{self.preset.reconfigure_path}"
        headers = {"Authorization": f"Bearer {self.options['api_key']}"} if self.options.get("api_key") else {}
        try:
            answer = httpx.post(url, json={"args": self.preset.server_args(argv)}, headers=headers,
                                timeout=self.startup_timeout, verify=client_context())
        except httpx.HTTPError as e:
            self.reconfigure_refusals.append(f"{url}: {type(e).__name__}: {e}")
            return None
        if answer.status_code != 200:
            self.reconfigure_refusals.append(f"{url}: {answer.status_code} {answer.text[:300]}")
            return None
        wanted = knobs.as_dict()
        del self._launched[old_key]
        launched.remote, launched.knobs = self._remote(launched.port, wanted), wanted
        launched.reconfigured = True
        self._launched[key] = launched
        self._server = launched.server
        self.reconfigures += 1
        return launched.remote

    def running_launch(self, knobs: Knobs) -> tuple[list[str], OpenAIAdapter] | None:
        """The launch command (with its port) and the client of the running server kept for ``knobs`` (as
        :meth:`server_for` finds it), or None where none runs: the server that just served a run of ``knobs``.
        Unlike :meth:`server_for` it starts, stops and reconfigures nothing, so reading what served a run never
        launches another server (a prefix-caching one without a salt is never reused: asking it anew would)."""
        launched = self._launched.get(self.launch_key(self.launch_knobs(self.knobs_for(knobs))))
        if launched is None or not launched.server.running():
            return None
        return self.argv(Knobs(**launched.knobs), launched.port), launched.remote

    @property
    def process(self) -> ServerProcess | None:
        """The server used last (its process group, for whoever inspects it), None before any."""
        return self._server

    def running_servers(self) -> list[ServerProcess]:
        """The servers kept running for reuse, least recently used first."""
        return [launched.server for launched in self._launched.values()]

    def _stop(self, keys: list[tuple[str, ...]]) -> None:
        stop_servers([self._launched.pop(k).server for k in keys])

    def stop_server(self) -> None:
        """Stop every server this adapter runs or is starting (each with its process group, all at once)."""
        starting = [s.server for s in self._starting.values()]
        self._starting.clear()
        stop_servers([v.server for v in self._launched.values()] + starting)
        self._launched.clear()

    def check_failed(self) -> None:
        """A check failed on this engine: its servers may hold what the failure left (requests, blocks), so
        none of them serves another check (one still starting served nothing: it is kept)."""
        self._stop(list(self._launched))

    def confirmed_settings(self, knobs: Knobs = DEFAULT_KNOBS) -> dict[str, Any]:
        """What the server that ran the latest ``generate`` with ``knobs`` says it runs with (it may be a server of
        a smaller pool, for an unpressured run), else the server :meth:`server_for` gives ``knobs``."""
        asked = self.knobs_for(knobs)
        if self._last_run is not None and self._last_run[0] == asked and self._server is not None \
                and self._server.running():
            return self._last_run[1].confirmed_settings(knobs)
        return super().confirmed_settings(knobs)

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        asked = knobs
        remote, knobs = self._server_for_run(knobs, requests)
        self._last_run = (asked, remote)
        server = self._server
        assert server is not None
        with self._client_placed(server):
            result = remote.generate(requests, knobs)
        result.evidence.append(f"server log: {server.log_path}")
        if asked.max_num_seqs is not None and knobs.max_num_seqs is None:
            result.evidence.append(f"max_num_seqs={asked.max_num_seqs} cannot bind a run of {len(requests)} requests: "
                                   "served by a server left at its default cap "
                                   f"({self.preset.default_max_num_seqs} or more)")
        if self._is_unpressured(requests) and self.launch_knobs(knobs) != self.launch_knobs(asked):
            result.evidence.append(f"an unpressured run, served by a server launched with {knobs.as_dict()} (asked: "
                                   f"{asked.as_dict()}), its requests in waves that each fit that pool")
        if self.vllm_fault:
            result.evidence.append(f"the server runs with fault {self.vllm_fault} patched into its engine: "
                                   f"{VLLM_FAULTS[self.vllm_fault].breaks}")
        if self._launched and self._launched[next(reversed(self._launched))].reconfigured:
            result.evidence.append("the server was given these knobs in place (POST "
                                   f"{self.preset.reconfigure_path}): a new engine in its running engine process")
        if not server.running():
            result.evidence.append(f"the server died during the run; log tail:\n{server.log_tail(10)}")
        return result

    def serve(self, workload: Any, recorder: TraceRecorder, knobs: Knobs = DEFAULT_KNOBS, progress=None) -> None:
        remote = self.server_for(knobs)
        assert self._server is not None
        with self._client_placed(self._server):
            remote.serve(workload, recorder, knobs, progress=progress)

    def _client_placed(self, server: ServerProcess) -> contextlib.AbstractContextManager:
        """This process off the server's engine cores for a run (option ``client_cores``), the server's
        helpers on them first (option ``helper_cores``)."""
        if self.options.get("helper_cores", "free") == "engine":
            helpers_onto_engine_cores(server.pgid)
        elif self._held:  # a timing-sensitive run: beside the engine for the quiet block only (see quiet)
            self._quiet_helpers.update(helpers_onto_engine_cores(server.pgid))
        if self.options.get("client_cores", "auto") == "off":
            return contextlib.nullcontext()
        return off_the_engine_cores(server.pgid)

    def close(self) -> None:
        self.stop_server()


def _plausible(knobs: Knobs, layout: KVLayout) -> bool:
    """Whether ``knobs`` could launch a server as far as kvbench can tell: a block size the layout takes, a pool of
    at least one block, at least one sequence. Only such a launch is given a smaller pool for an unpressured run;
    any other is left exactly as asked (a check of the server's own refusal needs the server to see it so)."""
    return (knobs.block_size is None or layout.takes_block_size(knobs.block_size)) \
        and (knobs.num_gpu_blocks is None or knobs.num_gpu_blocks >= 1) \
        and (knobs.max_num_seqs is None or knobs.max_num_seqs >= 1)


def _server_env() -> dict[str, str]:
    """The launched server's environment: ours, with torch's thread count as this process has it (the
    benchmarks pin one thread at quick scale on CPU). A server left at torch's default spins a thread
    per core and takes the cores from the client measuring it. An ``OMP_NUM_THREADS`` already set wins."""
    env = dict(os.environ)
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    return env


#: spellings of ``--dtype`` values (vLLM's and the reference server's) -> the dtype computed in
_DTYPE_SPELLINGS = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16",
                    "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16"}


def dtype_of_flags(argv: Sequence[str]) -> str | None:
    """The dtype a ``--dtype X`` or ``--dtype=X`` flag in ``argv`` names (the last one), or None (no flag, auto)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--dtype" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--dtype="):
            value = arg.split("=", 1)[1]
    return _DTYPE_SPELLINGS.get(value) if value is not None else None
