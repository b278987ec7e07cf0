"""The C++ paged attention kernel against the pure-torch reference (gather + SDPA) on random
pools and block tables: ragged contexts, partially filled last blocks, prefill chunks over
cached context, GQA, fp32 and bf16; on a CPU with AMX, bf16 query tiles both on AMX tiles
(csrc/attention_amx_item.h) and on VDPBF16PS (attention_bf16.h)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import paged_attention_ops
from tests.bf16 import assert_tensor_within_noise

ops = paged_attention_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the paged attention kernel did not build (see the log)")
# Whether this process runs AMX tiles (the CPU has AMX-BF16, Linux grants the tile state, and
# STREAMGATE_AMX is not 0): then every bf16 test runs on both paths.
AMX = ops is not None and ops.amx_tiles()
NO_AMX = "no AMX here (CPU without AMX-BF16, kernel variant without AVX512-BF16, or STREAMGATE_AMX=0)"


@pytest.fixture(params=[pytest.param(False, id="no-amx"),
                        pytest.param(True, id="amx", marks=pytest.mark.skipif(not AMX, reason=NO_AMX))])
def amx(request):
    """Runs the test with the kernel's AMX tiles off, and again on where this CPU has them."""
    ops.amx_tiles(request.param)
    yield request.param
    ops.amx_tiles(AMX)


def reference(q, k_pool, v_pool, tables, q_lens, ctx_lens, block_size, scale, dtype=torch.float32):
    """Gather each sequence's context out of the pool and run SDPA with a causal offset, in
    `dtype` (fp32: the exact reference; the pool's own dtype: what torch's attention in that
    precision makes of the same inputs, the measure of its rounding noise)."""
    out = torch.empty(q.shape, dtype=dtype)
    row = 0
    for table, q_len, ctx in zip(tables.tolist(), q_lens, ctx_lens):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        k = k_pool[slots].to(dtype).transpose(0, 1)[None]               # [1, H_kv, T, D]
        v = v_pool[slots].to(dtype).transpose(0, 1)[None]
        qs = q[row:row + q_len].to(dtype).transpose(0, 1)[None]         # [1, H, q, D]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]   # [q, T]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k_pool.shape[1])
        out[row:row + q_len] = o[0].transpose(0, 1)
        row += q_len
    return out


def pools_as(kind: str, k_pool, v_pool):
    """(k, v, k_ref, v_ref): the pools the kernel reads ("int8": quantized rows, csrc/kv_int8.h;
    else as given) and the fp32 K/V the reference reads (the int8 rows dequantized)."""
    from engine.kv_cache import dequantize_rows, quantize_rows

    if kind != "int8":
        return k_pool, v_pool, k_pool, v_pool
    k8, v8 = quantize_rows(k_pool.float()), quantize_rows(v_pool.float())
    return k8, v8, dequantize_rows(k8, torch.float32), dequantize_rows(v8, torch.float32)


