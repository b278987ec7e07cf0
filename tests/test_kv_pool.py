"""The CPU KV pool is zeroed memory that becomes resident only where it is used, and the C++
kernel write (csrc/write_kv.cpp) puts every token where index_copy_ does."""

import mmap

import pytest
import torch

from engine.kernels import load_kernels
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


@pytest.mark.skipif(not load_kernels(), reason="C++ kernels did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_write_puts_each_token_where_index_copy_does(dtype):
    """csrc/write_kv.cpp against index_copy_: keys and values given as views of a packed
    q/k/v output (token stride past the heads) and as transformers' [N, H, D] transpose
    (head stride past the tokens), scattered slots; a slot outside the pool is refused."""
    def pool() -> PagedKVCache:
        return PagedKVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=3, head_dim=8,
                            dtype=dtype, device=torch.device("cpu"))

    fast, plain = pool(), pool()
    fast.use_kernel()
    assert fast._write_op is not None and plain._write_op is None
    qkv = torch.randn(5, 9 * 8).to(dtype)
    key, value = qkv[:, 24:48].view(5, 3, 8), qkv[:, 48:].view(5, 3, 8)       # strided rows
    hf = torch.randn(1, 3, 5, 8).to(dtype)[0].transpose(0, 1)                # strided heads
    slots = torch.tensor([30, 2, 17, 3, 9])
    for cache in (fast, plain):
        cache.write(1, key, value, slots)
        cache.write(0, hf, -hf, slots.flip(0))
    assert torch.equal(fast.k, plain.k) and torch.equal(fast.v, plain.v)
    assert torch.equal(fast.k[1, 17], key[2]) and torch.equal(fast.v[0, 30], -hf[4])
    with pytest.raises(RuntimeError, match="slot 32 outside the pool's 32"):
        fast.write(0, key, value, torch.tensor([0, 1, 2, 3, 32]))


def test_a_cpu_engine_writes_its_pool_through_the_kernel(tiny_model):
    """The runner switches its CPU pool to the kernel write wherever the kernels load."""
    from engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=16))
    assert (eng.runner.kv_cache._write_op is not None) == load_kernels()
