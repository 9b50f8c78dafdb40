"""The step cost model: the time of one engine step from its shape, on a hardware profile.

A step's *shape* is what the scheduler decided (:class:`StepShape`): how many tokens are prefilled,
how many sequences decode, how many KV tokens attention reads and how many (query, key) pairs it
scores. Its *work* follows from the model's sizes (:class:`~reference_engine.costs.model_shapes.ModelShape`)::

    dense FLOPs     = 2 x layer weights x tokens  +  2 x hidden x vocab x sampled rows
    attention FLOPs = 4 x layers x heads x head_dim x (query, key) pairs
    bytes           = weights (read once per step) + KV bytes per token x (tokens read + tokens written)

and its *time* from the profile (:class:`~reference_engine.costs.profiles.HardwareProfile`), a roofline
with fitted coefficients::

    t = fixed_s + per_seq_s x sequences + combine(dense x FLOPs_d / F + attention x FLOPs_a / F,
                                                   memory x bytes / B)

``combine`` is ``max`` (compute and memory traffic overlap: the GPU roofline) or ``sum`` (they do
not: what the CPU reference engine fits best). With ``sum`` the time is linear in the coefficients,
which is what ``kvbench calibrate`` fits by non-negative least squares (:func:`features`).

A step that follows an idle spell of ``g`` seconds costs ``wake_s x (1 - exp(-g / wake_tau_s))`` more
(:meth:`~reference_engine.costs.profiles.Coefficients.wake_seconds`), charged by the simulator's runner,
which knows how long its clock waited while the engine had nothing to do.

Swap: ``per_copy_s + link x bytes / link_bandwidth`` per batched copy. Recompute: the prefill of the
discarded tokens, priced by the same step model (:meth:`CostModel.recompute_seconds`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from reference_engine.costs.model_shapes import ModelShape
from reference_engine.costs.profiles import HardwareProfile

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: the order of :func:`features` and of the coefficients calibration fits
FEATURES = ("fixed_s", "per_seq_s", "dense", "attention", "memory")


@dataclass(frozen=True)
class StepShape:
    """What one step computes. Counts, not times; build one with :meth:`of_chunks`."""

    prefill_tokens: int = 0  # tokens of chunks that are not decodes
    decode_tokens: int = 0  # decodes (one token each)
    num_seqs: int = 0  # chunks scheduled (sequences in the batch)
    sampled: int = 0  # chunks that reach the end of their sequence, so sample a token
    context_tokens: int = 0  # KV tokens attention reads: per chunk, its end position
    attention_pairs: int = 0  # (query, key) pairs scored: per chunk of n from s, n*s + n(n+1)/2

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def of_chunks(cls, chunks: Iterable[tuple[int, int, bool]]) -> StepShape:
        """From ``(start, num_tokens, completes)`` per scheduled chunk."""
        prefill = decode = seqs = sampled = context = pairs = 0
        for start, n, completes in chunks:
            seqs += 1
            if n == 1 and completes:
                decode += 1
            else:
                prefill += n
            sampled += completes
            context += start + n
            pairs += n * start + n * (n + 1) // 2
        return cls(prefill, decode, seqs, sampled, context, pairs)

    @classmethod
    def prefill(cls, num_tokens: int, start: int = 0) -> StepShape:
        """One prefill of ``num_tokens`` from position ``start``, alone in its step."""
        return cls.of_chunks([(start, num_tokens, True)])

    @classmethod
    def decode_batch(cls, num_seqs: int, context: int) -> StepShape:
        """``num_seqs`` decodes, each at position ``context`` (so each reads ``context + 1`` KV tokens)."""
        return cls(0, num_seqs, num_seqs, num_seqs, num_seqs * (context + 1), num_seqs * (context + 1))

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, ...]:
        return (self.prefill_tokens, self.decode_tokens, self.num_seqs, self.sampled, self.context_tokens,
                self.attention_pairs)


class CostModel:
    """Seconds for steps and swap copies of ``model`` at ``dtype`` on ``profile``."""

    def __init__(self, model: ModelShape, profile: HardwareProfile, dtype: str | None = None):
        dtype = dtype or profile.dtype
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={dtype!r} is invalid: expected one of {sorted(DTYPE_BYTES)}")
        self.model, self.profile, self.dtype = model, profile, dtype
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.kv_bytes_per_token = model.kv_bytes_per_token(self.dtype_bytes)
        # Read every step: the layers and the LM head (the embedding table is only gathered from).
        embed = model.vocab_size * model.hidden_size
        self.step_weight_bytes = (model.num_params() - (0 if model.tie_word_embeddings else embed)) * self.dtype_bytes
        self._dense_per_token = model.dense_flops_per_token()
        self._lm_head = model.lm_head_flops()
        self._attn_per_pair = model.attention_flops_per_pair()

    # -- work ----------------------------------------------------------------------------------
    def work(self, shape: StepShape) -> tuple[float, float, float]:
        """Ideal seconds at the profile's peak rates: (dense compute, attention compute, memory)."""
        p = self.profile
        dense = (self._dense_per_token * shape.tokens + self._lm_head * shape.sampled) / p.compute_flops
        attention = self._attn_per_pair * shape.attention_pairs / p.compute_flops
        nbytes = self.step_weight_bytes + self.kv_bytes_per_token * (shape.context_tokens + shape.tokens)
        return dense, attention, nbytes / p.memory_bandwidth

    def features(self, shape: StepShape) -> list[float]:
        """The regressors of :data:`FEATURES` for this step: ``t = coefficients . features`` when
        ``combine == "sum"``. An empty step has none (it costs nothing: the engine did not run)."""
        if shape.num_seqs == 0:
            return [0.0] * len(FEATURES)
        dense, attention, memory = self.work(shape)
        return [1.0, float(shape.num_seqs), dense, attention, memory]

    # -- time ----------------------------------------------------------------------------------
    def step_seconds(self, shape: StepShape) -> float:
        """Seconds of one step of this shape (0 for an empty step)."""
        if shape.num_seqs == 0:
            return 0.0
        c = self.profile.coefficients
        dense, attention, memory = self.work(shape)
        compute = c.dense * dense + c.attention * attention
        memory *= c.memory
        overlap = max(compute, memory) if self.profile.combine == "max" else compute + memory
        return c.fixed_s + c.per_seq_s * shape.num_seqs + overlap

    def swap_seconds(self, nbytes: int, copies: int = 1) -> float:
        """Seconds to copy ``nbytes`` over the host link in ``copies`` batched copies (0 bytes: 0 s)."""
        if nbytes <= 0:
            return 0.0
        c = self.profile.coefficients
        return copies * c.per_copy_s + c.link * nbytes / self.profile.link_bandwidth

    def swap_round_trip_seconds(self, num_tokens: int, block_size: int) -> float:
        """Swap a sequence of ``num_tokens`` out and back in (whole blocks, one copy each way)."""
        blocks = -(-num_tokens // block_size)
        return 2 * self.swap_seconds(blocks * block_size * self.kv_bytes_per_token)

    def recompute_seconds(self, num_tokens: int, alongside: StepShape | None = None) -> float:
        """Extra seconds to prefill ``num_tokens`` discarded tokens again: added to the step
        ``alongside`` (default: a step of its own, less the per-step fixed cost that step would pay
        anyway)."""
        if num_tokens <= 0:
            return 0.0
        base = alongside or StepShape()
        with_prefill = base + StepShape.prefill(num_tokens)
        extra = self.step_seconds(with_prefill) - self.step_seconds(base)
        return extra - (self.profile.coefficients.fixed_s if base.num_seqs == 0 else 0.0)

    def crossover(self, block_size: int, max_len: int, alongside: StepShape | None = None) -> Crossover:
        """Which preemption mode is cheaper for a victim of each length (multiples of ``block_size`` up to
        ``max_len``): the winner at the shortest length, and the first length where the other one wins.
        On GPUs swap tends to win for short victims when recomputing them alone re-reads the weights,
        and recompute for long ones (the link moves a token's KV slower than the GPU recomputes it)."""
        lengths = list(range(block_size, max_len + 1, block_size)) or [max_len]

        def winner(n: int) -> str:
            swap = self.swap_round_trip_seconds(n, block_size)
            return "swap" if swap < self.recompute_seconds(n, alongside) else "recompute"

        first = winner(lengths[0])
        for n in lengths[1:]:
            if winner(n) != first:
                return Crossover(first, n, max_len)
        return Crossover(first, None, max_len)


@dataclass(frozen=True)
class Crossover:
    """``shorter`` is cheaper below ``length`` and the other mode from it on; ``length`` None: ``shorter``
    is cheaper at every length up to ``max_len``."""

    shorter: str
    length: int | None
    max_len: int

    @property
    def longer(self) -> str:
        if self.length is None:
            return self.shorter
        return "recompute" if self.shorter == "swap" else "swap"

    def describe(self) -> str:
        if self.length is None:
            return f"{self.shorter} is cheaper at every length up to {self.max_len} tokens"
        return f"{self.shorter} is cheaper below {self.length} tokens, {self.longer} from {self.length} on"
