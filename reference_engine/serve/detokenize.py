"""Text in and out of token ids with the checkpoint's own ``tokenizer.json``.

Output text is decoded incrementally as vLLM does: the text of output tokens is the part of
``decode(context + output)`` after ``decode(context)``, where ``context`` is the last few prompt
tokens. That keeps the spaces and merges a tokenizer puts *between* tokens (the first output token's
leading space, for one), so ``prompt text + completion text`` re-tokenises to prompt + output ids.

A stream (:class:`TextStream`) reaches the same text without decoding the whole output on every chunk:
re-decoding it made a request's detokenizing O(n^2) in its length, and the server does it for every
token of every request. It decodes a small window (the tokens of the previous emission plus the new
ones) and holds back text that ends in an incomplete character (``"\\ufffd"``) until a later token
completes it, as vLLM's ``detokenize_incrementally``.

::

    filtered ids:   ... | t3  t4 | t5  t6 |
                          ^prefix  ^read   ^end
    delta = decode(t3..t6)[len(decode(t3 t4)):]      then prefix := read, read := end
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer

log = logging.getLogger("reference_engine.serve")

CONTEXT_TOKENS = 4  # enough for the merges of common tokenizers at a token boundary (vLLM uses 5)
INCOMPLETE = "\ufffd"  # what a decoder writes for the bytes of a character that has not ended yet

#: Decoders whose text for a token depends at most on the token before it and on whether it is the first
#: one (Hugging Face ``tokenizers`` applies each of these token by token, or over bytes, as ByteLevel does).
#: A window of the previous emission's tokens therefore decodes the new tokens exactly as the whole output
#: would. ByteFallback is local only between runs of byte tokens (``<0x..>``): a run that is not valid UTF-8
#: decodes to one replacement character per byte, so a later byte can change the text of earlier ones, and
#: a stream holds back the text of a run until a token that is not a byte ends it. Others (CTC merges repeats
#: across tokens; any type added later) decode the whole output per chunk instead.
LOCAL_DECODERS = frozenset({"Metaspace", "ByteLevel", "ByteFallback", "Fuse", "Strip", "Replace", "WordPiece",
                            "BPEDecoder"})
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    """The decoder types in a ``tokenizer.json`` ``decoder`` entry, those of a ``Sequence`` included."""
    if decoder is None:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(decoder_types(d) for d in decoder.get("decoders", ())))
    return {str(decoder.get("type"))}


def decoder_is_local(decoder: dict[str, Any] | None) -> bool:
    """Whether a ``tokenizer.json`` ``decoder`` entry (None: tokens joined by spaces) decodes windows exactly."""
    return decoder_types(decoder) <= LOCAL_DECODERS


class TextCodec:
    """Encode prompts and decode outputs; a model directory without ``tokenizer.json`` gets ``None``
    from :func:`load_codec`, and the server then accepts token-id prompts only and returns empty text.

    ``incremental``: whether :class:`TextStream` may decode windows (the decoder is local, see
    :data:`LOCAL_DECODERS`); a stream that finds otherwise turns it off, and every later stream decodes
    the whole output per chunk."""

    def __init__(self, tokenizer: Tokenizer, incremental: bool | None = None):
        self.tokenizer = tokenizer
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        self.incremental = decoder_is_local(decoder) if incremental is None else incremental
        #: ids whose text a later token can still change (ByteFallback's byte tokens); a stream holds them back
        self.byte_ids = frozenset(i for t, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.fullmatch(t)) \
            if "ByteFallback" in decoder_types(decoder) else frozenset()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, adding nothing (no BOS). Raises ``ValueError`` if the tokenizer cannot
        encode it (e.g. a word outside a word-level vocabulary)."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except Exception as e:  # tokenizers raises a bare Exception
            raise ValueError(str(e)) from e

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out (so ``decode(ids)`` is that of ``ids`` without them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def continuation(self, prompt_ids: list[int], output_ids: list[int]) -> str:
        """The text ``output_ids`` add after ``prompt_ids``."""
        return self.after(prompt_ids)(output_ids)

    def after(self, prompt_ids: list[int]) -> Callable[[list[int]], str]:
        """``continuation`` with ``prompt_ids`` fixed: the context's own text is decoded once, not
        once per call."""
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        base = self.decode(context)

        def text_of(output_ids: list[int]) -> str:
            full = self.decode(context + output_ids)
            return full[len(base):] if full.startswith(base) else full

        return text_of

    def stream(self, prompt_ids: list[int]) -> TextStream:
        """A :class:`TextStream` of the output that follows ``prompt_ids``."""
        return TextStream(self, prompt_ids)


class TextStream:
    """The text of a growing output as deltas: ``push(new_ids)`` for each chunk, ``finish()`` once at the end.

    Contract: the deltas of all ``push`` calls and of ``finish`` concatenate to exactly
    ``codec.continuation(prompt_ids, all output ids)`` (whenever that text begins with what was pushed out
    before, which it does for every local decoder: :data:`LOCAL_DECODERS`). A ``push`` never returns text
    ending in ``"\\ufffd"`` that a later token could still turn into a character: that text waits for the
    next push, or for ``finish``, which returns whatever is left, incomplete or not. ``text`` is what the
    deltas returned so far add up to.

    Where windows cannot be trusted (``codec.incremental`` off, or a prompt whose context text itself ends
    in an incomplete character) each push decodes the whole output, as the server did before streams had
    windows (holding back an incomplete end all the same). A window whose text is not continued by the
    next one (a decoder is not local after all) switches this stream to that, and ``finish`` turns
    ``codec.incremental`` off if the final text does not continue what was sent.
    """

    def __init__(self, codec: TextCodec, prompt_ids: list[int]):
        self._codec = codec
        self._full_text = codec.after(prompt_ids)
        self._output: list[int] = []
        self.text = ""
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        # Special tokens decode to nothing, so they are left out of the window: a window of only specials
        # would decode the next token as a first token (Metaspace drops its leading space).
        self._window = [t for t in context if t not in codec.special_ids]
        # A context that ends in an unfinished character (or byte run) may be finished by the output, and
        # the whole text then does not begin with the context's: no window can say what it does.
        self._windowed = codec.incremental and not codec.decode(context).endswith(INCOMPLETE) \
            and not (self._window and self._window[-1] in codec.byte_ids)
        self._read = len(self._window)  # window[:read] was emitted (or is context); window[read:] waits
        self._read_text: str | None = None  # decode(window[:read]), once per emission
        self._last: int | None = None  # the output's last token that is not special

    def push(self, new_ids: Sequence[int]) -> str:
        """The text ``new_ids`` (the output's next tokens) add, less an incomplete character at its end."""
        self._output.extend(new_ids)
        specials = self._codec.special_ids
        kept = [t for t in new_ids if t not in specials]
        if kept:
            self._last = kept[-1]
        if not self._windowed:
            return self._push_full()
        if not kept:
            return ""
        self._window.extend(kept)
        if self._read_text is None:
            self._read_text = self._codec.decode(self._window[:self._read])
        text = self._codec.decode(self._window)
        if not text.startswith(self._read_text):  # the window changed text it had already decoded
            self._windowed = False
            return self._push_full()
        if len(text) == len(self._read_text) or text.endswith(INCOMPLETE) or self._last in self._codec.byte_ids:
            return ""  # nothing new yet, or a character (a byte run) still to be completed by a later token
        delta = text[len(self._read_text):]
        self._window = self._window[self._read:]  # the tokens just emitted are the next window's context
        self._read, self._read_text = len(self._window), None
        self.text += delta
        return delta

    def finish(self, new_ids: Sequence[int] = ()) -> str:
        """The rest of the text, with that of ``new_ids`` (the output's last tokens, if any) and the
        characters held back; call once, after the last ``push``. One whole decode of the output."""
        self._output.extend(new_ids)
        full = self._full_text(self._output)
        if self._windowed and not full.startswith(self.text):
            log.warning("incremental detokenizing sent text the whole output does not begin with (%r...): "
                        "decoding whole outputs from now on", self.text[:40])
            self._codec.incremental = False
        return self._emit_full(full)

    def _push_full(self) -> str:
        full = self._full_text(self._output)
        if full.endswith(INCOMPLETE) or self._last in self._codec.byte_ids:
            return ""
        return self._emit_full(full)

    def _emit_full(self, full: str) -> str:
        """The delta from ``text`` to ``full``: its new end, or all of it where it does not continue ``text``."""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta


def load_codec(model_dir: str | pathlib.Path) -> TextCodec | None:
    """The codec of ``model_dir``'s ``tokenizer.json``, or None where it has none."""
    path = pathlib.Path(model_dir) / "tokenizer.json"
    return TextCodec(Tokenizer.from_file(str(path))) if path.is_file() else None
