"""Text in and out of token ids with the checkpoint's own ``tokenizer.json``.

Output text is decoded incrementally as vLLM does: the text of output tokens is the part of
``decode(context + output)`` after ``decode(context)``, where ``context`` is the last few prompt
tokens. That keeps the spaces and merges a tokenizer puts *between* tokens (the first output token's
leading space, for one), so ``prompt text + completion text`` re-tokenises to prompt + output ids.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from tokenizers import Tokenizer

CONTEXT_TOKENS = 4  # enough for the merges of common tokenizers at a token boundary (vLLM uses 5)


class TextCodec:
    """Encode prompts and decode outputs; a model directory without ``tokenizer.json`` gets ``None``
    from :func:`load_codec`, and the server then accepts token-id prompts only and returns empty text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, adding nothing (no BOS). Raises ``ValueError`` if the tokenizer cannot
        encode it (e.g. a word outside a word-level vocabulary)."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except Exception as e:  # tokenizers raises a bare Exception
            raise ValueError(str(e)) from e

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def continuation(self, prompt_ids: list[int], output_ids: list[int]) -> str:
        """The text ``output_ids`` add after ``prompt_ids``."""
        return self.after(prompt_ids)(output_ids)

    def after(self, prompt_ids: list[int]) -> Callable[[list[int]], str]:
        """``continuation`` with ``prompt_ids`` fixed: the context's own text is decoded once, not
        once per streamed chunk (the server calls this per step of every request)."""
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        base = self.decode(context)

        def text_of(output_ids: list[int]) -> str:
            full = self.decode(context + output_ids)
            return full[len(base):] if full.startswith(base) else full

        return text_of


def load_codec(model_dir: str | pathlib.Path) -> TextCodec | None:
    path = pathlib.Path(model_dir) / "tokenizer.json"
    return TextCodec(Tokenizer.from_file(str(path))) if path.is_file() else None
