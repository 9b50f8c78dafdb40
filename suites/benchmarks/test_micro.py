"""Micro-benchmarks of reference_engine's hot paths, through pytest-benchmark's ``benchmark`` fixture.

What is timed: block allocate + free, the chained block hash, a prefix-cache lookup, one scheduler
step (``schedule()`` + ``update()``) with 256 running requests and no model, and the swap copies
(``KVCache.swap_out`` / ``swap_in`` of 256 scattered blocks) beside a plain torch copy of the same
bytes each way, on CPU and, marked ``gpu``, on CUDA against a pinned host buffer (the bound a swap
could reach; ``scripts/gpu_check.sh`` runs them). Each test also asserts that its operation did the
work (blocks came back, 256 decodes were scheduled, the bytes round-tripped), so a benchmark of
nothing cannot pass. The reference engine against its dense bounds is in ``test_dense_bounds.py``.

How long they run (the rule, and why):

* **By default, a smoke run**: a few rounds each (``benchmark.pedantic``), well under a second for
  the file, so a plain ``pytest suites/`` stays fast while still checking that every benchmark
  works. They are *not* marked ``benchmark`` (that marker skips without ``--benchmark``, and
  pytest-benchmark users expect ``pytest --benchmark-only`` or ``--benchmark-save`` alone to run them).
* **Measured properly** when numbers are asked for: kvbench's ``--benchmark``, or any of
  pytest-benchmark's ``--benchmark-only``, ``--benchmark-save``, ``--benchmark-autosave``,
  ``--benchmark-json``, ``--benchmark-compare``, ``--benchmark-histogram``, ``--benchmark-enable``.
  Stateless operations then use pytest-benchmark's calibrated ``benchmark(fn)`` (honouring
  ``--benchmark-min-time``, ``--benchmark-max-time``, ``--benchmark-min-rounds``...); the scheduler
  step, which must start every round from the same 256 decoding requests, uses ``pedantic`` with a
  fresh setup per round and ``max(50, --benchmark-min-rounds)`` rounds.
* ``--benchmark-disable`` runs each once, untimed; ``--benchmark-skip`` skips them.

``pytest suites/benchmarks/test_micro.py --benchmark-save=base`` then ``--benchmark-compare`` works
as with any pytest-benchmark suite (the ``benchmark`` groups name what is compared).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from reference_engine.block_manager import BlockManager
from reference_engine.block_pool import BlockHash, BlockPool
from reference_engine.kv_cache import KVCache
from reference_engine.request import Request
from reference_engine.sampling_params import SamplingParams
from reference_engine.scheduler import Scheduler

BLOCK_SIZE = 16
NUM_RUNNING = 256
SMOKE_ROUNDS = 3
MEASURED_PEDANTIC_ROUNDS = 50
#: pytest-benchmark options that mean "I want numbers" (dest names; see the module docstring)
MEASURING_OPTIONS = ("benchmark", "benchmark_only", "benchmark_save", "benchmark_autosave", "benchmark_json",
                     "benchmark_compare", "benchmark_histogram", "benchmark_enable")
#: KV geometry of the ``small`` preset: 8 layers, 4 KV heads of 64, float32 -> 256 KiB per 16-token block
SWAP_GEOMETRY = {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64}
SWAP_BLOCKS = 256


def measuring(config: pytest.Config) -> bool:
    """Whether this run asked for real measurements rather than a smoke run."""
    return any(config.getoption(name, None) for name in MEASURING_OPTIONS)


@pytest.fixture
def measure(benchmark: Any, request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``measure(fn, setup=None, group=...)``: time ``fn`` as the run asks (see the module docstring);
    returns what ``fn`` returned last. ``setup`` builds fresh arguments before every round."""
    full = measuring(request.config)
    min_rounds = int(request.config.getoption("benchmark_min_rounds", 5) or 5)

    def run(fn: Callable[..., Any], *, setup: Callable[[], Any] | None = None, group: str) -> Any:
        benchmark.group = group
        if full and setup is None:
            return benchmark(fn)
        rounds = max(MEASURED_PEDANTIC_ROUNDS, min_rounds) if full else SMOKE_ROUNDS
        return benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=1 if full else 0)

    return run