def random_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, seed):
    """A shuffled pool with a random block table per sequence (blocks never shared)."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(widths) + 3
    k_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(ctx_lens), max(widths), dtype=torch.long)
    for b, w in enumerate(widths):
        tables[b, :w] = torch.tensor(perm[:w])
        perm = perm[w:]
    # q comes from a [H, N, D] tensor, as the model hands it over (non-contiguous [N, H, D]).
    q = torch.randn(heads, sum(q_lens), head_dim, generator=g).to(dtype).transpose(0, 1)
    return q, k_pool, v_pool, tables


CASES = {
    # ragged decode contexts, partially filled last blocks, GQA 4:2
    "decode": ([1] * 6, [1, 5, 16, 17, 40, 200], 4, 2, 16, 16),
    # a prefill chunk over cached context, a first chunk, decodes; GQA 9:3 (SmolLM2's), D=64
    "mixed": ([37, 1, 20, 1, 3], [100, 33, 20, 64, 3], 9, 3, 64, 16),
    # no GQA, block size 8, chunk longer than one query tile
    "mha": ([40, 1], [47, 9], 2, 2, 32, 8),
    # a 70-token chunk starting mid-block over 230 tokens (three query tiles, several key spans,
    # a last row group of 2), a 2-token chunk, a decode
    "long": ([70, 2, 1], [300, 130, 77], 9, 3, 64, 16),
    # head_dim 20 (not a whole number of vector lanes), GQA 3:1, block size 8, row groups of 3
    "odd": ([5, 1, 3], [29, 11, 40], 3, 1, 20, 8),
    # enough sequences that an fp32 decode row is one work item for all its KV heads, beside
    # a chunk (per-head items); SmolLM2's shapes, ragged contexts over several key spans
    "many": ([1] * 8 + [24], [1, 15, 16, 17, 63, 64, 65, 300, 90], 9, 3, 64, 16),
    # the same with head_dim 20 and 4 KV heads of GQA 2:1, block size 8
    "many-odd": ([1] * 9, [3, 8, 9, 30, 70, 71, 129, 5, 200], 8, 4, 20, 8),
    # decode rows with head_dim 128 (two 64-wide slices of values with AVX-512) and 48 (three
    # registers), ragged contexts with 1-3 keys past the last group of four
    "wide": ([1, 1, 1, 5], [70, 3, 131, 9], 6, 2, 128, 16),
    "d48": ([1, 1, 1], [33, 102, 2], 3, 1, 48, 8),
    # chunks whose spans are not a whole number of 32 keys (block size 40: spans of 40, the
    # last 8 keys masked; block size 24: spans of 48) and head_dim 48 and 80 (32 + 16 lanes),
    # odd key counts in the last span: the tails of the bf16 tiles (attention_bf16.h)
    "tails-d48": ([9, 20, 1], [50, 95, 33], 6, 2, 48, 40),
    "tails-d80": ([12, 7], [40, 131], 4, 1, 80, 24),
    # AMX's shapes (head_dim % 32 == 0): head_dim 96 (four output tiles and two more), GQA 4:1
    # (128 query vectors a tile), spans of 48 keys (block size 24: the last 16 of a 64-key score
    # tile and of a 32-key value step unused), chunks of 1-3 query tiles, a 3-row chunk (12
    # vectors: one tile of 16 rows, 4 of them padding)
    "amx-d96": ([70, 3, 33, 1], [200, 3, 95, 50], 8, 2, 96, 24),
    # MHA at head_dim 128 (one query vector per row: a 17-row chunk is two row tiles, the second
    # of one row), block size 16, a chunk over a long context (many spans)
    "amx-d128": ([17, 64], [17, 700], 2, 2, 128, 16),
    # block size 32: the bf16 tiles pack a block's keys sixteen at a time, twice a block
    # (attention_tile_bf16.h), and a partial last block key by key; 45 rows: tiles of 32 and 13
    # rows, 96 and 39 query vectors, in groups of eight and the last seven as four and three
    "blocks-32": ([45, 1], [173, 60], 9, 3, 64, 32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_torch_reference(case, dtype, amx):
    """Every query row's output equals gather + SDPA in fp32 within fp32 rounding; bf16 and
    fp16 pools by the bf16 contract (tests/bf16.py): within twice what torch's own SDPA in
    that dtype is off fp32 on the same inputs."""
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    q, k_pool, v_pool, tables = random_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, seed=3)
    scale = head_dim ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    q_start = torch.tensor([0] + q_lens).cumsum(0)
    ops.paged_attention(q, k_pool, v_pool, tables, q_start, torch.tensor(ctx_lens), block_size, scale, out)
    want = reference(q, k_pool, v_pool, tables, q_lens, ctx_lens, block_size, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        low = reference(q, k_pool, v_pool, tables, q_lens, ctx_lens, block_size, scale, dtype)
        assert_tensor_within_noise(out, want, low, what=f"{case} {dtype}")


def test_kernel_rejects_short_block_table():
    """A context longer than its block table covers is refused, not read out of bounds."""
    q, k_pool, v_pool, tables = random_batch([1], [16], 2, 2, 16, 16, torch.float32, seed=0)
    out = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match="block table too short"):
        ops.paged_attention(q, k_pool, v_pool, tables, torch.tensor([0, 1]), torch.tensor([17]), 16, 0.25, out)


# -- layer features: sliding window, logit soft-capping, sinks (paged_attention_ext) -------------
def reference_ext(q, k_pool, v_pool, tables, q_lens, ctx_lens, block_size, scale, window, softcap, sinks):
    """transformers' eager attention, written out in fp32: keys in (p - window, p], scores
    soft-capped, a per-head sink logit in each softmax's denominator."""
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // k_pool.shape[1]
    row = 0
    for table, q_len, ctx in zip(tables.tolist(), q_lens, ctx_lens):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        k = k_pool[slots].float().repeat_interleave(group, 1).transpose(0, 1)     # [H, T, D]
        v = v_pool[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        qs = q[row:row + q_len].float().transpose(0, 1)                           # [H, q, D]
        s = qs @ k.transpose(1, 2) * scale                                        # [H, q, T]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        pos, keys = torch.arange(ctx - q_len, ctx)[:, None], torch.arange(ctx)[None, :]
        mask = (keys <= pos) & ((keys > pos - window) if window else True)
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks[:, None, None].expand(-1, q_len, 1)], -1)
        p = torch.softmax(s, -1)[..., :ctx]
        out[row:row + q_len] = (p @ v).transpose(0, 1)
        row += q_len
    return out


# The family tests' shapes: head_dim 16 (bf16 query tiles, decode rows on all heads), GQA 4:2,
# block size 8, chunks of several query tiles.
CASES["families"] = ([40, 1, 9, 70], [90, 30, 9, 70], 4, 2, 16, 8)
FEATURES = {"window": (24, 0.0, False), "softcap": (0, 3.0, False), "sinks": (0, 0.0, True),
            "all": (24, 3.0, True), "window-1": (1, 0.0, False)}


