"""Decode rows cut into parts (csrc/attention_parts.h): a row of 256 keys or more attends in 2, 4
or 8 parts by its key count alone; decoded beside fewer sequences than threads its parts are work
items of their own, beside more they run one after another in one item. Either way, and on one
thread, the row gets the same bits, equal to the eager math within the dtype's tolerance.
Counts and bits, not timings: the verdicts do not depend on this host's speed."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import loaded_variant, paged_attention_ops
from tests.test_attention_work import two_threads  # noqa: F401 (a fixture)
from tests.test_paged_kernel import pools_as, random_batch, reference_ext

ops = paged_attention_ops()
pytestmark = pytest.mark.skipif(ops is None or not hasattr(ops, "decode_parts"),
                                reason="the paged attention kernel did not build (see the log)")

HEADS, KV_HEADS, DIM, BLOCK, SPAN = 9, 3, 64, 16, 64


def expected_parts(keys: int) -> int:
    """The rule as the header states it: the largest power of two P <= 8 with P * P * 64 <= keys."""
    parts = 1
    while parts < 8 and 4 * parts * parts * 64 <= keys:
        parts *= 2
    return parts


@pytest.fixture
def parts_off():
    ops.decode_parts(False)
    yield
    ops.decode_parts(True)


def items(ctx_lens, dtype=torch.bfloat16):
    """attention_work's items for one decode row per sequence, as dicts."""
    width = max(-(-c // BLOCK) for c in ctx_lens)
    tables = torch.arange(len(ctx_lens) * width, dtype=torch.long).view(len(ctx_lens), width)
    pool = torch.zeros(tables.numel() * BLOCK, KV_HEADS, DIM, dtype=dtype)
    q = torch.zeros(len(ctx_lens), HEADS, DIM, dtype=dtype)
    rows = ops.attention_work(q, pool, tables, torch.arange(len(ctx_lens) + 1), torch.tensor(ctx_lens), BLOCK)
    keys = ("bin", "seq", "kv_head", "row_begin", "row_end", "h0", "h1", "k0", "k1", "parts", "p0", "p1")
    return [dict(zip(keys, r)) for r in rows.tolist()]


# Builds with AVX-512 (the avx512, avx512_vnni and avx512_bf16 variants, engine/kernels.py) take a decode row
# as one item for all heads, and only they cut it in parts; the others' decode rows are query
# tiles. Named by the build, not asked of its work list, so a build that lost its parts fails.
PARTS_BUILT = ops is not None and loaded_variant() in ("avx512", "avx512_vnni", "avx512_bf16")
needs_parts = pytest.mark.skipif(not PARTS_BUILT, reason="this build has no AVX-512 (decode rows are query "
                                                         "tiles): no parts")


@needs_parts
@pytest.mark.parametrize("ctx", [127, 255, 256, 320, 1023, 1024, 4095, 4096, 5000])
def test_a_row_alone_is_cut_by_its_keys_into_parts_that_are_items_of_their_own(two_threads, ctx):
    found = items([ctx])
    parts = expected_parts(ctx)
    assert {(w["k0"], w["k1"], w["parts"]) for w in found} == {(0, ctx, parts)}
    if parts == 1:
        assert len(found) == KV_HEADS and all(w["h1"] - w["h0"] == 1 for w in found), "one part: split by head"
        return
    assert sorted((w["p0"], w["p1"]) for w in found) == [(p, p + 1) for p in range(parts)]
    assert all((w["h0"], w["h1"]) == (0, KV_HEADS) for w in found)
    assert len({w["bin"] for w in found}) >= 2, "the parts are shared between the threads"


@needs_parts
def test_beside_enough_sequences_a_row_runs_its_parts_in_one_item(two_threads):
    ctx_lens = [100, 130, 320, 1100, 4200, 64, 700, 2000]
    found = items(ctx_lens)
    assert len(found) == len(ctx_lens)
    for w in found:
        assert (w["k0"], w["k1"], w["parts"], w["p0"], w["p1"]) == \
            (0, ctx_lens[w["seq"]], expected_parts(ctx_lens[w["seq"]]), 0, expected_parts(ctx_lens[w["seq"]]))


@needs_parts
def test_parts_switched_off_leave_a_row_whole(two_threads, parts_off):
    found = items([1100])
    assert {w["parts"] for w in found} == {1}
    assert len(found) == KV_HEADS, "a row alone in one part is split by KV head"


FEATURES = {"plain": (0, 0.0, False), "window": (300, 0.0, False), "sinks+softcap": (0, 3.0, True)}


def attend(q, k_pool, v_pool, tables, ctx_lens, dtype, features):
    window, softcap, sinks = features
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    ops.paged_attention_ext(q, k_pool, v_pool, tables, torch.arange(len(ctx_lens) + 1), torch.tensor(ctx_lens),
                            BLOCK, 0.3, window, softcap, sinks, out)
    return out


@pytest.mark.parametrize("pool", ["model dtype", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("ctx", [100, 255, 256, 333, 1100, 4200])
def test_a_row_gets_the_same_bits_alone_beside_others_and_on_one_thread(ctx, feature, dtype, pool, all_threads):
    window, softcap, with_sinks = FEATURES[feature]
    ctx_lens = [ctx, 40, 500, 129, 900, 260]                      # the row, then five others
    q, k_pool, v_pool, tables = random_batch([1] * len(ctx_lens), ctx_lens, HEADS, KV_HEADS, DIM, BLOCK, dtype,
                                             seed=ctx)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(9)) * 2 if with_sinks else None
    k_pool, v_pool, kd, vd = pools_as(pool, k_pool, v_pool)
    features = (window, softcap, sinks)
    alone = attend(q[:1], k_pool, v_pool, tables[:1], ctx_lens[:1], dtype, features)
    beside = attend(q, k_pool, v_pool, tables, ctx_lens, dtype, features)
    torch.set_num_threads(1)
    one_thread = attend(q[:1], k_pool, v_pool, tables[:1], ctx_lens[:1], dtype, features)
    torch.ops.streamgate.elastic_threads(2)                   # the served engines' pool: parts claimed as chunks
    try:
        pooled = attend(q[:1], k_pool, v_pool, tables[:1], ctx_lens[:1], dtype, features)
    finally:
        torch.ops.streamgate.elastic_threads(0)
    assert torch.equal(alone[0], beside[0])
    assert torch.equal(alone, one_thread)
    assert torch.equal(alone, pooled)
    want = reference_ext(q, kd, vd, tables, [1] * len(ctx_lens), ctx_lens, BLOCK, 0.3, window, softcap, sinks)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(beside.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_switching_parts_off_changes_only_the_rounding(dtype, all_threads):
    ctx_lens = [1100, 333]
    q, k_pool, v_pool, tables = random_batch([1, 1], ctx_lens, HEADS, KV_HEADS, DIM, BLOCK, dtype, seed=5)
    on = attend(q, k_pool, v_pool, tables, ctx_lens, dtype, (0, 0.0, None))
    ops.decode_parts(False)
    try:
        off = attend(q, k_pool, v_pool, tables, ctx_lens, dtype, (0, 0.0, None))
    finally:
        ops.decode_parts(True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(on.float(), off.float(), atol=tol, rtol=tol)
