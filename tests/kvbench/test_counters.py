"""The counter contract (kvbench.core.counters) and every place that speaks it.

The record itself (validation, "None = not exposed", the mapping over exposed counters, ``minus``),
its journey through traces and results files, the metrics' reading of it, and each adapter's
counters: ``reference`` is the engine's ``EngineCounters`` copied by name, in process and read back
from a reference server's ``/metrics``, ``hf`` exposes nothing (all None, never 0),
``hf-cb`` counts ``prefill_chunks`` as the contract defines it and survives a renamed or broken
internal with the dependent counters None. hf-cb runs are on the tiny model with one short request.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbench.bench import metrics
from kvbench.bench.results import Results, ResultsError
from kvbench.core.counters import COUNTER_NAMES, COUNTER_SPECS, Counters, markdown_table, spec
from kvbench.core.requests import GenResult
from kvbench.core.trace import Trace, TraceRecorder
from kvbench.engines.base import GenRequest, Knobs
from kvbench.engines.hf.probe import (
    LOGGER_NAME,
    OFFLOAD,
    PREFIX,
    SCHEDULE,
    LogCapture,
    LogCounts,
    Probe,
    cross_check,
    transformers_version_note,
)

ENGINES_PAGE = Path(__file__).resolve().parents[2] / "docs" / "engines.md"

# ------------------------------------------------------------------------------------------- the record


def test_none_is_not_exposed_and_the_mapping_reads_only_exposed_counters():
    c = Counters(swap_ins=3, preemptions_recompute=0)
    assert "swap_ins" in c and "preemptions_recompute" in c  # 0 is a fact, exposed
    assert "swap_outs" not in c and c.get("swap_outs") is None
    with pytest.raises(KeyError, match="not exposed"):
        c["swap_outs"]
    assert dict(c) == {"preemptions_recompute": 0, "swap_ins": 3} and len(c) == 2
    assert Counters().preemptions is None  # one mode unknown: the total is unknown, not 0
    assert Counters(preemptions_recompute=2, preemptions_swap=1).preemptions == 3


def test_unknown_names_negative_and_non_numbers_are_refused_naming_the_counter():
    with pytest.raises(ValueError, match=r"unknown counter\(s\) \['num_swaps'\]"):
        Counters.from_dict({"num_swaps": 1})
    with pytest.raises(TypeError):
        Counters(num_swaps=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="'swap_ins' must be >= 0"):
        Counters(swap_ins=-1)
    with pytest.raises(TypeError, match="'aborts' must be a number"):
        Counters(aborts=True)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="not a counter of the contract"):
        Counters()["num_swaps"]
    with pytest.raises(KeyError, match="not a counter of the contract"):
        spec("num_swaps")


def test_minus_subtracts_cumulative_counters_and_keeps_gauges_and_unknowns():
    before = Counters(preemptions_recompute=5, swap_ins=None, leaked_blocks=3, num_gpu_blocks=64, aborts=1)
    after = Counters(preemptions_recompute=9, swap_ins=2, leaked_blocks=0, num_gpu_blocks=64, aborts=None)
    d = after.minus(before)
    assert d.preemptions_recompute == 4
    assert d.swap_ins is None  # unknown before: the difference is unknown, not 2
    assert d.aborts is None
    assert (d.leaked_blocks, d.num_gpu_blocks) == (0, 64)  # gauges and configuration: the later value


def test_to_dict_names_every_counter_and_from_dict_round_trips():
    c = Counters(prefill_chunks=2, swap_seconds=0.25)
    d = c.to_dict()
    assert list(d) == list(COUNTER_NAMES) and d["aborts"] is None
    assert Counters.from_dict(json.loads(json.dumps(d))) == c


def test_table_printed_by_the_module_is_the_table_in_the_docs():
    out = subprocess.run([sys.executable, "-m", "kvbench.core.counters"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == markdown_table()
    assert all(f"| `{s.name}` | {s.unit} |" in out for s in COUNTER_SPECS)
    assert markdown_table() in ENGINES_PAGE.read_text(encoding="utf-8"), "docs/engines.md's counter table is " \
        "stale: paste the output of `python -m kvbench.core.counters`"


# ------------------------------------------------------------------------ traces, results, metrics


def test_gen_result_and_trace_hold_counters():
    assert GenResult([]).counters == Counters()
    assert GenResult([], {"swap_ins": 1}).counters == Counters(swap_ins=1)  # a mapping is read by the contract
    with pytest.raises(ValueError, match="unknown counter"):
        GenResult([], {"swaps": 1})
    recorder = TraceRecorder("e", "s")
    recorder.set_counters({"prefill_chunks": 4})
    trace = recorder.finish()
    assert isinstance(trace.counters, Counters) and trace.counters.prefill_chunks == 4
    assert Trace.from_dict(json.loads(json.dumps(trace.to_dict()))).counters == trace.counters


def test_counters_round_trip_through_a_results_file(tmp_path: Path):
    trace = Trace("eng", "storm", counters=Counters(preemptions_recompute=7, preemptions_swap=0, aborts=None))
    results = Results()
    entry = results.add_trace(trace, engine="eng")
    assert entry["counters"]["preemptions_recompute"] == 7 and entry["counters"]["aborts"] is None
    loaded = Results.load(results.save(tmp_path / "results.json"))
    assert loaded.counters("storm", "eng") == trace.counters
    assert loaded.counters("storm", "other") is None


def test_results_file_without_counters_reads_and_unknown_counters_are_refused(tmp_path: Path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema_version": 1, "engines": [{"name": "e"}], "scenarios": [
        {"name": "s", "results": [{"engine": "e", "metrics": {}}]}]}))
    assert Results.load(path).counters("s", "e") is None  # written before the contract: not recorded
    path.write_text(json.dumps({"schema_version": 1, "engines": [{"name": "e"}], "scenarios": [
        {"name": "s", "results": [{"engine": "e", "metrics": {}, "counters": {"num_swaps": 1}}]}]}))
    with pytest.raises(ResultsError, match=r"results\[0\] counters: unknown counter.*num_swaps"):
        Results.load(path)


def test_metrics_read_counters_through_the_contract_and_never_invent_zero():
    trace = Trace("e", "s", counters=Counters(swapped_out_bytes=1000, swapped_in_bytes=1000, swap_seconds=2.0))
    m = metrics.summarize(trace)
    assert m["swap_bandwidth"] == 1000.0
    assert m["prefill_chunks"] is None and m["swap_fallbacks"] is None  # not exposed: None, not 0
    with pytest.raises(KeyError, match="not a counter of the contract"):
        metrics._counter(trace, "num_swaps")


# ----------------------------------------------------------------------------------------- adapters

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvbench.models.random_llama import write_checkpoint

    return str(write_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), preset="tiny", seed=0))


def _requests(n: int = 3, prompt_len: int = 20, max_tokens: int = 8) -> list[GenRequest]:
    gen = torch.Generator().manual_seed(7)
    return [GenRequest(f"r{i}", torch.randint(3, 512, (prompt_len + i,), generator=gen).tolist(), max_tokens)
            for i in range(n)]


#: with these knobs every EngineCounters field of a _pressured_engine run is above 0 (a host pool of 3
#: blocks takes one swap, then falls back to recompute)
EVERY_COUNTER_MOVES = {"num_cpu_blocks": 3, "preemption_mode": "swap", "enable_prefix_caching": True}


def _pressured_engine(ckpt_dir: str, **knobs):
    """A finished run in which most counters moved: chunked prefill, preemptions (swap, and recompute
    when the host pool fills), prefix hits, and one request aborted in flight."""
    from kvbench.engines.inprocess.reference import ReferenceAdapter
    from reference_engine import SamplingParams

    knobs = {"block_size": 16, "num_gpu_blocks": 6, "max_num_batched_tokens": 16, "enable_chunked_prefill": True,
             **knobs}
    engine = ReferenceAdapter(ckpt_dir).build_engine(Knobs(**knobs))
    shared = _requests(1, 32, 1)[0].prompt_token_ids  # two full blocks every request starts with
    for r in _requests(4, 30, 12):
        engine.add_request(r.request_id, shared + r.prompt_token_ids, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("gone", shared + [5] * 20, SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort_request("gone")
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def test_reference_counters_are_the_engine_record_copied_by_name(ckpt_dir: str):
    from kvbench.engines.inprocess.reference import ReferenceAdapter, counters_of
    from reference_engine.engine_counters import EngineCounters

    engine = _pressured_engine(ckpt_dir)
    c, record, stats = counters_of(engine), engine.counters(), engine.stats()
    assert isinstance(c, Counters)
    shared = [f.name for f in dataclasses.fields(EngineCounters) if f.name in COUNTER_NAMES]
    assert set(f.name for f in dataclasses.fields(EngineCounters)) - set(shared) == {"steps", "evicted_blocks"}
    for name in shared:
        assert getattr(c, name) == getattr(record, name), name
    assert c.prefill_chunks > 0 and c.preemptions_recompute > 0 and c.aborts == 1  # not all zeros
    assert c.leaked_blocks == 0 and c.num_gpu_blocks == stats["num_gpu_blocks"] == 6
    result = ReferenceAdapter(ckpt_dir).generate(_requests(2), Knobs(block_size=16, num_gpu_blocks=64))
    assert isinstance(result.counters, Counters) and result.counters.generated_tokens == 16


def test_engine_stats_are_gauges_only(ckpt_dir: str):
    from reference_engine.engine_counters import EngineCounters

    stats = _pressured_engine(ckpt_dir).stats()
    assert set(stats) == {"num_gpu_blocks", "num_free_gpu_blocks", "num_cpu_blocks", "num_free_cpu_blocks",
                          "num_cached_blocks", "num_running", "num_waiting", "num_swapped", "gpu_cache_usage",
                          "cpu_cache_usage"}
    assert not set(stats) & {f.name for f in dataclasses.fields(EngineCounters)}


def test_reference_counters_copy_every_contract_field_of_the_record():
    from kvbench.engines.inprocess.reference import counters_of
    from reference_engine.engine_counters import EngineCounters

    stats = {"num_gpu_blocks": 8, "num_free_gpu_blocks": 8, "num_cpu_blocks": 0, "num_free_cpu_blocks": 0}
    record = EngineCounters(preemptions_recompute=5, aborts=2, steps=40)  # steps: not a contract counter
    c = counters_of(SimpleNamespace(stats=lambda: stats, counters=lambda: record))
    assert (c.preemptions_recompute, c.aborts, c.leaked_blocks, c.swap_ins) == (5, 2, 0, 0)
    assert c.preemptions_total is None, "the engine keeps no total of its own beside the modes"


def test_an_aborted_in_flight_request_counts_one_abort(ckpt_dir: str):
    from kvbench.engines.inprocess.reference import ReferenceAdapter, counters_of
    from reference_engine import SamplingParams

    engine = ReferenceAdapter(ckpt_dir).build_engine(Knobs(block_size=16, num_gpu_blocks=64))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("running", [5] * 10, params)
    engine.add_request("done", [6] * 10, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    assert engine.counters().aborts == 0
    assert engine.abort_request("running") is True  # in flight: counted
    assert engine.counters().aborts == 1
    assert engine.abort_request("running") is False and engine.abort_request("done") is False  # finished: not
    assert engine.abort_request("nobody") is False
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.counters().aborts == 1 and counters_of(engine).aborts == 1
    assert [e.kind for e in engine.events].count("aborted") == 1


def _server_metrics_text(engine) -> str:
    """What a reference server's ``/metrics`` says of ``engine`` (the server's own collector, no server)."""
    from reference_engine.serve.prometheus import ServerMetrics, read_engine_stats

    stats = read_engine_stats(engine)
    bm = engine.block_manager
    return ServerMetrics("m", engine.config, bm.num_gpu_blocks, bm.num_cpu_blocks,
                         snapshot=lambda: stats).render().decode()


def test_every_engine_counter_is_on_the_servers_metrics_under_its_own_name(ckpt_dir: str):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from reference_engine.engine_counters import EngineCounters, field_docs

    engine = _pressured_engine(ckpt_dir, **EVERY_COUNTER_MOVES)
    record = engine.counters()
    families = {f.name: f for f in text_string_to_metric_families(_server_metrics_text(engine))}
    for f in dataclasses.fields(EngineCounters):
        family = families.get(f"reference_engine:{f.name}")
        assert family is not None and family.type == "counter", f"reference_engine:{f.name}_total is missing"
        [sample] = family.samples
        assert sample.name == f"reference_engine:{f.name}_total"
        assert sample.value == getattr(record, f.name), f.name
        assert family.documentation == field_docs()[f.name] != "", f.name
    # vLLM's names are fed from the same record
    vllm = {name: families[name].samples[0].value for name in ("vllm:num_preemptions", "vllm:prefix_cache_queries",
                                                               "vllm:prefix_cache_hits", "vllm:generation_tokens")}
    assert vllm == {"vllm:num_preemptions": record.preemptions, "vllm:prefix_cache_queries":
                    record.prefix_cache_queries, "vllm:prefix_cache_hits": record.prefix_cache_hits,
                    "vllm:generation_tokens": record.generated_tokens}
    unmoved = [f.name for f in dataclasses.fields(EngineCounters) if not getattr(record, f.name)]
    assert not unmoved, f"the run left {unmoved} at 0: the comparison would prove less"


def test_counters_read_back_from_the_servers_metrics_equal_the_engines(ckpt_dir: str):
    pytest.importorskip("prometheus_client")
    from kvbench.drivers.server_metrics import MetricsSnapshot, cumulative_counters
    from kvbench.engines.inprocess.reference import counters_of

    engine = _pressured_engine(ckpt_dir, **EVERY_COUNTER_MOVES)
    over_http = cumulative_counters(MetricsSnapshot.parse(_server_metrics_text(engine)))
    record, in_process = engine.counters(), counters_of(engine)
    shared = [f.name for f in dataclasses.fields(record) if f.name in COUNTER_NAMES]
    assert {n: getattr(over_http, n) for n in shared} == {n: getattr(record, n) for n in shared}
    assert over_http.preemptions_total == record.preemptions
    assert (over_http.num_gpu_blocks, over_http.num_cpu_blocks) == (in_process.num_gpu_blocks,
                                                                     in_process.num_cpu_blocks)


def test_hf_exposes_no_counter(ckpt_dir: str):
    pytest.importorskip("transformers")
    from kvbench.engines.hf.generate import HFAdapter

    result = HFAdapter(ckpt_dir).generate(_requests(1, 10, 4))
    assert isinstance(result.counters, Counters)
    assert result.counters == Counters() and len(result.counters) == 0  # all None: never 0
    assert all(v is None for v in result.counters.to_dict().values())


# --------------------------------------------------------------------------- hf-cb probe, no model


class _Scheduler:
    def __init__(self):
        self.active_requests, self.waiting_requests = {}, {}

    def schedule_batch(self, token_budget, cache_budget):
        return [SimpleNamespace(state=None, query_length=1)], False, 1, 1  # state None: reading it fails


class _Cache:
    use_prefix_sharing = True

    def search_prefix_match(self, request_id, prompt_ids, extra):  # a changed signature
        return 0


def test_probe_skips_missing_and_changed_hooks_and_survives_a_failing_reading():
    bp = SimpleNamespace(scheduler=_Scheduler(), cache=_Cache(), prepare_next_batch=lambda: False,
                         update_batch=lambda: None)  # no offloading_manager at all
    probe = Probe(bp)
    assert "not found" in probe.missing[OFFLOAD]
    assert "signature changed: expected (request_id, prompt_ids), found (request_id, prompt_ids, extra)" \
        in probe.missing[PREFIX]
    result = bp.scheduler.schedule_batch(8, 8)  # the wrapper reads state.request_id of None: AttributeError
    assert result[2] == 1  # the engine still gets its result
    assert "stopped observing: AttributeError" in probe.missing[SCHEDULE]
    counters, _, notes = probe.counters({"r": (4, 2)})
    assert counters.computed_tokens is None and counters.prefill_chunks is None
    assert counters.preemptions_recompute is None and counters.prefix_cache_hits is None
    assert any("prefill_chunks not exposed: hook scheduler.schedule_batch" in n for n in notes)
    probe.detach()
    assert "schedule_batch" not in vars(bp.scheduler)  # the class method shows through again


def test_cross_check_drops_what_the_log_contradicts():
    probed = Counters(preemptions_recompute=3, preemptions_swap=0, swap_outs=0, swap_fallbacks=0,
                      recomputed_tokens=40, prefix_cache_hits=32, prefix_cache_queries=90)
    agree = LogCounts(soft_resets=3, cpu_offloads=0, prefix_hit_tokens=32)
    same, lines = cross_check(probed, agree, prefix_sharing=True, cpu_pool=False)
    assert same == probed and len(lines) == 3 and all("FAILED" not in line for line in lines)
    dropped, lines = cross_check(probed, dataclasses.replace(agree, soft_resets=2), prefix_sharing=True,
                                 cpu_pool=False)
    assert dropped.preemptions_recompute is None and dropped.recomputed_tokens is None
    assert dropped.swap_fallbacks is None and dropped.preemptions_swap == 0 and dropped.prefix_cache_hits == 32
    assert any("cross-check FAILED: preemptions_recompute: probe counted 3, the engine's 'Offloaded ... soft "
               "reset' INFO lines say 2" in line for line in lines)


def test_log_capture_counts_the_engines_lines():
    import logging

    logs = LogCapture()
    with logs.attached():
        log = logging.getLogger(LOGGER_NAME)
        log.info("Offloaded 3 requests (1 to CPU, 2 soft reset): 0 starved requests remain.")
        log.debug("Found a prefix match of 32 tokens for request p2")
        log.debug("Restored CPU-offloaded request r1 with 9 prefill tokens and 3 generated tokens.")
    assert logs.counts == LogCounts(cpu_offloads=1, soft_resets=2, offload_lines=1, prefix_hit_tokens=32, restores=1)
    assert logs.evidence() == ["log: INFO: Offloaded 3 requests (1 to CPU, 2 soft reset): 0 starved requests remain."]


def test_transformers_version_note():
    assert transformers_version_note("5.24.0") is None and transformers_version_note("5.24.3.dev0") is None
    note = transformers_version_note("5.30.1")
    assert note is not None and "untested transformers version 5.30.1" in note and "5.24.x" in note


# ------------------------------------------------------------------------------- hf-cb, real runs


@pytest.fixture(scope="module")
def cb(ckpt_dir: str):
    pytest.importorskip("transformers")
    from kvbench.engines.hf.continuous_batching import HFContinuousBatchingAdapter

    return HFContinuousBatchingAdapter(ckpt_dir)


def _one(prompt_len: int) -> list[GenRequest]:
    return _requests(1, prompt_len, 4)


def test_hf_cb_prefill_chunks_follow_the_contract(cb):
    # alone, a prompt of L tokens under a budget of B is prefilled in ceil(L / B) pieces
    unsplit = cb.generate(_one(12), Knobs(block_size=16, num_gpu_blocks=16, max_num_batched_tokens=16))
    assert unsplit.counters.prefill_chunks == 0, unsplit.evidence
    split = cb.generate(_one(40), Knobs(block_size=16, num_gpu_blocks=16, max_num_batched_tokens=16))
    assert split.counters.prefill_chunks == 2, split.evidence  # 16 + 16 + 8: three pieces, two unfinished
    assert split.counters.computed_tokens == 40 + 3  # the prefill, then 3 decodes feeding back tokens
    assert any("cross-check: preemptions_recompute = 0" in line for line in split.evidence)


def test_hf_cb_renamed_internal_makes_its_counters_not_exposed(cb, monkeypatch):
    # as if transformers had moved schedule_batch: the probe's path no longer resolves
    monkeypatch.setitem(Probe.HOOKS, SCHEDULE, ("scheduler.schedule_next_batch", "_make_schedule_hook"))
    result = cb.generate(_one(12), Knobs(block_size=16, num_gpu_blocks=16))
    assert [o.finish_reason for o in result.outputs] == ["length"] and len(result.outputs[0].token_ids) == 4
    c = result.counters
    assert c.prefill_chunks is None and c.computed_tokens is None and c.recomputed_tokens is None
    assert c.preemptions_recompute == 0 and c.leaked_blocks == 0  # what other hooks count is still there
    assert any("hook scheduler.schedule_batch unavailable: scheduler.schedule_next_batch not found" in line
               for line in result.evidence), result.evidence


def test_hf_cb_hook_that_breaks_mid_run_stops_observing_not_the_run(cb, monkeypatch):
    def broken(self, batch):
        raise AttributeError("'FutureRequestState' object has no attribute 'query_length'")

    monkeypatch.setattr(Probe, "_on_batch", broken)
    result = cb.generate(_requests(2, 12, 4), Knobs(block_size=16, num_gpu_blocks=16))
    assert [o.finish_reason for o in result.outputs] == ["length", "length"]
    assert result.counters.computed_tokens is None and result.counters.prefill_chunks is None
    assert any("stopped observing: AttributeError" in line for line in result.evidence)


def test_report_says_not_exposed_for_a_missing_counter_never_zero():
    from kvbench.bench.formatting import NOT_AVAILABLE, NOT_EXPOSED, fmt_metric

    assert fmt_metric("prefill_chunks", None) == NOT_EXPOSED == "not exposed"
    assert fmt_metric("swapped_out_bytes", None) == NOT_EXPOSED
    assert fmt_metric("prefill_chunks", 0) == "0"  # a counted zero stays a zero
    assert fmt_metric("ttft_p99", None) == NOT_AVAILABLE  # not a counter: no data, not "not exposed"
