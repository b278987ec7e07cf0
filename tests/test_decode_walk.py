"""How decode rows bring the next span's K/V into cache (csrc/attention_decode.h): loads of every
line on CPUs where prefetch instructions did nothing measurable (AMD's), prefetches on Intel's.
Either walk gives the same bits, and the loads never read outside the rows the row attends to:
a pool that ends at an unreadable page would fault on a byte past it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engine.kernels import paged_attention_ops
from tests.test_paged_kernel import CASES, FEATURES, random_batch, reference_ext

ops = paged_attention_ops()


def _switchable() -> bool:
    """Whether this build has both walks (AVX-512's decode rows; AVX2 builds have neither)."""
    if ops is None or not hasattr(ops, "decode_span_loads"):
        return False
    was = ops.decode_span_loads()
    flipped = ops.decode_span_loads(not was) is not was
    ops.decode_span_loads(was)
    return flipped


pytestmark = pytest.mark.skipif(not _switchable(), reason="the kernel did not build, or this build's decode rows "
                                "(without AVX-512) have no walk to switch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode", "many", "wide", "d48", "families"])
@pytest.mark.parametrize("feature", ["none", "window", "all"])
def test_loads_and_prefetches_give_the_same_bits(case, feature, dtype):
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size = CASES[case]
    window, softcap, with_sinks = FEATURES[feature] if feature != "none" else (0, 0.0, False)
    q, k_pool, v_pool, tables = random_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, seed=8)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)) if with_sinks else None
    default, outs = ops.decode_span_loads(), {}
    try:
        for loads in (True, False):
            assert ops.decode_span_loads(loads) is loads
            outs[loads] = torch.full(q.shape, float("nan"), dtype=dtype)
            ops.paged_attention_ext(q, k_pool, v_pool, tables, torch.tensor([0] + q_lens).cumsum(0),
                                    torch.tensor(ctx_lens), block_size, 0.3, window, softcap, sinks, outs[loads])
    finally:
        ops.decode_span_loads(default)
    assert torch.equal(outs[True], outs[False])
    want = reference_ext(q, k_pool, v_pool, tables, q_lens, ctx_lens, block_size, 0.3, window, softcap, sinks)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outs[True].float(), want, atol=tol, rtol=tol)


# In a child process (a fault must fail this test, not end the run): pools that end where an
# unreadable page begins, right after the last sequence's last slot (its context ends mid-block);
# decode rows whole (several sequences) and split by KV head (one sequence, two threads), a bf16
# pool (384-byte slots) and an int8 one (rows of head_dim + 4 bytes: slots not a whole number of
# lines).
GUARDED = textwrap.dedent("""
    import ctypes, mmap, sys, torch
    from engine.kernels import paged_attention_ops
    from engine.kv_cache import quantize_rows
    ops = paged_attention_ops()
    ops.decode_span_loads(True)
    libc, page = ctypes.CDLL(None, use_errno=True), mmap.PAGESIZE
    def guarded(t):
        raw = t.contiguous().view(torch.uint8).reshape(-1)
        pages = -(-raw.numel() // page)
        buf = mmap.mmap(-1, (pages + 1) * page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert libc.mprotect(ctypes.c_void_p(base + pages * page), page, 0) == 0   # PROT_NONE
        off = pages * page - raw.numel()
        out = torch.frombuffer(buf, dtype=torch.uint8, count=raw.numel(), offset=off)
        out.copy_(raw)
        return out.view(t.dtype).view(t.shape), buf
    torch.set_num_threads(2)
    heads, kv_heads, D, bs = 9, 3, 64, 16
    for pool in ("bf16", "int8"):
        for ctx in ([150], [37, 150, 70]):
            blocks = sum(-(-c // bs) for c in ctx)
            rows = blocks * bs - (-ctx[-1]) % bs           # the pool ends at the last context's last slot
            g = torch.Generator().manual_seed(len(ctx))
            k = torch.randn(rows, kv_heads, D, generator=g)
            v = torch.randn(rows, kv_heads, D, generator=g)
            k, v = (quantize_rows(k), quantize_rows(v)) if pool == "int8" else (k.bfloat16(), v.bfloat16())
            (kg, kb), (vg, vb) = guarded(k), guarded(v)
            width, tables, first = max(-(-c // bs) for c in ctx), [], 0
            for c in ctx:                       # in order: the last sequence's blocks are the pool's last
                w = -(-c // bs)
                tables.append(list(range(first, first + w)) + [0] * (width - w))
                first += w
            q = torch.randn(len(ctx), heads, D, generator=g).bfloat16()
            out = torch.empty_like(q)
            ops.paged_attention(q, kg, vg, torch.tensor(tables), torch.arange(len(ctx) + 1), torch.tensor(ctx),
                                bs, 0.125, out)
            assert torch.isfinite(out.float()).all()
    print("read inside the pools")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through libc")
def test_the_loads_stay_inside_the_rows_the_row_attends_to():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "read inside the pools" in done.stdout, \
        f"rc {done.returncode}: {done.stderr[-2000:]}"
