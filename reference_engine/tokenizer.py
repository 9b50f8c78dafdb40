"""A word-level tokenizer for the seeded random checkpoints, so text goes in and out of them.

The random checkpoints have no natural language, so their tokenizer only has to be exact and
readable: every ordinary id ``i`` is the word ``t<i>``, and the special ids are ``<|pad|>``,
``<|bos|>`` and ``<|eos|>`` (the ids ``config.json`` names). The vocabulary covers exactly
``vocab_size`` ids, no more and no fewer.

Contracts (tested in ``tests/engine/test_tokenizer.py``):

* ``encode(decode(ids)) == ids`` for any sequence of ordinary ids: words are separated by single
  spaces (the Metaspace scheme: each token carries a leading ``▁`` that decodes to a space, and the
  first one's is dropped), and text is split on whitespace before words are looked up, so
  concatenated words can never be read another way.
* Special tokens are matched before splitting and their strings start with ``<|``, which no
  ordinary word does, so ``<|eos|>`` can never be read as (part of) an ordinary token.
* Any text encodes: a word outside the vocabulary (``Hello``) reads as the pad id, the tokenizer's
  ``unk_token``, as real tokenizers map text they do not know to their unknown token. A server's users
  send such text (health probes, load generators, a quick ``curl``), and a random model has no words to
  lose. Ordinary ids still round-trip exactly; only text that is not ``t<id>`` words is lossy.
* Nothing is added on encode (no BOS): ids in, the same ids out. Prompts that want a BOS write
  ``<|bos|>`` themselves.

Written as ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``) plus ``tokenizer_config.json``
and ``special_tokens_map.json`` so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it too.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
METASPACE = "▁"  # U+2581, SentencePiece's word-boundary mark
SPECIAL_NAMES = {"pad_token_id": "<|pad|>", "bos_token_id": "<|bos|>", "eos_token_id": "<|eos|>"}


def ordinary_word(token_id: int) -> str:
    """The text of ordinary token ``token_id`` (without the separating space)."""
    return f"t{token_id}"


def special_tokens(config: dict) -> dict[int, str]:
    """``{id: string}`` of the special ids that ``config`` (a ``config.json`` dict) names."""
    out: dict[int, str] = {}
    for key, text in SPECIAL_NAMES.items():
        ids = config.get(key)
        for token_id in ids if isinstance(ids, list) else [ids]:
            if isinstance(token_id, int):
                out.setdefault(token_id, text)
    return out


def build_tokenizer(config: dict) -> Tokenizer:
    """The tokenizer for a checkpoint whose ``config.json`` dict is ``config`` (reads vocab_size and
    the pad/bos/eos ids). Raises ``ValueError`` if a special id lies outside the vocabulary."""
    vocab_size = config["vocab_size"]
    specials = special_tokens(config)
    bad = sorted(i for i in specials if not 0 <= i < vocab_size)
    if bad:
        raise ValueError(f"special token ids {bad} lie outside vocab_size={vocab_size}")
    vocab = {specials.get(i, METASPACE + ordinary_word(i)): i for i in range(vocab_size)}
    unk = specials.get(config.get("pad_token_id")) if isinstance(config.get("pad_token_id"), int) else None
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    # Added tokens are matched in the raw text before pre-tokenization, so "<|eos|>" needs no spaces.
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for _, text in sorted(specials.items())])
    return tok


def write_tokenizer(out_dir: str | pathlib.Path, config: dict) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
    ``out_dir`` (byte-identical for the same config)."""
    out = pathlib.Path(out_dir)
    tok = build_tokenizer(config)
    # tokenizers writes its JSON with sorted vocab already; pretty=False keeps the file small.
    (out / TOKENIZER_FILE).write_text(tok.to_str(pretty=False) + "\n")
    specials = special_tokens(config)
    names = {key.removesuffix("_id"): specials[config[key]] for key in SPECIAL_NAMES
             if isinstance(config.get(key), int) and config[key] in specials}
    if "pad_token" in names:
        names["unk_token"] = names["pad_token"]  # what unknown words read as (see the module docstring)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.get("max_position_embeddings", 2048),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **names,
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps(names, indent=2, sort_keys=True) + "\n")
