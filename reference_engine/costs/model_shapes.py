"""Model shapes for the simulator: the sizes that decide a step's cost and a request's KV footprint.

A :class:`ModelShape` is read from a Hugging Face ``config.json`` (any Llama-like decoder: the keys
``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``, ``vocab_size``) or taken from a preset. Unlike :mod:`reference_engine.model`
it does not refuse RoPE scaling or other details the engine cannot compute: the simulator computes
nothing, it only needs the sizes.

Presets (from the models' published ``config.json``):

==============  ======  ======  =====  ========  ============  ======  ==========
preset          layers  hidden  heads  kv heads  intermediate  vocab   positions
==============  ======  ======  =====  ========  ============  ======  ==========
llama-3-8b      32      4096    32     8         14336         128256  8192
llama-2-7b      32      4096    32     32        11008         32000   4096
llama-3-70b     80      8192    64     8         28672         128256  8192
==============  ======  ======  =====  ========  ============  ======  ==========
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Llama family: GQA attention, SwiGLU MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
                    "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {self.name!r}: {key}={value!r} is invalid: expected an integer >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    # -- sizes ---------------------------------------------------------------------------------
    def layer_params(self) -> int:
        """Weights of one decoder layer: q, k, v, o projections, the SwiGLU MLP and two norms."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q + kv + o + mlp + 2 * self.hidden_size

    def num_params(self) -> int:
        """Every weight: embeddings, layers, final norm and the LM head (once if tied)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_layers * self.layer_params() + self.hidden_size + head

    def dense_flops_per_token(self) -> int:
        """FLOPs of the layers' matmuls for one token (2 per multiply-add), attention scores excluded."""
        return 2 * self.num_layers * self.layer_params()

    def lm_head_flops(self) -> int:
        """FLOPs of the LM head for one sampled row."""
        return 2 * self.hidden_size * self.vocab_size

    def attention_flops_per_pair(self) -> int:
        """FLOPs of attention for one (query token, key token) pair over all layers: QK^T and PV."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token keeps in the cache, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.num_params() * dtype_bytes

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def from_config_dict(cls, cfg: dict, name: str = "config.json") -> ModelShape:
        """From a Hugging Face ``config.json`` dict; a missing key is a ValueError naming it."""
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"{name}: missing key(s) {missing} (a Llama-like config.json has them)")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(name=name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads") or heads, intermediate_size=cfg["intermediate_size"],
                   vocab_size=cfg["vocab_size"], max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                   head_dim=cfg.get("head_dim") or 0, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   eos_token_ids=eos_ids)


PRESETS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": ModelShape("llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                             intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                             eos_token_ids=(128001,)),
    # meta-llama/Llama-2-7b-hf config.json (no GQA: 32 KV heads)
    "llama-2-7b": ModelShape("llama-2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                             intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
                             eos_token_ids=(2,)),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama-3-70b": ModelShape("llama-3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                              intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192,
                              eos_token_ids=(128001,)),
}


def load_model_shape(spec: str | Path) -> ModelShape:
    """A preset name, a ``config.json`` path, or a model directory holding one. Raises ValueError
    naming the spec and the presets when it is none of these."""
    text = str(spec)
    if text.lower() in PRESETS:
        return PRESETS[text.lower()]
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"model {text!r}: cannot read {path}: {e}") from None
        return ModelShape.from_config_dict(cfg, name=str(path.parent.name or path))
    raise ValueError(f"model {text!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                     "(or a directory holding one)")
