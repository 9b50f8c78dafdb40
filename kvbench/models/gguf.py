"""A kvbench (Hugging Face) Llama checkpoint as a GGUF file, for llama.cpp's ``llama-server``.

``gguf_checkpoint(model_dir, dtype)`` returns the path of ``model_dir`` converted to GGUF, written once and
cached (see "Cache" below). The conversion is written here with the ``gguf`` package's ``GGUFWriter``, not
with llama.cpp's ``convert_hf_to_gguf.py``: that converter reads a tokenizer only as SentencePiece, a Llama
HF tokenizer or a byte-level BPE whose pre-tokenizer it recognises by hash, and kvbench's word-level
tokenizer (``reference_engine.tokenizer``) is none of those. The tensors follow the converter's layout for
the ``llama`` architecture exactly: HF names mapped to GGUF names (``blk.N.attn_q.weight`` ...), q and k
(weights and biases) permuted from HF's rotate-half RoPE order to llama.cpp's interleaved pairs, 1-D tensors
(norms, biases) kept float32 in every dtype, the 2-D ones in ``dtype``.

Tokenizer: llama.cpp has no word-level tokenizer type. The one that reproduces kvbench's is the unigram
("UGM", ``tokenizer.ggml.model = "t5"``) with no precompiled character map: it prepends a ``▁`` to each run
of text between special tokens, turns every space into ``▁``, and picks by Viterbi the segmentation of
largest total score, an unknown code point costing ``min score - 10``. Every ordinary token is a whole word
``▁t<id>`` at score 0 and no other piece exists, so a text of ``t<id>`` words separated by single spaces
has exactly one segmentation without unknowns: the HF tokenizer's ids. Decoding maps ``▁`` back to a
space and drops the first token's leading one, as HF's Metaspace decoder does (llama-server's
``/detokenize`` keeps that first space). Where they differ (measured with llama.cpp's ``llama-tokenize``;
``scripts/llamacpp_agreement.py`` compares through the server) is text that is not such words: llama.cpp
cuts a word that starts with a known word and goes on (``t12x``: ``t12`` then unk) where HF reads the whole
word as unk, reads consecutive unknown words as one unk (HF: one each), and gives a text that starts with a
space (at the start or after a special token) one more unk. Special tokens (``<|pad|>``, ``<|bos|>``,
``<|eos|>``) are CONTROL tokens, read from text where the server parses specials; the unknown id is HF's
``unk_token`` (kvbench: the pad id). Nothing is added on encode (no BOS, no EOS), as in HF.

Cache: beside the checkpoint, in ``<parent>/<name>-gguf/`` (where the parent is not writable: under
``$KVBENCH_CACHE/gguf/``), as ``<name>-<dtype>-<digest>.gguf``, the digest covering this module's source and
the checkpoint's config, tokenizer and weight files (name, size, mtime), so a change to either never reuses
a stale file. The same file-lock and stage-and-rename contract as :mod:`kvbench.models.builtin`: one
process writes it under ``<target>.lock``, the others wait and find it complete, and no reader sees half a
file. Weights are read with safetensors (never unpickled).

Reduced precision on llama.cpp's CPU backend: it multiplies an f16 weight by activations rounded to f16
(F16C), a bf16 weight by activations rounded to bf16 (AVX2 path; AVX512-BF16 where present), both
accumulating in float32. Both ``float16`` and ``bfloat16`` are written; note that llama-server's KV cache is
f16 by default whatever the weights (``--cache-type-k/-v f32`` for a float32 comparison).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.core.cache import cache_root

DTYPES = ("float32", "float16", "bfloat16")
#: how long a process waits for another one writing the same GGUF file (small: seconds)
LOCK_TIMEOUT_S = 600.0
METASPACE = "\u2581"
#: HF tensor name (after ``model.layers.N.``) -> GGUF name (after ``blk.N.``), the llama architecture's map
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.down_proj.bias": "ffn_down.bias",
}
GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}


class UnsupportedCheckpoint(ValueError):
    """The checkpoint is not one this converter writes; the message names what is unsupported."""


def gguf_checkpoint(model_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """The GGUF file of the Llama checkpoint in ``model_dir`` with its 2-D tensors in ``dtype`` (one of
    :data:`DTYPES`), converted on first use and cached (module docstring: where, and the lock contract).
    ValueError naming ``dtype`` for another value; :class:`UnsupportedCheckpoint` naming the field for a
    checkpoint it cannot convert (not LlamaForCausalLM, RoPE scaling, another activation or tokenizer)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: expected one of {list(DTYPES)}")
    src = Path(model_dir).resolve()
    config = _read_config(src)
    _check_supported(src, config)
    target = _target(src, dtype)
    if target.is_file():  # the common case: no lock touched
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=LOCK_TIMEOUT_S):
        if target.is_file():  # written by another process while we waited
            return target
        fd, staging = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".part", dir=target.parent)
        os.close(fd)
        try:
            write_gguf(src, Path(staging), dtype)
            os.replace(staging, target)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
    return target


