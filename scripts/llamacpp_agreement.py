"""Measure how far llama.cpp's ``llama-server`` agrees with kvbench's reference engine and transformers on the
same checkpoint converted to GGUF (:mod:`kvbench.models.gguf`): greedy tokens for token-id prompts, and the
tokenizer (text -> ids, ids -> text) against the checkpoint's Hugging Face tokenizer.

    python scripts/llamacpp_agreement.py [--presets tiny,small] [--dtypes float32,float16,bfloat16]
        [--prompts 16] [--max-tokens 64] [--server PATH] [--json OUT]

Prompts are seeded random ordinary ids (lengths spread over 8..300), sent one at a time, ``temperature=0``,
prompt cache off. EOS is not ignored on the server: llama-server's ``ignore_eos`` bans the EOS token (a -inf
logit bias) where kvbench's engines let it be generated and go on, which is another output, not noise; so
the server stops at EOS, and its tokens are compared with each baseline's (run with EOS ignored) up to and
excluding the first EOS on each side. The server runs on 127.0.0.1 with one slot and its KV cache in the GGUF's
dtype (``--cache-type-k/-v``: f32 for the float32 file, llama-server's default f16 otherwise), and is stopped
with its whole process group whatever happens. It prints, per (preset, GGUF dtype), the number of prompts whose
greedy tokens are identical to each baseline, and where a prompt first differs. A measurement, not a test:
it asserts nothing (tests/kvbench/test_llamacpp_peer.py asserts what must hold).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

KV_CACHE_TYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: texts whose llama.cpp tokenization is compared with the HF tokenizer's (the edge cases included)
TEXTS = ["t5 t6 t7", "t100", " t5", "t5  t6", "t5\nt6", "t12x t3", "Hello world t5", "t5<|eos|>t6",
         "<|bos|>t1 t2", "t511 t510 t3", "", "t5 ", "xt5"]


@contextmanager
def llama_server(binary: Path, gguf: Path, dtype: str, ctx: int, log: Path, extra: tuple[str, ...] = ()
                 ) -> Iterator[str]:
    """A llama-server on 127.0.0.1 serving ``gguf`` with one slot; yields its base URL. Stopped (whole
    group, bounded waits) on exit."""
    from kvbench.launch.process import ServerProcess, free_port

    port = free_port()
    cache = KV_CACHE_TYPE[dtype]
    server = ServerProcess([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                            "-c", str(ctx), "-np", "1", "-t", "2", "--cache-type-k", cache, "--cache-type-v", cache,
                            "--no-webui", *extra], log)
    server.start()
    try:
        base = f"http://127.0.0.1:{port}"
        server.wait_healthy(base, timeout=120)
        yield base
    finally:
        server.stop()


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` seeded prompts of ordinary ids (3..vocab-1), lengths spread over 8..300."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(8, 300, count).round().int().tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def server_greedy(base: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
            "return_tokens": True, "stream": False}
    response = httpx.post(base + "/completion", json=body, timeout=300)
    response.raise_for_status()
    return list(response.json()["tokens"])


def reference_greedy(model_dir: Path, batch: list[list[int]], max_tokens: int, dtype: str) -> list[list[int]]:
    from kvbench.core.requests import GenRequest
    from kvbench.engines.inprocess.reference import ReferenceAdapter

    requests = [GenRequest(f"p{i}", p, max_tokens) for i, p in enumerate(batch)]
    result = ReferenceAdapter(str(model_dir), {"dtype": dtype}).generate(requests)
    return [out.token_ids for out in result.outputs]


def transformers_greedy(model_dir: Path, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Float32 greedy decoding with transformers' LlamaForCausalLM, EOS not stopping (as ``ignore_eos``)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in batch:
            ids = torch.tensor([prompt])
            out = model(ids, use_cache=True)
            past, tokens = out.past_key_values, []
            for _ in range(max_tokens):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            outs.append(tokens)
    return outs


def until_eos(tokens: list[int], eos: int) -> list[int]:
    """``tokens`` before the first ``eos`` (all of them where there is none): a server that stopped at EOS
    agrees with a baseline that generated it there, whether or not its answer lists the EOS token."""
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


def agreement(got: list[list[int]], want: list[list[int]], eos: int | None = None) -> dict:
    if eos is not None:
        got, want = [until_eos(g, eos) for g in got], [until_eos(w, eos) for w in want]
    first = [next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None if len(g) == len(w)
                  else min(len(g), len(w))) for g, w in zip(got, want, strict=True)]
    same = sum(f is None for f in first)
    return {"identical": same, "of": len(want), "first_difference": [f for f in first if f is not None]}


def tokenizer_agreement(base: str, model_dir: Path) -> list[dict]:
    """Each text of TEXTS tokenized by the server (``/tokenize``, specials parsed) and by the HF tokenizer,
    and the HF ids detokenized by the server (``/detokenize``) and by HF ``decode``."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rows = []
    for text in TEXTS:
        want = hf.encode(text, add_special_tokens=False).ids
        got = httpx.post(base + "/tokenize", json={"content": text, "add_special": False}, timeout=30).json()["tokens"]
        back = httpx.post(base + "/detokenize", json={"tokens": want}, timeout=30).json()["content"]
        rows.append({"text": text, "hf_ids": want, "llama_ids": got, "ids_equal": got == want,
                     "hf_decode": hf.decode(want, skip_special_tokens=False), "llama_detokenize": back})
    return rows


