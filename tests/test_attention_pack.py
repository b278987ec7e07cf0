"""Query tiles reading spans packed once for all the tiles of a sequence (csrc/attention_pack.h)
against a tile that packs its own: the same bits. Each tile of a 70-row chunk over 300 tokens
(three tiles: shared spans) is also run as a one-tile chunk of its own (rows r0..r1 of a context
that ends at r1: the same queries, keys and spans, packed by the tile itself)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import loaded_variant, paged_attention_ops
from tests.test_paged_kernel import pools_as, random_batch

ops = paged_attention_ops()
pytestmark = pytest.mark.skipif(ops is None or loaded_variant() != "avx512_bf16",
                                reason="the bf16 query tiles on VDPBF16PS run in the avx512_bf16 build only")


@pytest.fixture
def no_amx():
    """The VDPBF16PS tiles (AMX tiles pack their own spans)."""
    before = ops.amx_tiles()
    ops.amx_tiles(False)
    yield
    ops.amx_tiles(before)


@pytest.mark.parametrize("pool", ["bf16", "int8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_tiles_on_shared_spans_give_the_bits_of_tiles_packing_their_own(pool, block_size, no_amx):
    q_lens, ctx_lens, heads, kv_heads, dim = [70, 1, 40], [300, 90, 40], 9, 3, 64
    q, k_pool, v_pool, tables = random_batch(q_lens, ctx_lens, heads, kv_heads, dim, block_size, torch.bfloat16, 3)
    k_pool, v_pool, _, _ = pools_as(pool, k_pool, v_pool)
    starts = torch.tensor([0, 70, 71, 111])
    whole = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    ops.paged_attention(q, k_pool, v_pool, tables, starts, torch.tensor(ctx_lens), block_size, 0.125, whole)
    for r0, r1 in ((0, 32), (32, 64), (64, 70)):
        alone = torch.full((r1 - r0, heads, dim), float("nan"), dtype=torch.bfloat16)
        ops.paged_attention(q[r0:r1], k_pool, v_pool, tables[:1], torch.tensor([0, r1 - r0]),
                            torch.tensor([300 - 70 + r1]), block_size, 0.125, alone)
        assert torch.equal(alone, whole[r0:r1]), (r0, r1)
    for r0, r1 in ((0, 32), (32, 40)):                      # the first chunk of 40 rows: two tiles
        alone = torch.full((r1 - r0, heads, dim), float("nan"), dtype=torch.bfloat16)
        ops.paged_attention(q[71 + r0:71 + r1], k_pool, v_pool, tables[2:], torch.tensor([0, r1 - r0]),
                            torch.tensor([r1]), block_size, 0.125, alone)
        assert torch.equal(alone, whole[71 + r0:71 + r1]), (r0, r1)
    assert not whole.isnan().any()
