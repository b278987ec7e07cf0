"""The int8 KV cache's rows (csrc/kv_int8.h, engine/kv_cache.py): the kernels' write_kv
quantizes byte for byte as the torch fallback does, the round trip is within half a step, and
the paged attention kernel on int8 pools equals the fp32 reference over the dequantized
values on every path (decode rows, query tiles, VDPBF16PS and AMX tiles, sliding windows,
soft-capping, sinks): fp32 queries within fp32 rounding, bf16 and fp16 ones by the bf16
contract (tests/bf16.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import paged_attention_ops
from engine.kv_cache import KV_SCALE_BYTES, PagedKVCache, dequantize_rows, quantize_rows
from tests.bf16 import assert_tensor_within_noise
from tests.test_paged_kernel import CASES, FEATURES, amx, random_batch, reference, reference_ext  # noqa: F401 (amx: the fixture)

ops = paged_attention_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="the C++ kernels did not build (see the log)")


def test_quantize_rows_round_trip_is_within_half_a_step():
    """Each value comes back within half its row's step (max|x| / 127 / 2), the row's largest
    magnitude exactly; a zero row is zeros with scale 0; the row is head_dim + 4 bytes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + KV_SCALE_BYTES)
    back = dequantize_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-6)).all())
    assert bool((rows[..., :64].abs() <= 127).all())
    assert torch.equal(back[7, 1], torch.zeros(64)) and torch.equal(rows[7, 1], torch.zeros(68, dtype=torch.int8))
    top = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, top), x.gather(-1, top), rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_quantizes_as_the_torch_fallback(dtype, head_dim):
    """The kernels' write_kv into an int8 pool writes exactly quantize_rows' bytes at each slot
    (whole vectors and a head_dim's tail), from strided views of a packed q/k/v output (as the
    fused forward hands them over), and touches no other slot."""
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(40, 9 + 3 + 3, head_dim, generator=g) * 3).to(dtype)
    qkv[5] = 0
    k, v = qkv[:, 9:12], qkv[:, 12:]
    k_pool = torch.full((100, 3, head_dim + 4), 7, dtype=torch.int8)
    v_pool = k_pool.clone()
    slots = torch.randperm(100, generator=g)[:40]
    ops_all = torch.ops.streamgate
    ops_all.write_kv(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool[slots], quantize_rows(k)) and torch.equal(v_pool[slots], quantize_rows(v))
    rest = torch.ones(100, dtype=torch.bool)
    rest[slots] = False
    assert bool((k_pool[rest] == 7).all() and (v_pool[rest] == 7).all())


@needs_kernels
def test_int8_pools_refuse_a_wrong_row_or_query_dtype():
    q, k_pool, v_pool, tables = random_batch([1], [16], 2, 2, 16, 16, torch.float32, seed=0)
    k8, v8 = quantize_rows(k_pool), quantize_rows(v_pool)
    args = (tables, torch.tensor([0, 1]), torch.tensor([16]), 16, 0.25)
    with pytest.raises(RuntimeError, match="head shapes"):
        ops.paged_attention(q, k8[..., :-1], v8[..., :-1], *args, torch.empty(q.shape))
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.paged_attention(q.double(), k8, v8, *args, torch.empty(q.shape, dtype=torch.double))
    with pytest.raises(RuntimeError, match="write_kv"):
        torch.ops.streamgate.write_kv(k8, v8, torch.tensor([0]), k_pool[:1, :, :8], v_pool[:1, :, :8])


