"""A checkpoint whose greedy output reaches EOS at known positions: a built-in one with EOS moved.

A random checkpoint almost never picks its EOS token greedily, so a check of "EOS ends the request" would
depend on luck. :func:`eos_checkpoint` copies a checkpoint with one change: ``eos_token_id`` becomes an
ordinary token ``eos`` that the checkpoint's greedy continuations are known to reach (:func:`pick_eos`
finds one from outputs generated with EOS ignored). The weights are the same bytes, so every greedy
continuation is the same token for token up to the first ``eos``, where it now stops. The tokenizer is
written again for the new ids (``eos``'s text becomes ``<|eos|>``, the old EOS id an ordinary word), so
that a server that reads EOS from its tokenizer (vLLM) and one that reads ``config.json`` (transformers,
the reference engine) agree.

Written once per (source, eos) under ``$KVBENCH_CACHE/checkpoints`` beside the source, under a file
lock, staged and renamed into place (the contract of :mod:`kvbench.models.builtin`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock

from reference_engine.tokenizer import write_tokenizer

#: ids that stay special (pad, bos): never moved onto
RESERVED_IDS = frozenset({0, 1})
LOCK_TIMEOUT_S = 600.0


def first_positions(outputs: Sequence[Sequence[int]], token: int) -> list[int | None]:
    """Where ``token`` first appears in each output (None where it does not)."""
    return [list(out).index(token) if token in out else None for out in outputs]


def pick_eos(outputs: Sequence[Sequence[int]], old_eos: int | None = None, earliest: int = 1) -> int | None:
    """The token whose first appearance falls strictly inside the most ``outputs`` (at ``earliest`` or later,
    before the last token), so that moving EOS onto it ends those requests mid-output; ties go to the smallest
    id. None when no token appears inside any output. ``old_eos`` and the reserved ids are never picked."""
    best: tuple[int, int] | None = None  # (-count, token)
    for token in sorted({t for out in outputs for t in out} - RESERVED_IDS - {old_eos}):
        count = sum(1 for out, at in zip(outputs, first_positions(outputs, token), strict=True)
                    if at is not None and earliest <= at < len(out) - 1)
        if count and (best is None or (-count, token) < best):
            best = (-count, token)
    return None if best is None else best[1]


def eos_checkpoint(source: str | Path, eos: int) -> Path:
    """``source`` with ``eos_token_id`` moved to ``eos`` (see the module docstring); written on first use."""
    source = Path(source)
    config = json.loads((source / "config.json").read_text())
    if not 0 <= eos < config["vocab_size"] or eos in RESERVED_IDS:
        raise ValueError(f"eos={eos} is invalid: expected an ordinary id in [2, {config['vocab_size']})")
    target = source.parent / f"{source.name}-eos{eos}"
    if (target / "config.json").is_file():
        return target
    with FileLock(str(target) + ".lock", timeout=LOCK_TIMEOUT_S):
        if (target / "config.json").is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            for weights in source.glob("*.safetensors"):
                shutil.copyfile(weights, staging / weights.name)
            config["eos_token_id"] = eos
            write_tokenizer(staging, config)
            # config.json last: its presence marks the checkpoint complete
            (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target
