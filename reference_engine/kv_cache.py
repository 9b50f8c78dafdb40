"""The KV tensors of both pools and the batched copies between them.

Swapping moves whole requests: all of their blocks, all layers, K and V, in a few large copies
per step rather than one small copy per block and layer (the PagedAttention paper found that
small transfers are what make swap slow). A block is contiguous in the layout
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, so a gather over block ids
is a gather of large contiguous rows. On CUDA the host pool is pinned and the device<->host
leg is non-blocking through a pinned staging buffer.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, num_layers: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.device = device
        self.on_cuda = device.type == "cuda"
        # zeros, not empty: masked keys are still multiplied by 0 in attention, and 0 * NaN = NaN.
        self.device_cache = torch.zeros((num_gpu_blocks, *self.block_shape), dtype=dtype, device=device)
        # The host pool is only ever read after being written, so it need not be initialised.
        self.host_cache = torch.empty((num_cpu_blocks, *self.block_shape), dtype=dtype,
                                      pin_memory=self.on_cuda and num_cpu_blocks > 0)
        self.block_bytes = self.device_cache[0].numel() * self.device_cache.element_size() if num_gpu_blocks else 0
        self._staging: torch.Tensor | None = None

    def swap_out(self, mapping: list[tuple[int, int]]) -> int:
        """Copy (device block -> host block) pairs. Returns bytes copied."""
        if not mapping:
            return 0
        src = torch.tensor([d for d, _ in mapping], dtype=torch.long, device=self.device)
        dst = torch.tensor([h for _, h in mapping], dtype=torch.long)
        device_rows, host_rows = _rows(self.device_cache), _rows(self.host_cache)
        if self.on_cuda:
            gathered = device_rows.index_select(0, src)  # one gather over all layers, on the device
            staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            _scatter(host_rows, dst, staging)
        else:
            self._copy_rows(device_rows, src, host_rows, dst)
        return len(mapping) * self.block_bytes

    def swap_in(self, mapping: list[tuple[int, int]]) -> int:
        """Copy (host block -> device block) pairs. Returns bytes copied."""
        if not mapping:
            return 0
        src = torch.tensor([h for h, _ in mapping], dtype=torch.long)
        dst = torch.tensor([d for _, d in mapping], dtype=torch.long, device=self.device)
        device_rows, host_rows = _rows(self.device_cache), _rows(self.host_cache)
        if self.on_cuda:
            staging = torch.empty((len(mapping), host_rows.shape[1]), dtype=host_rows.dtype, pin_memory=True)
            torch.index_select(host_rows, 0, src, out=staging)
            _scatter(device_rows, dst, staging.to(self.device, non_blocking=True))
        else:
            self._copy_rows(host_rows, src, device_rows, dst)
        return len(mapping) * self.block_bytes

    def _copy_rows(self, src_rows: torch.Tensor, src: torch.Tensor, dst_rows: torch.Tensor,
                   dst: torch.Tensor) -> None:
        """dst_rows[dst[i]] = src_rows[src[i]] in one pass when either side is a consecutive run
        (the usual case: the host pool hands out consecutive ids), else through a reused buffer."""
        dst_start = _contiguous_run(dst)
        if dst_start is not None:
            torch.index_select(src_rows, 0, src, out=dst_rows[dst_start : dst_start + dst.numel()])
            return
        src_start = _contiguous_run(src)
        if src_start is not None:
            dst_rows.index_copy_(0, dst, src_rows[src_start : src_start + src.numel()])
            return
        if self._staging is None or self._staging.shape[0] < src.numel():
            # Reused across calls: freshly allocated memory costs page faults on every swap.
            self._staging = torch.empty((src.numel(), src_rows.shape[1]), dtype=src_rows.dtype)
        staging = self._staging[: src.numel()]
        torch.index_select(src_rows, 0, src, out=staging)
        dst_rows.index_copy_(0, dst, staging)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of some device blocks (for tests and debugging)."""
        return self.device_cache[torch.tensor(block_ids, dtype=torch.long, device=self.device)].clone()


def _contiguous_run(ids: torch.Tensor) -> int | None:
    """The first id if ``ids`` is ascending and consecutive, else None (then a view replaces a gather)."""
    n = ids.numel()
    first = int(ids[0])
    return first if int(ids[-1]) - first == n - 1 and bool((ids.diff() == 1).all()) else None


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """A pool as a 2-d view, one row per block: index_select over rows runs at memcpy speed."""
    return cache.view(cache.shape[0], -1)


def _scatter(dst: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    start = _contiguous_run(ids)
    if start is not None:
        dst[start : start + ids.numel()].copy_(values)
    else:
        dst.index_copy_(0, ids, values)