@pytest.mark.skipif(ops is None or not hasattr(ops, "paged_attention_ext"), reason="no paged_attention_ext")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("case", ["decode", "mixed", "long", "odd", "many", "wide", "tails-d48", "families", "amx-d96"])
def test_kernel_features_match_eager_reference(case, feature, dtype, amx):
    """Every path of the kernel (decode rows on all heads, query tiles, bf16 tiles) with a
    window not a multiple of the block size, soft-capping and sinks equals the eager math;
    keys before a sequence's first window are never read (NaN there would show)."""
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    window, softcap, with_sinks = FEATURES[feature]
    q, k_pool, v_pool, tables = random_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, seed=4)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(9)) * 2 if with_sinks else None
    want = reference_ext(q, k_pool, v_pool, tables, q_lens, ctx_lens, block_size, 0.3, window, softcap, sinks)
    if window:
        for table, q_len, ctx in zip(tables.tolist(), q_lens, ctx_lens):
            for p in range(max(0, ctx - q_len - window + 1)):        # before the first row's window
                k_pool[table[p // block_size] * block_size + p % block_size] = float("nan")
                v_pool[table[p // block_size] * block_size + p % block_size] = float("nan")
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    ops.paged_attention_ext(q, k_pool, v_pool, tables, torch.tensor([0] + q_lens).cumsum(0), torch.tensor(ctx_lens),
                            block_size, 0.3, window, softcap, sinks, out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not AMX, reason=NO_AMX)
def test_amx_tiles_switch_and_change_only_the_order_of_sums():
    """amx_tiles() reports and sets the path: the same bf16 chunk on AMX and on VDPBF16PS differs
    only by rounding (both within the bf16 contract of fp32 SDPA, above), and never by a whole
    row (a wrong tile, a stale key or value past a span's end would)."""
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size = CASES["amx-d96"]
    q, k_pool, v_pool, tables = random_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size,
                                             torch.bfloat16, seed=5)
    outs = {}
    try:
        for on in (False, True):
            assert ops.amx_tiles(on) is on
            outs[on] = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
            ops.paged_attention(q, k_pool, v_pool, tables, torch.tensor([0] + q_lens).cumsum(0),
                                torch.tensor(ctx_lens), block_size, head_dim ** -0.5, outs[on])
    finally:
        ops.amx_tiles(AMX)
    want = reference(q, k_pool, v_pool, tables, q_lens, ctx_lens, block_size, head_dim ** -0.5)
    low = reference(q, k_pool, v_pool, tables, q_lens, ctx_lens, block_size, head_dim ** -0.5, torch.bfloat16)
    for on, out in outs.items():
        assert_tensor_within_noise(out, want, low, what=f"amx={on}")
    assert not torch.equal(outs[False], outs[True])         # the AMX path did run: other sums, other bits


@pytest.mark.skipif(not AMX, reason=NO_AMX)
def test_streamgate_amx_0_turns_the_tiles_off_in_a_new_process():
    """STREAMGATE_AMX=0 is read when the library loads: that process starts with the tiles off
    (an explicit amx_tiles(True) still turns them on where the CPU has them)."""
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom engine.kernels import paged_attention_ops\nops = paged_attention_ops()\n"
            "print(ops.amx_tiles(), ops.amx_tiles(True))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "STREAMGATE_AMX": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout


@pytest.mark.skipif(ops is None or not hasattr(ops, "paged_attention_ext"), reason="no paged_attention_ext")
@pytest.mark.parametrize("pool", ["model dtype", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature", FEATURES)
def test_a_sequence_decoded_alone_is_split_by_kv_head_with_the_same_bits(feature, dtype, pool, all_threads):
    """One decode row with more threads than sequences: its KV heads run as separate items
    (csrc/attention_items.h), each with its own sink and window; the output equals the eager
    math and, bit for bit, the whole row computed on one thread. (On a one-core host both runs
    take the whole row.)"""
    window, softcap, with_sinks = FEATURES[feature]
    q_lens, ctx_lens, heads, kv_heads, head_dim = [1], [150], 9, 3, 64
    q, k_pool, v_pool, tables = random_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, 16, dtype, seed=6)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(9)) * 2 if with_sinks else None
    k_pool, v_pool, kd, vd = pools_as(pool, k_pool, v_pool)
    want = reference_ext(q, kd, vd, tables, q_lens, ctx_lens, 16, 0.3, window, softcap, sinks)
    outs = []
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        ops.paged_attention_ext(q, k_pool, v_pool, tables, torch.tensor([0, 1]), torch.tensor(ctx_lens), 16, 0.3,
                                window, softcap, sinks, out)
        outs.append(out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outs[0].float(), want, atol=tol, rtol=tol)
    assert torch.equal(outs[0], outs[1])
