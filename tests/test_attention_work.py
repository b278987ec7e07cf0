"""How the paged attention kernel deals a batch's work to its threads (csrc/attention_items.h,
seen through `torch.ops.streamgate.attention_work`): every item once, a prefill chunk's query
tiles shared between the threads even when many decode rows ride beside it, a decode row's KV
heads kept together. Counts, not timings: the verdicts do not depend on this host's speed."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import paged_attention_ops

ops = paged_attention_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the paged attention kernel did not build (see the log)")

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def work(q_lens, ctx_lens, dtype=torch.bfloat16):
    """The kernel's items for a batch of these query and context lengths, as dicts."""
    width = max(-(-c // BLOCK) for c in ctx_lens)
    tables = torch.arange(len(ctx_lens) * width, dtype=torch.long).view(len(ctx_lens), width)
    pool = torch.zeros(tables.numel() * BLOCK, KV_HEADS, DIM, dtype=dtype)
    q = torch.zeros(sum(q_lens), HEADS, DIM, dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.long)
    rows = ops.attention_work(q, pool, tables, starts, torch.tensor(ctx_lens, dtype=torch.long), BLOCK)
    keys = ("bin", "seq", "kv_head", "row_begin", "row_end", "h0", "h1")
    return [dict(zip(keys, r)) for r in rows.tolist()]


def cost(item, q_lens, ctx_lens):
    """Query rows times the keys they read, times KV heads: the kernel's own measure."""
    q_len, ctx = q_lens[item["seq"]], ctx_lens[item["seq"]]
    heads = 1 if item["kv_head"] >= 0 else item["h1"] - item["h0"]
    return (item["row_end"] - item["row_begin"]) * (ctx - q_len + item["row_end"]) * heads


def every_piece(q_lens):
    """What a batch of these query lengths must cover, once each."""
    return sorted((b, h, r) for b, q in enumerate(q_lens) for h in range(KV_HEADS) for r in range(q))


def covered(items, q_lens):
    """(sequence, KV head, query row) for every piece of work the items do, with repeats."""
    out = []
    for w in items:
        heads = [w["kv_head"]] if w["kv_head"] >= 0 else range(w["h0"], w["h1"])
        out += [(w["seq"], h, r) for h in heads for r in range(w["row_begin"], w["row_end"])]
    return sorted(out)


@pytest.mark.parametrize("decode_rows", [0, 3, 7, 31])
def test_a_prefill_chunk_is_shared_between_threads_beside_decode_rows(two_threads, decode_rows):
    # Decode rows first, then a 286-token first chunk: what a busy server's prefill step carries.
    q_lens = [1] * decode_rows + [286]
    ctx_lens = [330 + i for i in range(decode_rows)] + [286]
    items = work(q_lens, ctx_lens)
    assert covered(items, q_lens) == every_piece(q_lens)
    bins = sorted({w["bin"] for w in items})
    assert len(bins) >= 2
    chunk = len(q_lens) - 1
    assert all(any(w["seq"] == chunk for w in items if w["bin"] == b) for b in bins), \
        "every thread takes some of the chunk's query tiles"
    load = {b: sum(cost(w, q_lens, ctx_lens) for w in items if w["bin"] == b) for b in bins}
    total = sum(load.values())
    assert max(load.values()) <= 1.25 * total / len(bins), load


def test_a_decode_rows_kv_heads_stay_in_one_bin_when_sequences_go_round(two_threads):
    q_lens, ctx_lens = [1] * 16 + [64], [200 + 10 * i for i in range(16)] + [64]
    items = work(q_lens, ctx_lens)
    for seq in range(16):
        assert len({w["bin"] for w in items if w["seq"] == seq}) == 1, f"decode row {seq} split across bins"
    assert covered(items, q_lens) == every_piece(q_lens)