def _fingerprint(src: Path) -> str:
    digest = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode())
    for name in ("config.json", "tokenizer.json"):
        path = src / name
        digest.update(path.read_bytes() if path.is_file() else b"-")
    for path in sorted(src.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:10]


def _target(src: Path, dtype: str) -> Path:
    name = f"{src.name}-{dtype}-{_fingerprint(src)}.gguf"
    beside = src.parent / f"{src.name}-gguf"
    if os.access(beside if beside.is_dir() else src.parent, os.W_OK):
        return beside / name
    # a read-only checkpoint (someone's model store): keyed by its path as well, in kvbench's own cache
    return cache_root() / "gguf" / hashlib.sha256(str(src).encode()).hexdigest()[:10] / name


def _read_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if not path.is_file():
        raise UnsupportedCheckpoint(f"{src}: no config.json (a Hugging Face checkpoint directory is expected)")
    return json.loads(path.read_text())


def _check_supported(src: Path, config: dict[str, Any]) -> None:
    archs = config.get("architectures") or []
    if archs != ["LlamaForCausalLM"] and config.get("model_type") != "llama":
        raise UnsupportedCheckpoint(f"{src}: architectures={archs} (model_type={config.get('model_type')!r}) is "
                                    "unsupported: only LlamaForCausalLM is converted")
    rope = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or \
        (config.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedCheckpoint(f"{src}: rope_type={rope_type!r} is unsupported: only unscaled RoPE is converted")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"{src}: hidden_act={config['hidden_act']!r} is unsupported: expected 'silu'")
    if not any(src.glob("*.safetensors")):
        raise UnsupportedCheckpoint(f"{src}: no *.safetensors weights (pickled weights are never read)")
    read_vocab(src, config)  # raises for a tokenizer it cannot express


