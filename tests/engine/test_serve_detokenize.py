"""Streamed text (``TextStream``): window by window, exactly the whole output's text, never half a character.

The tokenizers here are built in memory: the tiny checkpoint's word-level one (Metaspace), a byte-level BPE
trained on multi-byte text (most characters split across tokens), a Llama-style byte-fallback one
(Replace, ByteFallback, Fuse, Strip), a WordPiece one, and one with a CTC decoder (not local: whole decodes).
"""

from __future__ import annotations

import itertools
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from reference_engine.outputs import RequestOutput
from reference_engine.serve import app
from reference_engine.serve.detokenize import INCOMPLETE, TextCodec, decoder_is_local, load_codec
from reference_engine.serve.protocol import CompletionRequest

CORPUS = ["héllo wörld ✓ naïve café 東京 😀 日本語のテキスト", "plain ascii words here", "emoji 😀😃 and ✓✓ marks"] * 20
CHECK = "✓"  # three bytes: E2 9C 93


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


BYTE_FALLBACK_WORDS = ["▁hello", "▁world", "▁caf", "é", "▁", "▁t", "he", "▁the"]


def _byte_token(b: int) -> int:
    return 3 + b  # the byte-fallback vocabulary: <unk>, <s>, </s>, then <0x00>..<0xFF>


def _byte_fallback() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": _byte_token(b) for b in range(256)}}
    for word in BYTE_FALLBACK_WORDS:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


def _word_piece(decoder=None) -> Tokenizer:
    words = ["[UNK]", "[CLS]", "the", "##s", "cat", "##ty", ".", ",", "a", "##é", "✓"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.decoder = decoder if decoder is not None else decoders.WordPiece(cleanup=True)
    tok.add_special_tokens([AddedToken("[CLS]", special=True)])
    return tok


@pytest.fixture(scope="module")
def codecs(tiny_ckpt: str) -> dict[str, TextCodec]:
    return {"word_level": load_codec(tiny_ckpt), "byte_level": TextCodec(_byte_level()),
            "byte_fallback": TextCodec(_byte_fallback()), "word_piece": TextCodec(_word_piece()),
            "ctc": TextCodec(_word_piece(decoders.CTC()))}


def _stream(codec: TextCodec, prompt: list[int], chunks: list[list[int]]) -> list[str]:
    stream = codec.stream(prompt)
    deltas = [stream.push(chunk) for chunk in chunks[:-1]]
    return [*deltas, stream.finish(chunks[-1])]


def _chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in itertools.pairwise(bounds)] or [[]]


