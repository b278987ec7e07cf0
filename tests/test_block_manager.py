"""Block manager: allocation, growth, freeing and prefix caching (no torch, milliseconds)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import FREED, BlockManager
from engine.config import SamplingParams
from engine.sequence import Sequence

P = SamplingParams(max_tokens=8)


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, P)


def test_allocate_covers_all_tokens_and_free_returns_everything():
    """A 33-token sequence with 16-token blocks gets 3 blocks; freeing returns them."""
    bm = BlockManager(10, 16)
    s = seq("a", list(range(33)))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_can_allocate_respects_reserve():
    """The watermark reserve is kept free: 3 needed + 2 reserved does not fit in 4."""
    bm = BlockManager(4, 16)
    s = seq("a", list(range(40)))
    assert bm.can_allocate(s) and not bm.can_allocate(s, reserve=2)


def test_prefix_hit_shares_full_blocks_but_never_the_last_token():
    """A second prompt with the same 32-token prefix reuses 2 blocks; an identical 32-token
    prompt reuses only 1 (its last token must still be computed)."""
    bm = BlockManager(20, 16)
    a = seq("a", list(range(40)))
    bm.allocate(a)
    a.num_computed_tokens = 40
    bm.commit(a)
    b = seq("b", list(range(32)) + [99, 98])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 32
    assert b.num_computed_tokens == 32
    c = seq("c", list(range(32)))
    bm.allocate(c)
    assert c.num_cached_tokens == 16 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]
    bm.check_invariants([a, b, c])


def test_no_false_sharing_when_tokens_differ_in_an_earlier_block():
    """Same second block but a different first block: chained hashes give no hit."""
    bm = BlockManager(20, 4)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.commit(a)
    b = seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(a.block_table)


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    """A freed sequence's cached blocks survive until the free queue reaches them; cached
    prefix blocks outlive its tail blocks and uncached blocks."""
    bm = BlockManager(6, 4)
    a = seq("a", list(range(12)))                # 3 full blocks
    bm.allocate(a)
    a.num_computed_tokens = 12
    bm.commit(a)
    first = list(a.block_table)
    bm.free(a)
    again = seq("again", list(range(12)) + [50])
    bm.allocate(again)                           # revives all 3 cached blocks
    assert again.block_table[:3] == first and again.num_cached_tokens == 12
    bm.free(again)
    # Unrelated tokens need 4 blocks: the uncached block and the never-used ones go first,
    # then the cached tail block; the two cached head blocks survive.
    other = seq("other", [900 + i for i in range(16)])
    bm.allocate(other)
    assert first[2] in other.block_table
    assert first[0] not in other.block_table and first[1] not in other.block_table
    bm.free(other)
    later = seq("later", list(range(12)) + [60])
    bm.allocate(later)
    assert later.num_cached_tokens == 8 and later.block_table[:2] == first[:2]
    bm.check_invariants([later])


def test_free_twice_is_caught():
    """Releasing a block more often than it was taken trips the assertion."""
    bm = BlockManager(4, 4)
    a = seq("a", [1, 2, 3])
    bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    a.block_tables = [table]
    try:
        bm.free(a)
    except AssertionError:
        return
    raise AssertionError("double free not detected")


ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "free", "commit", "swap"]), st.integers(0, 7),
                         st.integers(1, 40)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 4, 16]), caching=st.booleans(),
       windows=st.sampled_from([(None,), (5,), (None, 6), (None, 5, 5)]))
def test_blocks_are_never_lost_or_double_owned(ops, block_size, caching, windows):
    """After any sequence of allocate/append/commit/free/swap, with one full-attention group,
    one sliding group or a hybrid's groups, every block is free or owned exactly ref-count
    times, and all blocks are free when nothing runs."""
    bm = BlockManager(24, block_size, enable_prefix_caching=caching, windows=windows, num_host_blocks=16)
    live: dict[int, Sequence] = {}
    swapped: set[int] = set()
    for op, key, n in ops:
        bm.end_step()
        s = live.get(key)
        if op == "swap" and s is not None:
            if key in swapped and bm.can_swap_in(s):
                bm.swap_in(s)
                swapped.discard(key)
            elif key not in swapped and s.num_computed_tokens and bm.can_swap_out(s):
                bm.swap_out(s)
                swapped.add(key)
            bm.check_invariants(list(live.values()))
            continue
        if key in swapped and op in ("grow", "commit"):
            continue
        if op == "new" and s is None:
            # Shared-prefix prompts (the key's low bit picks a family) exercise caching.
            cand = seq(str(key), [key % 2] * (n // 2) + list(range(n - n // 2)))
            if bm.can_allocate(cand):
                bm.allocate(cand)
                live[key] = cand
        elif op == "grow" and s is not None:
            s.num_computed_tokens = s.num_tokens
            bm.commit(s)
            if bm.can_append(s, 1):
                s.output_token_ids.append(n)
                bm.append_slots(s, 1)
        elif op == "commit" and s is not None:
            s.num_computed_tokens = s.num_tokens
            bm.commit(s)
        elif op == "free" and s is not None:
            bm.free(s)
            del live[key]
            swapped.discard(key)
        bm.check_invariants(list(live.values()))
        for k, t in live.items():
            assert k in swapped or all(len(table) * block_size >= t.num_tokens for table in t.block_tables)
    for s in live.values():
        bm.free(s)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_host_blocks_released_in_a_step_are_not_reused_until_the_next():
    """A swap-in's host blocks are still being read during its step, so a swap-out in the
    same step must get other host blocks; after end_step they are free again."""
    bm = BlockManager(8, 4, num_host_blocks=2)
    a, c = seq("a", list(range(8))), seq("c", [50 + i for i in range(8)])
    bm.allocate(a)
    a.num_computed_tokens = 8
    a_host = [h for _, h in bm.swap_out(a)]
    bm.end_step()
    bm.swap_in(a)                                  # same step: a's host blocks are being read
    bm.allocate(c)
    assert not bm.can_swap_out(c)                  # a's host blocks are not reusable yet
    bm.end_step()
    assert bm.can_swap_out(c)
    assert sorted(h for _, h in bm.swap_out(c)) == sorted(a_host)
    bm.check_invariants([a, c])


# -- KV-cache groups: a hybrid model's full and sliding tables ------------------------------------
def hybrid(num_blocks: int, **kw) -> BlockManager:
    """A full-attention group and a group sliding over 6 tokens, blocks of 4."""
    return BlockManager(num_blocks, 4, windows=(None, 6), **kw)


def test_sliding_group_returns_blocks_the_window_left_and_the_full_group_keeps_them():
    """A 30-token prompt takes 8 blocks in each group; once computed, the sliding group keeps
    only the 2 blocks its next query sees (positions 25..30); through 20 decode steps the
    full group grows by a block every 4 tokens while the sliding group never holds more than
    the 3 blocks a 6-token window can touch."""
    bm = hybrid(40)
    s = seq("a", list(range(30)))
    assert bm.blocks_needed(s) == 16
    bm.allocate(s)
    s.num_computed_tokens = 30
    bm.commit(s)
    full, sliding = s.block_tables
    assert len(full) == 8 and FREED not in full
    assert sliding[:6] == [FREED] * 6 and FREED not in sliding[6:]
    assert bm.num_used_blocks == 8 + 2
    for t in range(20):
        s.output_token_ids.append(t)
        bm.append_slots(s, 1)
        s.num_computed_tokens += 1
        bm.commit(s)
        bm.check_invariants([s])
        live = len(s.block_tables[1]) - bm.num_freed(s, 1)
        assert live <= 3 and bm.num_used_blocks == len(s.block_tables[0]) + live
    assert len(s.block_tables[0]) == bm.blocks_for(50)
    bm.free(s)
    assert bm.num_free_blocks == 40


def test_a_prefix_hit_must_be_valid_in_every_group():
    """The sliding group's oldest freed blocks are evicted first. A prompt sharing 16 tokens
    still hits all 4 blocks: the full group holds them and the sliding group needs only the
    two its window sees, still cached (its table starts FREED). A prompt sharing 12 tokens
    gets no hit: the full group has it, but the sliding group's window blocks were evicted."""
    bm = hybrid(12)
    a = seq("a", list(range(24)))
    bm.allocate(a)                               # every block of the pool
    a.num_computed_tokens = 24
    bm.commit(a)                                 # sliding blocks 0..3 return, cached
    freed_sliding = [b for b in range(12) if bm.blocks[b].ref_count == 0]
    assert len(freed_sliding) == 4
    filler = seq("filler", [900, 901, 902])      # one block per group: evicts the two oldest
    bm.allocate(filler)
    bm.free(filler)
    c = seq("c", list(range(16)) + [99])
    assert bm.blocks_needed(c) == 2 * 5 - 2 * 4 + 2          # two cached sliding blocks revived
    bm.allocate(c)
    assert c.num_cached_tokens == 16
    assert c.block_tables[0][:4] == a.block_tables[0][:4]
    assert c.block_tables[1][:2] == [FREED, FREED] and set(c.block_tables[1][2:4]) <= set(freed_sliding)
    bm.check_invariants([a, c])
    d = seq("d", list(range(12)) + [98])
    assert bm.blocks_needed(d) == 2 * 4          # a hit of 3 would need 2 * (4 - 3)


