"""Paged KV cache: one pool of blocks per layer, written through a slot mapping.

Layout per layer: `[num_blocks * block_size, H_kv, D]` (a flat slot axis), so token slot
`s = block_id * block_size + offset` is one row. A hybrid model's KV-cache groups
(kv_groups.py) share the rows: the pool has one row per layer of a group, and layer l uses
row `layer_row[l]` of the blocks in its group's table. Hugging Face models call `update()` on the
object passed as `cache=`; it writes the step's new keys/values into their slots and hands
them back unchanged. The attention function (attention.py) then reads each sequence's
context from the pool through its slots.

`kv_dtype=torch.int8` (EngineConfig.kv_cache_dtype "int8"): each (slot, head) row is
head_dim int8 values and their fp32 scale, `[..., H_kv, D + 4]` int8 (csrc/kv_int8.h), about
half the bytes of bf16 for the attention to read and twice the tokens per GiB. Writes
quantize (the kernels' write_kv, or `quantize_rows` here, byte for byte the same); gather()
returns rows dequantized to the model's dtype.
"""

from __future__ import annotations

import math

import torch

from .huge_pages import region
from .kv_populate import populator

KV_SCALE_BYTES = 4          # an int8 row's fp32 scale, after its head_dim values (csrc/kv_int8.h)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floating -> int8 [..., D + 4]: symmetric per row, scale = max|x| / 127, values
    round(x / scale) (half to even) in [-127, 127], then the scale's four bytes; a zero row is
    zeros with scale 0. The same bytes as csrc/kv_int8.h's quantize_row for finite x."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(xf / torch.where(scale > 0, scale, 1.0)), 0.0).clamp_(-127, 127)
    return torch.cat([q.to(torch.int8), scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D + 4] -> [..., D] of `dtype`: values times their scale, in fp32 first."""
    scale = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)      # [..., 1]
    return (rows[..., :-KV_SCALE_BYTES].float() * scale).to(dtype)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, pin: bool = False) -> torch.Tensor:
    """A tensor of zeros. On the CPU it is anonymous memory from mmap, advised for huge pages
    (huge_pages.region), which the OS hands out as zero pages when first touched: the mapping
    costs start-up nothing (torch.zeros writes every byte: ~0.4 s for the 1 GiB CPU default),
    and the engine's pool is then faulted in by a background thread on idle CPU
    (kv_populate.py; with kv_cache_populate off, only the blocks used so far). Aligned to 2 MiB, so
    every kernel's vector loads stay aligned. The engine never forks after this
    (tensor-parallel ranks are spawned). `pin`: page-locked host memory for CUDA transfers,
    from torch."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0 or pin:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    return region(nbytes).view(dtype).view(shape)


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0,
                 layer_row: tuple[int, ...] | None = None, kv_dtype: torch.dtype | None = None,
                 populate: bool = False):
        # num_layers: the pool's rows per block. A hybrid model's KV-cache groups
        # (kv_groups.py) share the rows: layer l lives in row layer_row[l] of its group's blocks.
        self.num_layers = num_layers
        self.layer_row = layer_row
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype                       # the model's: what gather() returns
        self.quantized = kv_dtype == torch.int8
        if kv_dtype not in (None, dtype, torch.int8):
            raise ValueError(f"kv_dtype must be None, the model's dtype or torch.int8 (got {kv_dtype})")
        store, row = (torch.int8, head_dim + KV_SCALE_BYTES) if self.quantized else (dtype, head_dim)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, row)
        self.k = zeroed(shape, store, device)   # [L, S, H_kv, D] (int8: D + 4)
        self.v = zeroed(shape, store, device)   # [L, S, H_kv, D] (int8: D + 4)
        # A CPU pool's pages faulted in from the start, on idle CPU (kv_populate.py).
        self.populator = populator([self.k, self.v], block_size) if populate else None
        # The swap pool lives in host memory (pinned on CUDA for faster transfers).
        host_shape = (num_layers, num_host_blocks * block_size, num_kv_heads, row)
        pin = torch.device(device).type == "cuda"
        self.k_host = zeroed(host_shape, store, "cpu", pin)
        self.v_host = zeroed(host_shape, store, "cpu", pin)
        self.bytes_per_block = PagedKVCache.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype,
                                                            kv_dtype)
        # Row views [L, S, H_kv * D]: gathering whole rows with index_select into a reused
        # scratch buffer is several times faster on CPU than advanced indexing into a fresh
        # tensor (measured 5.2 ms -> 0.8 ms for 32 x 700 slots of SmolLM2's K).
        self._k_rows = self.k.view(num_layers, -1, num_kv_heads * row)
        self._v_rows = self.v.view(num_layers, -1, num_kv_heads * row)
        self._scratch = (self.k.new_empty(0), self.v.new_empty(0))
        self._write_op = None            # streamgate::write_kv once use_kernel() found it
        self._row_pools: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def use_kernel(self) -> None:
        """Write through the C++ kernels' `write_kv` (csrc/write_kv.cpp: keys and values in
        one call, a memcpy per token and head) instead of two index_copy_ a layer; for a CPU
        pool once the kernels are loaded."""
        if self.k.device.type == "cpu" and hasattr(torch.ops.streamgate, "write_kv"):
            self._write_op = torch.ops.streamgate.write_kv

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
        """A block's K and V bytes over all layers (an int8 row: head_dim values and the scale)."""
        row = head_dim + KV_SCALE_BYTES if kv_dtype == torch.int8 else head_dim * dtype.itemsize
        return 2 * num_layers * block_size * num_kv_heads * row

    def row(self, layer: int) -> int:
        """The pool row that holds `layer`'s keys and values."""
        return layer if self.layer_row is None else self.layer_row[layer]

    @property
    def writes_on_kernel(self) -> bool:
        """write() runs the C++ kernels' write_kv."""
        return self._write_op is not None

    def row_pools(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each pool row's (K, V) views [S, H_kv, D], made once: the fused forward would
        otherwise select them again for every layer of every step."""
        if self._row_pools is None:
            self._row_pools = [(self.k[r], self.v[r]) for r in range(self.num_layers)]
        return self._row_pools

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """key/value: [N, H_kv, D] for the N packed tokens; slots: [N] int64 (the layer's group's)."""
        row = self.row(layer)
        if self._write_op is not None:
            self._write_op(self.k[row], self.v[row], slots, key, value)
            return
        if self.quantized:
            key, value = quantize_rows(key), quantize_rows(value)
        self.k[row].index_copy_(0, slots, key)
        self.v[row].index_copy_(0, slots, value)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict | None = None,
               **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        """The Hugging Face cache hook. key/value: [1, H_kv, N, D] (RoPE applied)."""
        meta = (kwargs or {})["paged"]
        self.write(layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1), meta.batch(layer_idx).slot_mapping)
        return key, value

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        """Copy blocks device→host (swap_out pairs), then host→device (swap_in pairs), in
        that order, so a block freed by a swap-out can be refilled in the same step.
        Returns the bytes moved."""
        for pairs, src, dst in ((swap_out, (self.k, self.v), (self.k_host, self.v_host)),
                                (swap_in, (self.k_host, self.v_host), (self.k, self.v))):
            if not pairs:
                continue
            src_slots = self._slots([a for a, _ in pairs], src[0].device)
            dst_slots = self._slots([b for _, b in pairs], dst[0].device)
            for s, d in zip(src, dst):
                # Blocking copies: a non-blocking device->host copy would still be in flight
                # when the host-side scatter reads it.
                d[:, dst_slots] = s[:, src_slots].to(d.device)          # [L, n*bs, H_kv, D]
        return (len(swap_out) + len(swap_in)) * self.bytes_per_block

    def _slots(self, blocks: list[int], device: torch.device) -> torch.Tensor:
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        return (b[:, None] * self.block_size + torch.arange(self.block_size, device=device)).reshape(-1)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the pool at `slots` (any shape [...]): returns [..., H_kv, D] each.
        The results live in a scratch buffer that the next gather overwrites: use them
        before gathering again (an int8 pool's: new tensors, dequantized)."""
        flat = slots.reshape(-1)
        n = flat.numel()
        if self._scratch[0].shape[0] < n:
            rows = max(n, 2 * self._scratch[0].shape[0])
            self._scratch = tuple(t.new_empty((rows, t.shape[-1])) for t in (self._k_rows[0], self._v_rows[0]))
        shape = (*slots.shape, *self.k.shape[2:])
        row = self.row(layer)
        k = torch.index_select(self._k_rows[row], 0, flat, out=self._scratch[0][:n])
        v = torch.index_select(self._v_rows[row], 0, flat, out=self._scratch[1][:n])
        if self.quantized:
            return dequantize_rows(k.view(shape), self.dtype), dequantize_rows(v.view(shape), self.dtype)
        return k.view(shape), v.view(shape)
