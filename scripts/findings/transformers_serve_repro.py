"""Minimal reproductions of what kvbench's conformance suite found in ``transformers serve`` (5.24,
``--continuous-batching``, CPU), on kvbench's built-in tiny Llama checkpoint (a local directory).

    python scripts/findings/transformers_serve_repro.py [--only NAME]

Each finding starts its own ``transformers serve`` on 127.0.0.1 (a free port), sends plain HTTP
requests with httpx, prints what was expected and what came back, and stops the server with its
whole process group. Needs ``accelerate`` (``transformers serve`` loads with a ``device_map``).

1. ``special_tokens_lost``: /v1/completions returns text only, decoded with special tokens skipped, and
   has no field for token ids (vLLM's ``return_token_ids`` is refused with a 422), so a generated special
   token (here ``<|pad|>``, id 0, the ground truth's greedy pick) vanishes: ``usage.completion_tokens``
   counts it, the text does not. A client cannot check such an output token by token.
2. ``over_long_prompt_accepted``: a prompt longer than ``max_position_embeddings`` (1024) is served
   (200, finish "length") instead of refused with a 400.
3. ``oversized_request_kills_worker``: one request that needs more KV blocks than the whole pool
   (``--cb-num-blocks 24 --cb-block-size 16`` = 384 tokens; the request needs ~600) does not get a 400:
   the continuous-batching worker dies ("No requests can be scheduled and no requests can be
   offloaded") and every later request, however small, fails with 503.
4. ``invalid_pool_flags_start_healthy``: ``--cb-block-size 3`` (its own bound is >= 4) is accepted at
   start-up, ``/health`` answers 200, and then every completion fails with 500. ``--cb-num-blocks -1``
   is accepted too and a small request is served (what the pool is then sized to is not said; under
   kvbench's conformance request set the worker died with "No requests can be scheduled").
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0


def tiny_checkpoint() -> str:
    """kvbench's built-in tiny checkpoint (written once into ~/.cache/kvbench)."""
    from kvbench.models.builtin import builtin_checkpoint

    return str(builtin_checkpoint("tiny"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def transformers_serve(model: str, *flags: str) -> Iterator[str]:
    """A running ``transformers serve`` (its base URL); stopped with its process group on exit."""
    exe = shutil.which("transformers")
    if exe is None:
        sys.exit("the `transformers` command is not on PATH")
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="transformers-serve-", suffix=".log", delete=False)  # noqa: SIM115
    argv = [exe, "serve", model, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), *flags]
    print(f"$ {' '.join(argv)}   (log: {log.name})")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                sys.exit(f"transformers serve exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"no /health within {START_TIMEOUT_S:.0f} s; see {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
        log.close()


def complete(url: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "generation_config": '{"eos_token_id": -1, "do_sample": false}', **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)


def _text_of(model: str, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model) / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def special_tokens_lost(model: str) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    from kvbench.conformance.prove import conformance_requests

    req = next(r for r in conformance_requests(model) if r.request_id == "r0003")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([req.prompt_token_ids]), max_new_tokens=req.max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    truth = out[0, len(req.prompt_token_ids):].tolist()
    print(f"  transformers generate (greedy) gives {len(truth)} tokens: {truth}")
    with transformers_serve(model, "--cb-block-size", "16", "--cb-num-blocks", "4096") as url:
        refused = httpx.post(url + "/v1/completions", json={"prompt": "t5", "max_tokens": 1, "return_token_ids": True},
                             timeout=REQUEST_TIMEOUT_S)
        print(f"  asking for token ids (return_token_ids): HTTP {refused.status_code} {refused.text[:120]}")
        r = complete(url, _text_of(model, req.prompt_token_ids), req.max_tokens)
        data = r.json()
        text, counted = data["choices"][0]["text"], data["usage"]["completion_tokens"]
    words = text.split()
    print(f"  transformers serve: usage.completion_tokens={counted}, text has {len(words)} tokens: {text!r}")
    lost = 0 in truth and counted != len(words)
    print(f"  -> {'REPRODUCED' if lost else 'not reproduced'}: the special token (id 0) is counted but not in the "
          "text, and there is no way to ask for the ids")
    return lost


def over_long_prompt_accepted(model: str) -> bool:
    with transformers_serve(model, "--cb-block-size", "16", "--cb-num-blocks", "4096") as url:
        r = complete(url, " ".join(["t5"] * 1034), 4)  # max_position_embeddings is 1024
    print(f"  1034-token prompt (max_position_embeddings 1024): HTTP {r.status_code} {r.text[:160]}")
    accepted = r.status_code == 200
    print(f"  -> {'REPRODUCED' if accepted else 'not reproduced'}: expected a 400 naming the prompt's length")
    return accepted


def oversized_request_kills_worker(model: str) -> bool:
    with transformers_serve(model, "--cb-block-size", "16", "--cb-num-blocks", "24") as url:
        big = complete(url, " ".join(["t7"] * 560), 40)  # ~600 tokens of KV; the pool holds 384
        print(f"  request needing ~38 blocks of a 24-block pool: HTTP {big.status_code} {big.text[:200]}")
        small = complete(url, "t5 t6 t7", 4)
        print(f"  then a 3-token request: HTTP {small.status_code} {small.text[:200]}")
    dead = big.status_code != 400 and small.status_code != 200
    print(f"  -> {'REPRODUCED' if dead else 'not reproduced'}: expected a 400 for the big request and the small one "
          "served")
    return dead


def invalid_pool_flags_start_healthy(model: str) -> bool:
    statuses = []
    for flags in (("--cb-block-size", "3", "--cb-num-blocks", "64"),
                  ("--cb-block-size", "16", "--cb-num-blocks", "-1")):
        with transformers_serve(model, *flags) as url:
            print(f"  {' '.join(flags)}: started, /health 200")
            r = complete(url, "t5 t6 t7", 4)
            print(f"  first completion: HTTP {r.status_code} {r.text[:200]}")
        statuses.append(r.status_code)
    # both started and answered /health (else transformers_serve exits): neither flag was refused
    reproduced = statuses[0] >= 500
    print(f"  -> {'REPRODUCED' if reproduced else 'not reproduced'}: expected start-up to fail naming the flag "
          f"(both started healthy; completions: HTTP {statuses})")
    return reproduced


FINDINGS: dict[str, Callable[[str], bool]] = {f.__name__: f for f in (
    special_tokens_lost, over_long_prompt_accepted, oversized_request_kills_worker, invalid_pool_flags_start_healthy)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(FINDINGS), help="run one finding")
    parser.add_argument("--model", help="a local Llama checkpoint directory (default: kvbench's built-in tiny one)")
    args = parser.parse_args()
    model = args.model or tiny_checkpoint()
    results = {}
    for name, finding in FINDINGS.items():
        if args.only and name != args.only:
            continue
        print(f"[{name}]")
        results[name] = finding(model)
    print("\n" + "\n".join(f"{'REPRODUCED' if ok else 'not reproduced'}: {name}" for name, ok in results.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