def test_swap_moves_every_groups_live_blocks_and_keeps_freed_entries():
    """Swapping out a hybrid sequence copies the full group's blocks and the sliding group's
    live ones; swapping in gives fresh blocks behind the same FREED prefix."""
    bm = hybrid(30, num_host_blocks=20)
    s = seq("a", list(range(30)))
    bm.allocate(s)
    s.num_computed_tokens = 30
    bm.commit(s)
    assert bm.swap_in_need(s) == 16 - 6
    pairs = bm.swap_out(s)
    assert len(pairs) == 8 + 2 and bm.num_free_blocks == 30
    assert s.block_tables == [[], [FREED] * 6] and [len(h) for h in s.host_tables] == [8, 2]
    bm.end_step()
    assert bm.swap_in_need(s) == 8 + 2
    back = bm.swap_in(s)
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert s.block_tables[1][:6] == [FREED] * 6 and len(s.block_tables[1]) == 8
    bm.check_invariants([s])


def test_rollback_gives_back_every_groups_blocks_past_the_tokens():
    """Slots reserved for 6 speculative tokens of which none were kept: each group's table
    shrinks back to the blocks its tokens need and the blocks return to the pool."""
    bm = hybrid(20)
    s = seq("a", list(range(14)))
    bm.allocate(s)
    s.num_computed_tokens = 14
    bm.commit(s)
    bm.append_slots(s, 7)                        # room for 21 tokens: 6 blocks per group
    assert [len(t) for t in s.block_tables] == [6, 6]
    bm.rollback(s)
    assert [len(t) for t in s.block_tables] == [4, 4]
    bm.check_invariants([s])
    assert bm.num_used_blocks == 4 + 4 - bm.num_freed(s, 1)
