"""The built-in checkpoints' tokenizer: exact round trips, loadable by both libraries, unambiguous specials."""

from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvbench.models.random_llama import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_config, write_checkpoint
from reference_engine.tokenizer import TOKENIZER_FILE, build_tokenizer

VOCAB = 512
FIRST_ORDINARY = EOS_TOKEN_ID + 1


@pytest.fixture(scope="module")
def tok(tiny_ckpt: str) -> Tokenizer:
    return Tokenizer.from_file(str(pathlib.Path(tiny_ckpt) / TOKENIZER_FILE))


def test_checkpoint_ships_tokenizer_files(tiny_ckpt: str) -> None:
    d = pathlib.Path(tiny_ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (d / name).is_file(), name
    assert json.loads((d / "config.json").read_text())["vocab_size"] == VOCAB


def test_vocab_covers_exactly_the_checkpoint_vocab(tok: Tokenizer) -> None:
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    assert sorted(tok.get_vocab().values()) == list(range(VOCAB))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(FIRST_ORDINARY, VOCAB - 1), max_size=64))
def test_decode_then_encode_round_trips(tok: Tokenizer, ids: list[int]) -> None:
    text = tok.decode(ids)
    assert tok.encode(text).ids == ids


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(FIRST_ORDINARY, VOCAB - 1), min_size=1, max_size=16),
       st.lists(st.integers(FIRST_ORDINARY, VOCAB - 1), min_size=1, max_size=16))
def test_completion_text_appended_to_prompt_text_round_trips(tok: Tokenizer, prompt: list[int],
                                                             output: list[int]) -> None:
    """What the server returns as completion text (the suffix of decoding prompt + output) appended to the
    prompt's text re-tokenises into prompt + output."""
    prompt_text = tok.decode(prompt)
    completion = tok.decode(prompt + output)[len(prompt_text):]
    assert tok.encode(prompt_text + completion).ids == prompt + output


def test_special_tokens_are_not_prefixes_of_ordinary_tokens(tok: Tokenizer) -> None:
    vocab = {i: tok.id_to_token(i) for i in range(VOCAB)}
    specials = {vocab[i] for i in (PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID)}
    assert specials == {"<|pad|>", "<|bos|>", "<|eos|>"}
    for i, word in vocab.items():
        if word in specials:
            continue
        text = tok.decode([i])
        assert text == f"t{i}"
        assert not any(text.startswith(s) or s.startswith(text) for s in specials)
    assert tok.encode("<|bos|>t5 t6<|eos|>").ids == [BOS_TOKEN_ID, 5, 6, EOS_TOKEN_ID]


def test_any_text_encodes_unknown_words_as_the_unk_token(tok: Tokenizer, tiny_ckpt: str) -> None:
    import json

    pad = json.loads((pathlib.Path(tiny_ckpt) / "config.json").read_text())["pad_token_id"]
    assert tok.encode("Hello world").ids == [pad, pad]
    assert tok.encode("t5 Hello t7").ids == [5, pad, 7]  # known words keep their ids around an unknown one


def test_autotokenizer_loads_it(tiny_ckpt: str, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert len(auto) == VOCAB
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID)
    ids = [7, 300, 511, 3]
    assert auto(tok.decode(ids))["input_ids"] == ids  # no BOS added: ids in, the same ids out
    assert auto.decode([*ids, EOS_TOKEN_ID], skip_special_tokens=True) == tok.decode(ids)


def test_tokenizer_files_are_deterministic(tmp_path: pathlib.Path, tiny_ckpt: str) -> None:
    write_checkpoint(tmp_path, preset="tiny", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (pathlib.Path(tiny_ckpt) / name).read_bytes(), name


def test_special_id_outside_vocab_is_refused() -> None:
    config = build_config("tiny")
    config["vocab_size"] = 2
    with pytest.raises(ValueError, match="outside vocab_size=2"):
        build_tokenizer(config)
