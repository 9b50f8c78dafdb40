"""Paged attention, the readable torch path: any block size, CPU or CUDA, and the oracle for kernels.

One call handles a flat batch that mixes decodes, whole prefills and prefill chunks that continue
an already-cached prefix. The new tokens' K/V are first written into their slots; then every
sequence attends over its whole context, gathered from its blocks through the block table.
Sequences are split into two padded groups so that one long prefill does not pad every decode
to its length::

    decode group   [B_d, 1,      K_d]   one query per sequence
    prefill group  [B_p, Q_max,  K_p]   chunked / whole prefills, queries padded to the longest

    K = max_blocks * block_size; key j of sequence b is visible to a query at position p iff j <= p.

The KV cache tensor is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: a
block is contiguous across layers, so swapping a request is one gather over its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [B, Q] long: row of each query in the flat batch (padding -> 0)
    query_valid: torch.Tensor  # [B, Q] bool
    block_tables: torch.Tensor  # [B, max_blocks] long (padding -> block 0; masked out)
    mask: torch.Tensor  # [B, 1, Q, K] bool: True where a query may attend to a key
    flat_rows: torch.Tensor  # [num valid queries] long: token_index[query_valid]
    flat_blocks: torch.Tensor  # [B * max_blocks] long: block_tables flattened, for one index_select
    seq_lens: torch.Tensor  # [B] long: keys each sequence attends to (its last query position + 1)


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [num_tokens] long: block that receives each new token's K/V
    slot_offsets: torch.Tensor  # [num_tokens] long: offset inside that block
    groups: list[AttentionGroup]  # their flat_rows partition the T rows; one group holds them all, in order
    # "triton": the decode group runs triton_attention.paged_decode_attention;
    # "cpp": cpu_attention.paged_decode_attention (the compiled CPU kernel);
    # "sliced": sliced_decode_attention (below)
    backend: str = "torch"


def build_group(token_index: torch.Tensor, query_positions: torch.Tensor, query_valid: torch.Tensor,
                block_tables: torch.Tensor, block_size: int) -> AttentionGroup:
    """Precompute a group's mask once per step (it is shared by every layer)."""
    num_keys = block_tables.shape[1] * block_size
    key_positions = torch.arange(num_keys, device=block_tables.device)
    mask = key_positions.view(1, 1, -1) <= query_positions.unsqueeze(-1)  # [B, Q, K]
    return AttentionGroup(token_index, query_valid, block_tables, mask.unsqueeze(1), token_index[query_valid],
                          block_tables.reshape(-1), query_positions.max(dim=1).values + 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the T new tokens. Returns [T, Hq, D]."""
    num_blocks, _, _, _, num_kv_heads, head_dim = kv_cache.shape
    k_cache = kv_cache[:, layer, 0]  # [num_blocks, block_size, Hkv, D] (a strided view)
    v_cache = kv_cache[:, layer, 1]
    k_cache[meta.slot_blocks, meta.slot_offsets] = k.to(k_cache.dtype)
    v_cache[meta.slot_blocks, meta.slot_offsets] = v.to(v_cache.dtype)
    # Each block of one layer is a contiguous row here, so a gather is one index_select of rows
    # (advanced indexing on the 4-d strided view is several times slower on CPU).
    k_rows = k_cache.reshape(num_blocks, -1)  # [num_blocks, block_size * Hkv * D], still a view
    v_rows = v_cache.reshape(num_blocks, -1)
    out = torch.empty_like(q)
    for g in meta.groups:
        if meta.backend == "triton" and g.token_index.shape[1] == 1:  # the decode group: one query per sequence
            from reference_engine.kernels import triton_attention  # imports triton only when it is used

            out[g.flat_rows] = triton_attention.paged_decode_attention(q[g.flat_rows], kv_cache, layer,
                                                                       g.block_tables, g.seq_lens)
            continue
        if meta.backend == "cpp" and g.token_index.shape[1] == 1:
            from reference_engine.kernels import cpu_attention  # builds the C++ kernel on first use

            alone = len(meta.groups) == 1  # an all-decode step: the group holds every row, in order
            result = cpu_attention.paged_decode_attention(q if alone else q[g.flat_rows], kv_cache, layer,
                                                          g.block_tables, g.seq_lens)
            if alone:
                return result
            out[g.flat_rows] = result
            continue
        if meta.backend == "sliced" and g.token_index.shape[1] == 1:
            out[g.flat_rows] = sliced_decode_attention(q[g.flat_rows], kv_cache, layer, g.block_tables,
                                                       g.seq_lens, visible=g.mask)
            continue
        batch = g.block_tables.shape[0]
        qg = q[g.token_index].transpose(1, 2)  # [B, Hq, Q, D]
        kg = k_rows.index_select(0, g.flat_blocks).view(batch, -1, num_kv_heads, head_dim)  # [B, K, Hkv, D]
        vg = v_rows.index_select(0, g.flat_blocks).view(batch, -1, num_kv_heads, head_dim)
        kg = kg.transpose(1, 2).to(q.dtype)  # [B, Hkv, K, D]
        vg = vg.transpose(1, 2).to(q.dtype)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True)  # [B, Hq, Q, D]
        out[g.flat_rows] = og.transpose(1, 2)[g.query_valid]
    return out



#: bytes of gathered K and V per slice of :func:`sliced_decode_attention`: about twice one core's L2 cache
#: on the machines this project runs on; slices of about this size were the fastest measured at a large
#: decode batch
SLICE_BYTES = 4 << 20


def sliced_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, slice_bytes: int = SLICE_BYTES,
                            visible: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (one query per sequence), the torch path's math a few sequences at a time.

    q: [B, Hq, D]; block_tables: [B, max_blocks]; seq_lens: [B] keys per sequence; ``visible``, if given:
    their mask, [B, 1, 1, max_blocks * block_size] bool (the group's, built once per step). Returns [B, Hq, D],
    the same as :func:`paged_attention`'s decode group (tested against it). Two differences:

    * The torch path gathers the whole batch's K and V (tens of MB a layer at batch 64) and then reads
      them again in SDPA: on CPU the gather took as long as the attention. Here sequences go in
      slices whose gathered K and V take about ``slice_bytes``, so SDPA reads them while they are
      still in cache and the pool is read from memory about once, as a dense cache would be.
    * The G = Hq / Hkv query heads that share a KV head are passed as G queries of that head
      ([B, Hkv, G, D] against [B, Hkv, K, D]), the same products without SDPA's GQA expansion. A
      decode query sees every key of its sequence, so the mask is only ``key < seq_len``.
    """
    num_blocks, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    batch, num_heads, _ = q.shape
    width = block_tables.shape[1]
    k_rows = kv_cache[:, layer, 0].reshape(num_blocks, -1)  # a block of one layer is one row
    v_rows = kv_cache[:, layer, 1].reshape(num_blocks, -1)
    per_sequence = 2 * width * k_rows.shape[1] * k_rows.element_size()
    step = max(1, slice_bytes // per_sequence)
    queries = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    if visible is None:
        visible = torch.arange(width * block_size, device=q.device) < seq_lens.view(-1, 1, 1, 1)  # [B, 1, 1, K]
    out = torch.empty_like(queries)
    for s in range(0, batch, step):
        blocks = block_tables[s : s + step].reshape(-1)
        n = min(step, batch - s)
        k = k_rows.index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        v = v_rows.index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        out[s : s + n] = F.scaled_dot_product_attention(queries[s : s + n], k, v, attn_mask=visible[s : s + n])
    return out.view(batch, num_heads, head_dim)
