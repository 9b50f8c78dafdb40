"""A running server checked as it stands: unpressured runs in waves that fit its pool, sizes that serve a
check's purpose accepted, and runs kept cold on a prefix-caching server by a per-run ``cache_salt``."""

from __future__ import annotations

import sys

import pytest

from kvbench.conformance.prove import conformance_requests, pressured_knobs, roomy_knobs
from kvbench.core.knobs import Knobs
from kvbench.engines.base import GenRequest
from kvbench.engines.http.openai import OpenAIAdapter, size_serves, waves_within
from kvbench.engines.http.presets import REFERENCE, VLLM
from kvbench.engines.http.server import _Launched
from kvbench.models.builtin import builtin_checkpoint
from reference_engine.sampling_params import SamplingParams


def _req(rid: str, prompt_len: int, max_tokens: int) -> GenRequest:
    return GenRequest(rid, list(range(1, prompt_len + 1)), max_tokens)


def test_waves_fit_the_pool_in_order():
    # needs in blocks of 16: 2, 3, 1, 4, 2; pool 5 blocks
    requests = [_req("a", 20, 10), _req("b", 40, 8), _req("c", 10, 2), _req("d", 60, 4), _req("e", 30, 2)]
    waves = waves_within(requests, 16, 5)
    assert [[r.request_id for r in w] for w in waves] == [["a", "b"], ["c", "d"], ["e"]]


def test_a_request_larger_than_the_pool_gets_a_wave_of_its_own():
    waves = waves_within([_req("a", 10, 2), _req("big", 200, 10), _req("c", 10, 2)], 16, 4)
    assert [[r.request_id for r in w] for w in waves] == [["a"], ["big"], ["c"]]


@pytest.mark.parametrize(("name", "wanted", "running", "unpressured", "serves"), [
    # a larger host pool takes the swaps; a check exhausting the host pool needs its small one
    ("num_cpu_blocks", 512, {"num_cpu_blocks": 524288, "num_gpu_blocks": 24}, False, True),
    ("num_cpu_blocks", 1, {"num_cpu_blocks": 524288, "num_gpu_blocks": 24}, False, False),
    ("max_num_seqs", 12, {"max_num_seqs": 256}, False, True),          # more at once: at least the pressure
    ("max_num_seqs", 4, {"max_num_seqs": 256}, True, False),           # an unpressured run counts on its 4
    ("max_num_seqs", 12, {"max_num_seqs": 8}, False, False),
    ("preemption_mode", "recompute", {"preemption_mode": "swap"}, False, False),  # behaviour: never
    ("enable_prefix_caching", True, {"enable_prefix_caching": False}, False, False),
])
def test_sizes_that_serve_a_checks_purpose(name, wanted, running, unpressured, serves):
    assert size_serves(name, wanted, running, [], unpressured) is serves


def test_a_chunked_prefill_budget_serves_only_while_prompts_exceed_it():
    running = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}
    assert size_serves("max_num_batched_tokens", 16, running, [_req("a", 100, 1)], False)
    assert not size_serves("max_num_batched_tokens", 16, running, [_req("a", 64, 1)], False)
    assert not size_serves("max_num_batched_tokens", 16, {**running, "enable_chunked_prefill": False},
                           [_req("a", 100, 1)], False)


class _FixedPoolAdapter(OpenAIAdapter):
    """The openai adapter over a server that says block_size=16, num_gpu_blocks=24 (no network)."""

    def scrape(self):
        return None


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(builtin_checkpoint())


def _fixed(model_dir: str) -> OpenAIAdapter:
    return _FixedPoolAdapter(model_dir, {"url": "http://127.0.0.1:9", "block_size": "16", "num_gpu_blocks": "24",
                                         "cache_salt": "off"})


