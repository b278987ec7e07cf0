"""The CPU KV pool is zeroed memory that becomes resident only where it is used."""

import mmap

import torch

from engine.kv_cache import PagedKVCache


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_a_cpu_pool_is_zero_and_resident_only_where_written():
    # 2 x 256 MiB of bf16 (layers x slots x heads x dim); torch.zeros would make it all resident.
    before = resident_bytes()
    cache = PagedKVCache(num_layers=8, num_blocks=4096, block_size=16, num_kv_heads=4, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"), num_host_blocks=512)
    assert cache.k.shape == (8, 4096 * 16, 4, 64) and cache.k.dtype == torch.bfloat16
    assert resident_bytes() - before < 64 << 20
    slots = torch.arange(40 * 16, 41 * 16)
    key = torch.randn(16, 4, 64).to(torch.bfloat16)
    cache.write(3, key, -key, slots)
    assert torch.equal(cache.k[3, slots], key) and torch.equal(cache.v[3, slots], -key)
    # every other slot reads as zero, in both pools, and the k and v pools do not alias
    assert cache.k[3, :40 * 16].abs().sum() == 0 and cache.v[2].abs().sum() == 0
    assert cache.k_host.abs().sum() == 0 and cache.k.data_ptr() % mmap.PAGESIZE == 0
    moved = cache.swap([(40, 7)], [])
    assert moved == cache.bytes_per_block and torch.equal(cache.k_host[3, 7 * 16:8 * 16], key)