@pytest.mark.parametrize("name", ["word_level", "byte_level", "byte_fallback", "word_piece", "ctc"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streamed_deltas_concatenate_to_the_whole_outputs_text(codecs, name: str, data) -> None:
    codec = codecs[name]
    vocab = codec.tokenizer.get_vocab_size(with_added_tokens=True)
    ids = st.integers(0, vocab - 1)
    prompt = data.draw(st.lists(ids, min_size=1, max_size=8), "prompt")
    output = data.draw(st.lists(ids, max_size=40), "output")
    cuts = data.draw(st.lists(st.integers(0, 40), max_size=12), "cuts")
    deltas = _stream(codec, prompt, [*_chunked(output, cuts), []])
    assert "".join(deltas) == codec.continuation(prompt, output)
    assert codec.incremental == (name != "ctc")  # no stream found a local decoder wrong


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_no_push_ends_in_half_a_character(codecs, name: str, data) -> None:
    """Multi-byte characters split across tokens: a push never sends the replacement character a later token
    would have turned into a character (text that ends in one is held back)."""
    codec = codecs[name]
    text = data.draw(st.text(alphabet="aé ✓東😀", min_size=1, max_size=12), "text")
    output = codec.encode(text)
    prompt = codec.encode("hello")
    chunks = [[t] for t in output]
    deltas = _stream(codec, prompt, [*chunks, []])
    assert "".join(deltas) == codec.continuation(prompt, output)
    assert all(not d.endswith(INCOMPLETE) for d in deltas[:-1]), deltas


def _byte_level_byte(codec: TextCodec, b: int) -> int:
    """The byte-level BPE's token of the single byte ``b`` (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {c: chr(c) for c in printable} | {c: chr(256 + n) for n, c in enumerate(
        c for c in range(256) if c not in printable)}
    return codec.tokenizer.token_to_id(chars[b])


def test_a_character_in_three_byte_tokens_is_sent_whole_with_its_last_byte(codecs) -> None:
    codec = codecs["byte_level"]
    stream = codec.stream(codec.encode("hello"))
    e2, x9c, x93 = (_byte_level_byte(codec, b) for b in CHECK.encode())
    assert [stream.push([e2]), stream.push([x9c]), stream.push([x93])] == ["", "", CHECK]
    assert stream.finish() == ""
    # the whole output's text, cut after two of the three bytes, ends in the replacement character: that is
    # what sending the whole text so far (as before windows) would have streamed, and then sent again
    assert codec.continuation(codec.encode("hello"), [e2, x9c]).endswith(INCOMPLETE)


def test_a_byte_fallback_run_waits_for_the_token_that_ends_it(codecs) -> None:
    """A run of byte tokens that is not valid UTF-8 decodes to a replacement character per byte, so even a
    complete character can turn into replacement characters with the next byte: the run waits."""
    codec = codecs["byte_fallback"]
    hello, world = (BYTE_FALLBACK_WORDS.index(w) + 3 + 256 for w in ("▁hello", "▁world"))
    stream = codec.stream([hello])
    e2, x9c, x93 = (_byte_token(b) for b in CHECK.encode())
    assert [stream.push([e2]), stream.push([x9c]), stream.push([x93]), stream.push([world])] == \
        ["", "", "", CHECK + " world"]
    nul = _byte_token(0)
    assert codec.continuation([hello], [nul]) == "\x00"
    assert codec.continuation([hello], [nul, _byte_token(0x80)]) == INCOMPLETE * 2  # the valid byte, undone
    stream = codec.stream([hello])
    assert stream.push([nul]) == "" and stream.push([_byte_token(0x80)]) == "" and stream.finish() == INCOMPLETE * 2


def test_finish_sends_an_incomplete_character_that_never_completed(codecs) -> None:
    codec = codecs["byte_fallback"]
    e2, x9c, _ = (_byte_token(b) for b in CHECK.encode())
    stream = codec.stream([1])
    assert stream.push([e2, x9c]) == ""
    assert stream.finish() == codec.continuation([1], [e2, x9c]) == INCOMPLETE * 2  # the held-back end, as is


def test_a_special_only_window_keeps_the_next_tokens_space(codecs) -> None:
    """Metaspace drops the first token's space: a window of only special tokens must not make a later token
    a 'first' one (the whole text has ordinary tokens before it)."""
    codec = codecs["word_level"]
    eos = 2
    deltas = _stream(codec, [10, 11], [[12], [eos], [eos], [eos], [eos], [eos], [13], []])
    assert deltas[-2] == " t13" and "".join(deltas) == codec.continuation([10, 11], [12] + [eos] * 5 + [13])


class _Counting(TextCodec):
    """A codec that records the length of every id list it decodes."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer)
        self.decoded: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.decoded.append(len(ids))
        return super().decode(ids)


class _LengthSensitive(_Counting):
    """A decoder that is not local in a way no window shows: in texts of more than 6 tokens, t1x reads T1x."""

    def decode(self, ids: list[int]) -> str:
        text = super().decode(ids)
        return text.replace(" t1", " T1") if len(ids) > 6 else text


def test_a_decoder_that_proves_not_local_turns_windows_off(tiny_ckpt: str) -> None:
    codec = _LengthSensitive(load_codec(tiny_ckpt).tokenizer)
    assert codec.incremental
    prompt, output = [5, 6], list(range(10, 20))
    deltas = _stream(codec, prompt, [[t] for t in output] + [[]])
    assert deltas[-1] == codec.continuation(prompt, output)  # as before windows: the whole text, sent again
    assert not codec.incremental
    codec.decoded.clear()
    _stream(codec, prompt, [[t] for t in output] + [[]])
    assert codec.decoded[-len(output) - 1:] == [len(prompt) + n for n in [*range(1, len(output) + 1), len(output)]]


def test_pushes_decode_windows_not_the_whole_output(tiny_ckpt: str) -> None:
    """The point of windows: a push's cost does not grow with the output (one whole decode at finish)."""
    codec = _Counting(load_codec(tiny_ckpt).tokenizer)
    stream = codec.stream([5, 6, 7, 8, 9])
    for t in range(10, 210):
        stream.push([t])
    assert max(codec.decoded) <= 5
    stream.finish()
    assert max(codec.decoded) == 4 + 200


def test_decoders_known_to_be_local() -> None:
    assert decoder_is_local(None) and decoder_is_local({"type": "Metaspace"})
    assert decoder_is_local({"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]})
    assert not decoder_is_local({"type": "CTC"})
    assert not decoder_is_local({"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "CTC"}]})


def test_renderer_streamed_text_is_the_non_streamed_text_with_multi_byte_characters(codecs) -> None:
    codec = codecs["byte_level"]
    prompt = codec.encode("café")
    output = codec.encode(" 東京 ✓😀 naïve")
    final = RequestOutput("r", prompt, output, True, "length", 0, 0, 0, None)
    whole = app._Renderer(CompletionRequest(prompt=prompt, max_tokens=64), prompt, codec)
    text = whole.choice_fields(output, final, final=True)["text"]
    assert text == " 東京 ✓😀 naïve"
    streamed = app._Renderer(CompletionRequest(prompt=prompt, max_tokens=64, stream=True), prompt, codec)
    deltas = [streamed.choice_fields([t], RequestOutput("r", prompt, output[:i + 1], False, None, 0, 0, 0, None),
                                     final=False)["text"] for i, t in enumerate(output[:-1])]
    deltas.append(streamed.choice_fields(output[-1:], final, final=True)["text"])
    assert "".join(deltas) == text and INCOMPLETE not in "".join(deltas)


def test_load_codec_of_a_directory_without_a_tokenizer(tmp_path: pathlib.Path) -> None:
    assert load_codec(tmp_path) is None
