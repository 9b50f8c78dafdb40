"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) read from a Hugging Face checkpoint.

Biases are computed where ``config.json`` asks for them, as transformers and vLLM read a Llama config:
``attention_bias`` on the q, k, v *and* o projections, ``mlp_bias`` on gate, up and down. Every path
carries them: the fused q/k/v and gate/up matmuls concatenate them with their weights
(:meth:`LlamaForCausalLM.fuse_projections`), the packed oneDNN matmuls pass them to their kernel
(:mod:`reference_engine.kernels.cpu_linear`), and the elementwise and attention kernels run after the
matmuls that added them. A checkpoint whose bias tensors disagree with its config is refused
(:func:`load_model`), never computed with zeros.

Weights come from ``*.safetensors`` only (never pickle). Config values this module does not
implement (a ``rope_scaling`` type, another activation, sliding windows) are refused with an
error naming the key, rather than silently computing something else.

Attention is delegated to :func:`reference_engine.attention.paged_attention`, which reads and
writes the paged KV cache; everything else is ordinary dense math on a flat batch of tokens
(``[num_tokens, hidden]``), so one forward pass serves any mix of prefills, chunks and decodes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from reference_engine.attention import AttentionMetadata, paged_attention

SUPPORTED_MODEL_TYPES = ("llama",)


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs config.json and *.safetensors")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"config.json model_type={model_type!r} is not supported "
                                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
        # transformers v5 moved rope settings into rope_parameters; v4 used rope_theta + rope_scaling.
        # Both are checked: v5 still applies a rope_scaling entry over a default rope_parameters.
        for key in ("rope_parameters", "rope_scaling"):
            entry = cfg.get(key) or {}
            rope_type = entry.get("rope_type", entry.get("type", "default"))
            if rope_type not in ("default", None):
                raise UnsupportedModelError(
                    f"config.json {key} rope type {rope_type!r} is not supported (only the default RoPE)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of "
                                        f"num_key_value_heads={kv_heads}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # (x, weight, eps) -> this forward's result in one pass: the CPU kernel that sits beside this path,
        # tested against it (reference_engine.kernels.cpu_elementwise); None: this path
        self.fused: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dim() == 2 and x.dtype == self.weight.dtype and x.stride(-1) == 1:
            return self.fused(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op; the same math as below when nothing needs upcasting.
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE with HF's rotate-half layout; cos/sin tabulated once for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        # (x, cos, sin) -> rotate()'s result in one pass: the CPU kernel beside this path, tested against it
        # (reference_engine.kernels.cpu_elementwise); None: rotate()
        self.fused: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions``, each [num_tokens, 1, head_dim]: looked up once per forward pass
        and shared by every layer (as Hugging Face's ``position_embeddings``)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        cos, sin = cos_sin
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def rotated(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """:meth:`rotate`, by the fused kernel where one is set and takes ``x`` (each row's heads
        contiguous, x in the tables' dtype)."""
        cos, sin = cos_sin
        if (self.fused is not None and x.dim() == 3 and x.stride(-1) == 1 and x.stride(1) == x.shape[-1]
                and x.dtype == cos.dtype and cos.is_contiguous() and sin.is_contiguous()):
            return self.fused(x, cos, sin)
        return self.rotate(x, cos_sin)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.rotated(x, self.at(positions, x.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.rope = rope
        self.qkv: nn.Linear | None = None  # q, k and v in one matmul, set by fuse_projections()

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: [num_tokens, hidden]; ``cos_sin``: RoPE at the tokens' positions (:meth:`RotaryEmbedding.at`)."""
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)  # [num_tokens, (hq + 2 * hkv) * d]
            qk = self.rope.rotated(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos_sin)  # once for q and k
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        else:
            q = self.rope.rotated(self.q_proj(x).view(t, hq, d), cos_sin)
            k = self.rope.rotated(self.k_proj(x).view(t, hkv, d), cos_sin)
            v = self.v_proj(x).view(t, hkv, d)
        out = paged_attention(q, k, v, kv_cache, self.layer, meta)  # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.gate_up: nn.Linear | None = None  # gate and up in one matmul, set by fuse_projections()
        # gate_up's output -> silu(gate) * up in one pass (reference_engine.kernels.cpu_elementwise); None: below
        self.fused: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.fused is not None:
            return self.down_proj(self.fused(self.gate_up(x)))
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)  # views of one fresh [T, 2 * I] product
            # In place on that product: no two more [T, I] tensors per layer (a prefill of 2048 tokens
            # spent a noticeable share of its time in these elementwise ops and their allocations).
            return self.down_proj(nn.functional.silu(gate, inplace=True).mul_(up))
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg, layer, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos_sin, kv_cache, meta):
        h = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror Hugging Face's, so a state dict loads without renaming."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.model.rotary_emb = rope
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns final hidden states [num_tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary_emb.at(positions, x.dtype)  # the same positions in every layer
        for layer in self.model.layers:
            x = layer(x, cos_sin, kv_cache, meta)
        return self.model.norm(x)

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Serve q/k/v and gate/up each from one matmul (fewer, larger kernels per layer).

        The fused weight owns the storage and the original ``q_proj.weight`` etc. become views
        into it, so memory is not doubled and the state dict keeps Hugging Face's names.
        """
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = _fused_linear(attn.q_proj, attn.k_proj, attn.v_proj)
            mlp.gate_up = _fused_linear(mlp.gate_proj, mlp.up_proj)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _fused_linear(*parts: nn.Linear) -> nn.Linear:
    weight = torch.cat([p.weight for p in parts])
    has_bias = parts[0].bias is not None
    bias = torch.cat([p.bias for p in parts]) if has_bias else None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    row = 0
    for p in parts:  # the originals now alias slices of the fused storage
        n = p.weight.shape[0]
        p.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return fused


#: checkpoints larger than this are built on the meta device (see load_model)
BUILD_ON_META_ABOVE_BYTES = 256 << 20


def load_model(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build the model from ``config.json`` and load ``*.safetensors`` (sharded or not) strictly."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (pickled checkpoints are not loaded, by design)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device="cpu"))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # A large model is built on the meta device (no memory, no initialisation of weights about to be
    # overwritten); a small one straight on the CPU, where initialising costs milliseconds: meta tensors
    # run torch's Python decompositions, whose first use imports torch._dynamo: seconds of every server start.
    large = sum(f.stat().st_size for f in files) > BUILD_ON_META_ABOVE_BYTES
    with torch.device("meta" if large else "cpu"):
        model = LlamaForCausalLM(cfg)
    if large:
        model = model.to_empty(device="cpu")
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    unexpected = sorted(k for k in state.keys() - expected if "rotary_emb" not in k)
    if missing or unexpected:
        raise UnsupportedModelError(f"checkpoint {model_dir} does not match the Llama layout: "
                                    f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers were created on the meta device: rebuild the RoPE tables for real.
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    model.model.rotary_emb.cos = rope.cos
    model.model.rotary_emb.sin = rope.sin
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse_projections()
    return model


def fuse_elementwise(model: nn.Module) -> int:
    """Point ``model``'s RMSNorm layers, its RoPE and its MLPs with a fused gate/up projection at the CPU
    kernels of :mod:`reference_engine.kernels.cpu_elementwise` (their ``fused`` attribute); returns how many
    modules now use them (the one RoPE module serves every layer). The parameters are untouched."""
    from reference_engine.kernels.cpu_elementwise import rms_norm, rope, silu_mul

    count = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.fused = rope
        elif isinstance(module, MLP) and module.gate_up is not None:
            module.fused = silu_mul
        else:
            continue
        count += 1
    return count