# --------------------------------------------------------------------------------------------
# blocks


def test_block_allocate_free(measure):
    pool = BlockPool(4096, enable_caching=False)

    def cycle() -> int:
        blocks = pool.allocate(NUM_RUNNING)
        pool.free(blocks)
        return len(blocks)

    assert measure(cycle, group="blocks") == NUM_RUNNING
    assert pool.num_free == 4096
    pool.check_invariants()


def test_block_hash_chain(measure):
    rng = random.Random(0)
    tokens = [rng.randrange(3, 4096) for _ in range(NUM_RUNNING * BLOCK_SIZE)]

    def chain() -> list[BlockHash]:
        hashes: list[BlockHash] = []
        for i in range(NUM_RUNNING):
            hashes.append(BlockHash.of(hashes[-1] if hashes else None, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
        return hashes

    hashes = measure(chain, group="blocks")
    assert len({h.value for h in hashes}) == NUM_RUNNING


def _request(rid: str, prompt: list[int], max_tokens: int = 10_000) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)


def test_prefix_cache_lookup(measure):
    """Look up a 256-block prompt whose blocks are all cached (freed, still hashed)."""
    rng = random.Random(1)
    prompt = [rng.randrange(3, 4096) for _ in range(NUM_RUNNING * BLOCK_SIZE + 1)]
    bm = BlockManager(1024, 0, BLOCK_SIZE, enable_caching=True)
    first = _request("first", prompt)
    assert bm.allocate_slots(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(first)
    bm.free(first.request_id)
    probe = _request("probe", prompt)

    hits = measure(lambda: bm.find_cached_prefix(probe), group="blocks")
    assert len(hits) == NUM_RUNNING  # every full block; the last token is always computed


# --------------------------------------------------------------------------------------------
# the scheduler, no model


def _decoding_scheduler() -> tuple[tuple[Scheduler, dict[str, int]], dict]:
    """A scheduler with 256 requests prefilled and decoding (enough blocks: no preemption)."""
    prompt_len = 64
    bm = BlockManager(NUM_RUNNING * 8, 0, BLOCK_SIZE)
    sched = Scheduler(bm, max_num_seqs=NUM_RUNNING, max_num_batched_tokens=NUM_RUNNING * prompt_len,
                      max_model_len=4096)
    rng = random.Random(2)
    for i in range(NUM_RUNNING):
        sched.add(_request(f"r{i}", [rng.randrange(3, 4096) for _ in range(prompt_len)]))
    sampled = {f"r{i}": 7 for i in range(NUM_RUNNING)}
    sched.update(sched.schedule(), sampled)  # the prefills, all in one step
    return (sched, sampled), {}


def _one_step(sched: Scheduler, sampled: dict[str, int]):
    out = sched.schedule()
    sched.update(out, sampled)
    return out


def test_scheduler_step_256_running(measure):
    out = measure(_one_step, setup=_decoding_scheduler, group="scheduler")
    # One decode token each (``num_prefill_tokens`` cannot tell after update() appended the tokens).
    assert len(out.chunks) == NUM_RUNNING and out.num_preempted == 0
    assert all(c.num_tokens == 1 and c.start == 64 for c in out.chunks)


# --------------------------------------------------------------------------------------------
# swap copies vs a plain copy of the same bytes (the one swap-copy micro-benchmark: on CPU, and on CUDA
# against a pinned host buffer, which the GPU check runs with ``pytest -m gpu``)


@dataclass(frozen=True)
class SwapCopies:
    """A cache with 2 x 256 device blocks and 256 host blocks, 256 scattered device blocks mapped onto
    consecutive host blocks (the host pool hands out consecutive ids), and, for the plain copies, a
    device tensor and a host tensor of the same bytes (the host one pinned on CUDA, as the host pool is)."""

    cache: KVCache
    mapping: list[tuple[int, int]]
    plain_device: torch.Tensor
    plain_host: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def synced(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` followed by a wait for the device, so that a CUDA copy is timed to its end, not its launch."""
        if self.device.type != "cuda":
            return fn

        def run() -> Any:
            result = fn()
            torch.cuda.synchronize(self.device)
            return result

        return run


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def swap_setup(request: pytest.FixtureRequest) -> SwapCopies:
    device = torch.device(request.param)
    cache = KVCache(2 * SWAP_BLOCKS, SWAP_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32, device=device,
                    **SWAP_GEOMETRY)
    torch.manual_seed(0)
    cache.device_cache.normal_()
    device_ids = sorted(random.Random(3).sample(range(2 * SWAP_BLOCKS), SWAP_BLOCKS))
    random.Random(4).shuffle(device_ids)
    plain_device = torch.randn((SWAP_BLOCKS, *cache.block_shape), device=device)
    plain_host = torch.empty(plain_device.shape, dtype=plain_device.dtype, pin_memory=device.type == "cuda")
    return SwapCopies(cache, list(zip(device_ids, range(SWAP_BLOCKS), strict=True)), plain_device, plain_host)


def _swap_group(device: torch.device) -> str:
    mib = SWAP_BLOCKS * BLOCK_SIZE * 2 * 4 * SWAP_GEOMETRY["num_layers"] * SWAP_GEOMETRY["num_kv_heads"] * \
        SWAP_GEOMETRY["head_dim"] // 2**20
    return f"swap copy ({device.type}): {SWAP_BLOCKS} blocks, {mib} MiB"


def test_swap_out(measure, swap_setup, pinned_threads):
    cache, mapping = swap_setup.cache, swap_setup.mapping
    nbytes = measure(swap_setup.synced(lambda: cache.swap_out(mapping)), group=_swap_group(swap_setup.device))
    assert nbytes == SWAP_BLOCKS * cache.block_bytes
    device_ids = torch.tensor([d for d, _ in mapping], device=swap_setup.device)
    assert torch.equal(cache.host_cache[:SWAP_BLOCKS], cache.device_cache[device_ids].cpu())


def test_swap_in(measure, swap_setup, pinned_threads):
    cache, mapping = swap_setup.cache, swap_setup.mapping
    cache.swap_out(mapping)
    expected = cache.host_cache[:SWAP_BLOCKS].clone()
    back = [(h, d) for d, h in mapping]
    nbytes = measure(swap_setup.synced(lambda: cache.swap_in(back)), group=_swap_group(swap_setup.device))
    assert nbytes == SWAP_BLOCKS * cache.block_bytes
    device_ids = torch.tensor([d for d, _ in mapping], device=swap_setup.device)
    assert torch.equal(cache.device_cache[device_ids].cpu(), expected)


@pytest.mark.parametrize("direction", ["out", "in"])
def test_plain_torch_copy(measure, swap_setup, pinned_threads, direction):
    """The floor for each swap: one contiguous copy of the same bytes between the device and a host
    buffer (on CPU, both in host memory)."""
    device_side, host_side = swap_setup.plain_device, swap_setup.plain_host
    dst, src = (host_side, device_side) if direction == "out" else (device_side, host_side)
    if direction == "in":
        host_side.copy_(device_side.cpu().mul(2))  # different bytes, so that the copy is seen to have happened
    non_blocking = swap_setup.device.type == "cuda"
    measure(swap_setup.synced(lambda: dst.copy_(src, non_blocking=non_blocking)), group=_swap_group(swap_setup.device))
    assert torch.equal(dst.cpu(), src.cpu())