def int8_batch(case, dtype, seed):
    """random_batch's pools quantized, with the fp32 values they stand for."""
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    q, k_pool, v_pool, tables = random_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size,
                                             torch.float32, seed=seed)
    k8, v8 = quantize_rows(k_pool), quantize_rows(v_pool)
    return q.to(dtype), k8, v8, dequantize_rows(k8, torch.float32), dequantize_rows(v8, torch.float32), tables


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_int8_pool_kernel_matches_the_reference_over_its_values(case, dtype, amx):
    """Every row equals gather + SDPA in fp32 over the dequantized keys and values: fp32
    queries within fp32 rounding; bf16/fp16 ones within twice what torch's SDPA in that dtype is
    off fp32 on the same values (the bf16 contract)."""
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    q, k8, v8, kd, vd, tables = int8_batch(case, dtype, seed=3)
    scale = head_dim ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    ops.paged_attention(q, k8, v8, tables, torch.tensor([0] + q_lens).cumsum(0), torch.tensor(ctx_lens),
                        block_size, scale, out)
    want = reference(q, kd, vd, tables, q_lens, ctx_lens, block_size, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        low = reference(q, kd.to(dtype), vd.to(dtype), tables, q_lens, ctx_lens, block_size, scale, dtype)
        assert_tensor_within_noise(out, want, low, what=f"{case} {dtype} int8 pool")


@needs_kernels
@pytest.mark.skipif(ops is None or not hasattr(ops, "paged_attention_ext"), reason="no paged_attention_ext")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("case", ["mixed", "many", "families", "amx-d96"])
def test_int8_pool_features_match_the_eager_reference(case, feature, dtype, amx):
    """Windows, soft-capping and sinks on an int8 pool: the eager math over its values, bf16
    within the kernel's bf16 tolerance on bf16 pools (1e-2, test_paged_kernel.py) plus twice
    what rounding the dequantized keys and values to bf16 moves the fp32 result (the bf16
    tiles attend to them so rounded)."""
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    window, softcap, with_sinks = FEATURES[feature]
    q, k8, v8, kd, vd, tables = int8_batch(case, dtype, seed=4)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(9)) * 2 if with_sinks else None
    want = reference_ext(q, kd, vd, tables, q_lens, ctx_lens, block_size, 0.3, window, softcap, sinks)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    ops.paged_attention_ext(q, k8, v8, tables, torch.tensor([0] + q_lens).cumsum(0), torch.tensor(ctx_lens),
                            block_size, 0.3, window, softcap, sinks, out)
    tol = 1e-5
    if dtype != torch.float32:
        rounded = reference_ext(q, kd.to(dtype), vd.to(dtype), tables, q_lens, ctx_lens, block_size, 0.3, window,
                                softcap, sinks)
        tol = 1e-2 + 2 * float((rounded - want).abs().max())
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_int8_pool_is_half_the_bytes_and_gathers_the_models_dtype():
    """An int8 PagedKVCache: (head_dim + 4) / (2 * head_dim) of a bf16 pool's bytes a block;
    the torch fallback's write quantizes and gather() returns dequantized rows in the model's
    dtype; swap moves values and scales together."""
    cache = PagedKVCache(2, 8, 4, 3, 64, torch.bfloat16, torch.device("cpu"), num_host_blocks=2,
                         kv_dtype=torch.int8)
    bf16 = PagedKVCache.bytes_per_block(2, 4, 3, 64, torch.bfloat16)
    assert cache.bytes_per_block == PagedKVCache.bytes_per_block(2, 4, 3, 64, torch.bfloat16, torch.int8)
    assert cache.bytes_per_block * 128 == bf16 * 68
    key = torch.randn(5, 3, 64).bfloat16()
    value = torch.randn(5, 3, 64).bfloat16()
    slots = torch.tensor([0, 1, 2, 3, 9])
    cache.write(1, key, value, slots)
    k, v = cache.gather(1, slots)
    assert k.dtype == torch.bfloat16 and torch.equal(k, dequantize_rows(quantize_rows(key), torch.bfloat16))
    assert torch.equal(v, dequantize_rows(quantize_rows(value), torch.bfloat16))
    cache.swap([(0, 1)], [])                  # block 0 (slots 0-3) out to host block 1
    assert torch.equal(cache.k_host[1, 4:8], quantize_rows(key[:4]))
    cache.swap([], [(1, 5)])                  # and back in to block 5
    assert torch.equal(cache.gather(1, torch.arange(20, 24))[1], v[:4])
