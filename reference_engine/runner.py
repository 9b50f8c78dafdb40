"""Model runner: flattens one scheduled step into tensors, runs the model, samples.

For the chunks ``A: positions 0..2 (prefill)``, ``B: position 7 (decode)`` and block size 4::

    flat tokens     a0 a1 a2 b7
    positions        0  1  2  7
    slot block      tA[0] tA[0] tA[0] tB[1]        tX = block table of X; block = position // 4
    slot offset      0  1  2  3                    offset = position % 4
    sampled from    last row of each chunk that reaches the end of its sequence

A step of more tokens than ``microbatch_tokens`` runs as several forward passes over whole chunks (the
chunks that sample first, in the scheduler's order, then the others), and each pass samples its own chunks
at once: ``execute``'s ``on_sampled`` hears of them before the next pass runs, so a server can stream a
request's first token while the rest of the step computes (vLLM's CPU build answers a wave only when its
whole step is done). The chunks of one step never read each other's KV (a block is shared only once an
earlier step has computed and cached it), so the passes are independent; with the packed CPU matmul each
row's result does not depend on the rows beside it, and the tokens are the same as one pass's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from reference_engine.attention import AttentionGroup, AttentionMetadata, build_group
from reference_engine.block_manager import BlockManager
from reference_engine.kv_cache import KVCache
from reference_engine.model import LlamaForCausalLM
from reference_engine.request import Request
from reference_engine.sampler import sample, token_logprobs
from reference_engine.sampling_params import SamplingParams
from reference_engine.scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_manager: BlockManager,
                 device: torch.device, engine_seed: int, attention_backend: str = "torch",
                 microbatch_tokens: int = 0):
        """``microbatch_tokens``: a step of more tokens than this runs as forward passes of at most about
        this many (whole chunks: a longer chunk runs alone); 0: one pass per step."""
        self.model = model
        self.kv = kv_cache
        self.bm = block_manager
        self.device = device
        self.block_size = block_manager.block_size
        self.engine_seed = engine_seed
        self.attention_backend = attention_backend  # "torch", "sliced" or "triton", resolved for the device
        self.microbatch_tokens = microbatch_tokens

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput,
                on_sampled: Callable[[dict[str, int]], None] | None = None) -> dict[str, int]:
        """Run the step's chunks. Returns the sampled token of every chunk that completes its sequence.

        ``on_sampled(tokens)``, if given, hears of each forward pass's sampled tokens (request id -> token,
        never empty) as soon as the pass has sampled them, for every pass but the step's last: those are
        only returned. The returned dict holds every token of the step, those already heard of included;
        nothing about the requests has changed yet (the scheduler's ``update`` appends the tokens)."""
        passes = microbatches(out.chunks, self.microbatch_tokens)
        sampled: dict[str, int] = {}
        for i, chunks in enumerate(passes):
            tokens = self._run(chunks, out.block_ids)
            if tokens and on_sampled is not None and i < len(passes) - 1:
                on_sampled(tokens)
            sampled.update(tokens)
        return sampled

    def _run(self, chunks: Sequence[ScheduledChunk], block_ids: Mapping[str, Sequence[int]]) -> dict[str, int]:
        """One forward pass over ``chunks``; the sampled token of each that completes its sequence."""
        if not chunks:
            return {}
        input_ids, positions, meta, last_rows = self.prepare(chunks, block_ids)
        hidden = self.model(input_ids, positions, self.kv.device_cache, meta)
        finishing = [i for i, c in enumerate(chunks) if c.completes]
        if not finishing:
            return {}
        logits = self.model.compute_logits(hidden[last_rows[finishing]])
        requests = [chunks[i].request for i in finishing]
        sampled = sample(logits, requests, self.engine_seed)
        # Each output token is sampled exactly once (a recompute recomputes KV, never a sampled token),
        # so appending here keeps output_logprobs aligned with output_token_ids.
        for req, lp in zip(requests, token_logprobs(logits, requests, sampled), strict=True):
            if lp is not None:
                req.output_logprobs.append(lp)
        return {req.request_id: tok for req, tok in zip(requests, sampled, strict=True)}

    def prefill_alone(self, num_tokens: int) -> None:
        """Prefill ``num_tokens`` placeholder tokens alone, in blocks borrowed from the pool and given back
        at once: what ``preemption_mode="auto"`` times at start-up
        (:func:`reference_engine.policies.startup_costs.auto_costs`). Only while nothing runs: the pool is
        empty then, so nothing is overwritten."""
        probe = Request("__auto_cost_probe__", [0] * num_tokens, SamplingParams(max_tokens=1), 0.0)
        if not self.bm.allocate_slots(probe, num_tokens):
            raise RuntimeError("no room")
        try:
            chunk = ScheduledChunk(probe, 0, num_tokens, True)
            self.execute(SchedulerOutput(step=0, chunks=(chunk,),
                                         block_ids={probe.request_id: tuple(self.bm.blocks_of(probe.request_id))}))
        finally:
            self.bm.forget(probe.request_id)

    def prepare(self, chunks: Sequence[ScheduledChunk], block_ids: Mapping[str, Sequence[int]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat ``input_ids``, ``positions``, attention metadata and each chunk's last flat row.

        ``block_ids``: each chunk's request's block table, as the scheduler handed it on
        (``SchedulerOutput.block_ids``); None: read from the block manager."""
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        lens = np.array([c.num_tokens for c in chunks], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))  # first flat row of each chunk
        chunk_of_token = np.repeat(np.arange(len(chunks)), lens)
        positions = np.arange(int(lens.sum()), dtype=np.int64) - offsets[chunk_of_token] + starts[chunk_of_token]
        tokens = _tokens(chunks)
        if block_ids is None:
            tables = [self.bm.blocks_of(c.request.request_id) for c in chunks]
        else:
            tables = [block_ids[c.request.request_id] for c in chunks]
        padded, widths = _pad_tables(tables)
        slot_blocks = padded[chunk_of_token, positions // self.block_size]
        meta = AttentionMetadata(
            slot_blocks=self._t(slot_blocks), slot_offsets=self._t(positions % self.block_size),
            groups=self._groups(lens, starts, offsets, padded, widths), backend=self.attention_backend)
        return self._t(np.asarray(tokens)), self._t(positions), meta, self._t(offsets + lens - 1)

    def _groups(self, lens: np.ndarray, starts: np.ndarray, offsets: np.ndarray, padded: np.ndarray,
                widths: np.ndarray) -> list[AttentionGroup]:
        """The decode group and the prefill group (:mod:`reference_engine.attention`); ``padded``, ``widths``:
        every chunk's block table padded to the widest, and each table's own length."""
        groups = []
        is_decode = lens == 1
        for members in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode)):
            if members.size == 0:
                continue
            q_max = int(lens[members].max())
            q_idx = np.arange(q_max)
            valid = q_idx[None, :] < lens[members, None]  # [B, Q]
            token_index = np.where(valid, offsets[members, None] + q_idx[None, :], 0)
            query_positions = np.where(valid, starts[members, None] + q_idx[None, :], 0)
            block_tables = padded[members, : int(widths[members].max())]  # as wide as this group's widest
            groups.append(build_group(self._t(token_index), self._t(query_positions), self._t(valid),
                                      self._t(block_tables), self.block_size))
        return groups

    def _t(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


def microbatches(chunks: Sequence[ScheduledChunk], max_tokens: int) -> list[list[ScheduledChunk]]:
    """``chunks`` as forward passes of at most ``max_tokens`` tokens each (a chunk longer than that is a
    pass of its own); one pass when they fit or ``max_tokens`` is 0. The chunks that sample a token come
    first, in their order (the scheduler's: decodes, then prefills by arrival), so their tokens can leave
    early; the chunks that sample nothing (a chunked prefill's middle pieces) go last."""
    if max_tokens <= 0 or sum(c.num_tokens for c in chunks) <= max_tokens:
        return [list(chunks)] if chunks else []
    ordered = [c for c in chunks if c.completes] + [c for c in chunks if not c.completes]
    passes: list[list[ScheduledChunk]] = []
    current: list[ScheduledChunk] = []
    size = 0
    for chunk in ordered:
        if current and size + chunk.num_tokens > max_tokens:
            passes.append(current)
            current, size = [], 0
        current.append(chunk)
        size += chunk.num_tokens
    passes.append(current)
    return passes


def _tokens(chunks: list[ScheduledChunk]) -> list[int]:
    """The token ids the chunks compute, flattened (a decode reads one id without concatenating lists)."""
    tokens: list[int] = []
    for c in chunks:
        req = c.request
        if c.num_tokens == 1:
            p, n_prompt = c.start, req.num_prompt_tokens
            tokens.append(req.prompt_token_ids[p] if p < n_prompt else req.output_token_ids[p - n_prompt])
        else:
            tokens.extend(req.all_token_ids[c.start : c.start + c.num_tokens])
    return tokens


def _pad_tables(tables: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The tables as one ``[len(tables), longest]`` array, each row padded with block 0 (masked out by
    attention), and each table's length. One fill for all rows: a row-major boolean mask takes the
    tables' ids in order, without a numpy call per table."""
    widths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    out = np.zeros((len(tables), int(widths.max())), dtype=np.int64)
    out[np.arange(out.shape[1]) < widths[:, None]] = np.fromiter(itertools.chain.from_iterable(tables),
                                                                  dtype=np.int64, count=int(widths.sum()))
    return out, widths