def read_vocab(src: Path, config: dict[str, Any]) -> tuple[list[str], list[int], int]:
    """(token strings by id, GGUF token types by id, unknown id) of the checkpoint's word-level tokenizer,
    ``vocab_size`` entries. UnsupportedCheckpoint naming the field for a tokenizer llama.cpp's unigram
    tokenizer would not reproduce (another model type, pre-tokenizer or replacement character)."""
    from gguf import TokenType

    path = src / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedCheckpoint(f"{src}: no tokenizer.json")
    spec = json.loads(path.read_text())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "WordLevel":
        raise UnsupportedCheckpoint(f"{path}: model.type={model.get('type')!r} is unsupported: this converter "
                                    "writes kvbench's WordLevel tokenizer (use llama.cpp's convert_hf_to_gguf.py "
                                    "for a SentencePiece or BPE one)")
    if pre.get("type") != "Metaspace" or pre.get("replacement") != METASPACE \
            or pre.get("prepend_scheme") != "always":
        raise UnsupportedCheckpoint(f"{path}: pre_tokenizer={pre} is unsupported: expected Metaspace with "
                                    f"replacement {METASPACE!r} and prepend_scheme 'always'")
    if spec.get("normalizer"):
        raise UnsupportedCheckpoint(f"{path}: normalizer={spec['normalizer']} is unsupported: expected none")
    vocab_size = int(config["vocab_size"])
    tokens: list[str | None] = [None] * vocab_size
    types = [int(TokenType.UNUSED)] * vocab_size
    for text, token_id in model["vocab"].items():
        if not 0 <= token_id < vocab_size:
            raise UnsupportedCheckpoint(f"{path}: token {text!r} has id {token_id}, outside vocab_size={vocab_size}")
        tokens[token_id], types[token_id] = text, int(TokenType.NORMAL)
    for added in spec.get("added_tokens") or []:
        token_id = added["id"]
        if not 0 <= token_id < vocab_size:
            raise UnsupportedCheckpoint(f"{path}: added token {added['content']!r} has id {token_id}, "
                                        f"outside vocab_size={vocab_size}")
        tokens[token_id] = added["content"]
        types[token_id] = int(TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED)
    unk_text = model.get("unk_token")
    unk = model["vocab"].get(unk_text) if unk_text is not None else None
    if unk is None:
        raise UnsupportedCheckpoint(f"{path}: model.unk_token={unk_text!r} is not in the vocabulary: llama.cpp's "
                                    "unigram tokenizer needs an unknown token")
    # ids the tokenizer never produces still need a unique string in GGUF
    out = [text if text is not None else f"[UNUSED{i}]" for i, text in enumerate(tokens)]
    return out, types, unk


def _hf_tensors(src: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def permute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """q or k (weight ``[n_head * head_dim, in]`` or bias ``[n_head * head_dim]``) from HF's rotate-half order
    (pairs ``(i, i + head_dim/2)``) to llama.cpp's interleaved order (pairs ``(2i, 2i + 1)``), per head: the
    permutation ``convert_hf_to_gguf.py`` applies to Llama's q and k."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(model_dir: str | os.PathLike, out_path: str | os.PathLike, dtype: str = "float32") -> Path:
    """Convert the checkpoint in ``model_dir`` into the GGUF file ``out_path`` (uncached; see
    :func:`gguf_checkpoint`). Returns ``out_path``."""
    import gguf
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: expected one of {list(DTYPES)}")
    src = Path(model_dir)
    config = _read_config(src)
    _check_supported(src, config)
    tokens, types, unk = read_vocab(src, config)
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // n_head
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)

    writer = gguf.GGUFWriter(str(out_path), arch="llama")
    writer.add_name(src.name)
    writer.add_file_type({"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                          "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))

    writer.add_tokenizer_model("t5")  # llama.cpp's unigram (UGM) tokenizer: see the module docstring
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_add_space_prefix(True)
    writer.add_remove_extra_whitespaces(False)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_unk_token_id(unk)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            add(value)

    hf = _hf_tensors(src)
    if config.get("tie_word_embeddings") and "lm_head.weight" in hf:
        del hf["lm_head.weight"]  # tied: llama.cpp reuses token_embd, as the converter leaves it out
    qtype = {"float32": gguf.GGMLQuantizationType.F32, "float16": gguf.GGMLQuantizationType.F16,
             "bfloat16": gguf.GGMLQuantizationType.BF16}[dtype]
    for hf_name, tensor in hf.items():
        name = _gguf_name(hf_name, src)
        data = tensor.to(torch.float32).numpy()
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            data = permute_rope(data, n_head)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            data = permute_rope(data, n_kv)
        if data.ndim <= 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, np.ascontiguousarray(data.astype(np.float16)))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


def _gguf_name(hf_name: str, src: Path) -> str:
    if hf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LAYER_TENSORS:
        return f"blk.{int(parts[2])}.{LAYER_TENSORS[parts[3]]}"
    raise UnsupportedCheckpoint(f"{src}: tensor {hf_name!r} is unsupported: not part of a LlamaForCausalLM")