def test_roomy_runs_go_in_waves_and_pressured_ones_all_at_once(model_dir):
    engine = _fixed(model_dir)
    requests = conformance_requests(model_dir, n=24, prompt_len=(1, 150), output_len=(1, 30))
    assert sum(len(r.prompt_token_ids) + r.max_tokens for r in requests) > 384  # more than the pool holds
    roomy_knobs(engine, requests)
    waves = engine.waves(requests)
    assert len(waves) > 1 and [r for w in waves for r in w] == requests
    assert all(sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // 16) for r in w) <= 24 for w in waves if len(w) > 1)
    pressured_knobs(engine, requests[:12])  # the latest mark of these requests wins: all at once
    assert engine.waves(requests[:12]) == [requests[:12]]
    assert len(engine.waves(requests[12:])) > 1  # the others are still marked unpressured
    # another request set numbered the same way is not taken for the marked one
    other = conformance_requests(model_dir, seed=5, n=24, prompt_len=(1, 150), output_len=(1, 30))
    assert engine.waves(other) == [other]


def test_a_fixed_pool_no_longer_skips_an_unpressured_check(model_dir):
    engine = _fixed(model_dir)
    requests = conformance_requests(model_dir, n=24, prompt_len=(1, 150), output_len=(1, 30))
    assert roomy_knobs(engine, requests) == Knobs(block_size=16, num_gpu_blocks=24)


# --- prefix-cache isolation


def test_the_reference_engine_shares_cached_prefixes_only_within_a_salt(make_engine):
    prompt = list(range(3, 3 + 64))  # four full blocks of 16
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine = make_engine(num_gpu_blocks_override=64, enable_prefix_caching=True)

    def run(rid: str, salt: str | None) -> int:
        engine.add_request(rid, prompt, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.counters().prefix_cache_hits

    assert run("a", "one") == 0
    assert run("b", "two") == 0      # same tokens, another salt: a miss
    assert run("c", None) == 0       # unsalted misses salted blocks too
    assert run("d", "one") == 48     # the same salt hits its three reusable blocks


class _Remote:
    def __init__(self, takes_salt: bool):
        self._takes = takes_salt

    def takes_cache_salt(self) -> bool:
        return self._takes


@pytest.mark.parametrize(("knobs", "defaults", "takes_salt", "warm"), [
    ({}, VLLM.server_defaults, False, True),            # vLLM caches by default: warm without a salt
    ({}, VLLM.server_defaults, True, False),            # ... cold for each salted run
    ({"enable_prefix_caching": False}, VLLM.server_defaults, False, False),
    ({}, REFERENCE.server_defaults, False, False),      # the reference server does not cache unless told
    ({"enable_prefix_caching": True}, REFERENCE.server_defaults, False, True),
    ({}, {}, False, False),                             # cmd= alone: caching only where a knob says so
])
def test_a_prefix_caching_server_without_a_salt_is_warm(knobs, defaults, takes_salt, warm):
    launched = _Launched(server=None, remote=_Remote(takes_salt), knobs=knobs, port=0,  # type: ignore[arg-type]
                         defaults=dict(defaults))
    assert launched.carries_state is warm


@pytest.mark.server
def test_a_warm_server_would_have_counted_stale_hits_but_a_salted_run_does_not(model_dir, tmp_path):
    """The same run twice on one prefix-caching reference server: without a salt the second run counts the
    first run's blocks as its hits (what a check on a reused server would have credited to itself); with a
    fresh salt per run it counts only its own."""
    from kvbench.launch.process import ServerProcess, free_port

    port = free_port()
    server = ServerProcess([sys.executable, "-m", "reference_engine.serve", "--model", model_dir, "--host", "127.0.0.1",
                            "--port", str(port), "--enable-prefix-caching", "--num-gpu-blocks-override", "64"],
                           tmp_path / "server.log")
    server.start()
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", 120)
        requests = [GenRequest(f"r{i}", [7 + i] * 48 + [1], 2) for i in range(3)]  # no sharing within a run
        hits = {}
        for salt in ("off", "on"):
            engine = OpenAIAdapter(model_dir, {"url": f"http://127.0.0.1:{port}", "cache_salt": salt})
            first = engine.generate(requests)
            second = engine.generate(requests)
            hits[salt] = (first.counters["prefix_cache_hits"], second.counters["prefix_cache_hits"])
        assert hits["off"][1] == 3 * 48  # stale: the earlier run's blocks
        assert hits["on"] == (0, 0)
    finally:
        server.stop()
