"""Paged KV cache: one pool of blocks per layer, written through a slot mapping.

Layout per layer: `[num_blocks * block_size, H_kv, D]` (a flat slot axis), so token slot
`s = block_id * block_size + offset` is one row. Hugging Face models call `update()` on the
object passed as `cache=`; it writes the step's new keys/values into their slots and hands
them back unchanged. The attention function (attention.py) then reads each sequence's
context from the pool through its slots.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # [L, S, H_kv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)   # [L, S, H_kv, D]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """key/value: [N, H_kv, D] for the N packed tokens; slots: [N] int64."""
        self.k[layer].index_copy_(0, slots, key)
        self.v[layer].index_copy_(0, slots, value)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict | None = None,
               **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        """The Hugging Face cache hook. key/value: [1, H_kv, N, D] (RoPE applied)."""
        meta = (kwargs or {})["paged"]
        self.write(layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1), meta.slot_mapping)
        return key, value

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the pool at `slots` (any shape [...]): returns [..., H_kv, D] each."""
        return self.k[layer][slots], self.v[layer][slots]