def main(argv: list[str] | None = None) -> int:
    from kvbench.launch.peers import PeerMissing, find_llamacpp
    from kvbench.models.builtin import builtin_checkpoint
    from kvbench.models.gguf import gguf_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--server", help="llama-server binary (default: find_llamacpp())")
    parser.add_argument("--json", help="write the full results here")
    parser.add_argument("--server-args", default="", help="more llama-server flags, e.g. '-fa off'")
    parser.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer comparison")
    args = parser.parse_args(argv)
    try:
        binary = Path(args.server) if args.server else find_llamacpp().server
    except PeerMissing as e:
        print(e, file=sys.stderr)
        return 3
    results = []
    logs = Path(tempfile.mkdtemp(prefix="llamacpp-agreement-"))
    for preset in args.presets.split(","):
        model_dir = builtin_checkpoint(preset)
        config = json.loads((model_dir / "config.json").read_text())
        batch = prompts(args.prompts, config["vocab_size"])
        eos = config["eos_token_id"]
        ctx = max(map(len, batch)) + args.max_tokens + 8
        hf = transformers_greedy(model_dir, batch, args.max_tokens)
        ref32 = reference_greedy(model_dir, batch, args.max_tokens, "float32")
        print(f"{preset}: reference float32 vs transformers float32 (EOS ignored, all tokens): {agreement(ref32, hf)}; "
              f"prompts whose output holds EOS: {sum(eos in t for t in ref32)}", flush=True)
        for dtype in args.dtypes.split(","):
            gguf = gguf_checkpoint(model_dir, dtype)
            extra = tuple(args.server_args.split())
            with llama_server(binary, gguf, dtype, ctx, logs / f"{preset}-{dtype}.log", extra) as base:
                got = [server_greedy(base, p, args.max_tokens) for p in batch]
                tok = tokenizer_agreement(base, model_dir) if dtype == "float32" and not args.no_tokenizer else None
            row = {"preset": preset, "gguf_dtype": dtype, "kv_cache": KV_CACHE_TYPE[dtype], "server_args": extra,
                   "prompts": len(batch), "max_tokens": args.max_tokens,
                   "vs_reference_float32": agreement(got, ref32, eos),
                   "vs_transformers_float32": agreement(got, hf, eos)}
            if dtype != "float32":
                reduced = reference_greedy(model_dir, batch, args.max_tokens, dtype)
                row[f"vs_reference_{dtype}"] = agreement(got, reduced, eos)
            print(json.dumps(row), flush=True)
            if tok:
                for t in tok:
                    print("  tokenizer:", json.dumps(t), flush=True)
                row["tokenizer"] = tok
            results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
