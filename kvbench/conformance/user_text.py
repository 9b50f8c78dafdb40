"""The text a user should read for an output: what its token ids decode to after the prompt, by the
checkpoint's own ``tokenizer.json``, special tokens left out (as vLLM and the reference server write text
by default: ``skip_special_tokens``).

The ids are decoded in the prompt's context, as a server's incremental detokenizer does (vLLM primes its
decode stream with the prompt): a word-level or sentencepiece token writes the space before itself, and
the output's first token does so too, since it does not begin the text. The whole prompt is the context,
not a window of it, so the oracle stands apart from any server's windowing. Where the prompt's own text
ends inside a character that the output completes, no text belongs to the output alone:
:meth:`CheckpointText.after` says so (None) rather than guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class CheckpointText:
    """The text of outputs by the tokenizer of the checkpoint in ``model_dir``; FileNotFoundError naming
    the file when it has none."""

    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: the text a server writes cannot be checked without "
                                    "the checkpoint's tokenizer")
        from tokenizers import Tokenizer

        self._tokenizer: Any = Tokenizer.from_file(str(path))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def after(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str | None:
        """The text ``output_ids`` add after ``prompt_ids``; None when the prompt's text does not stand on
        its own (it ends in an unfinished character, or the output changes it)."""
        base = self.decode(prompt_ids)
        full = self.decode([*prompt_ids, *output_ids])
        if base.endswith("\ufffd") or not full.startswith(base):
            return None
        return full[len(base):]
