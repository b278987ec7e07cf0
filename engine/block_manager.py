"""KV block bookkeeping: fixed-size blocks, ref counts, a free queue, per-sequence block
tables and prefix caching. Plain ints only; never imports torch.

Prefix caching: a full, computed block is named by a chained hash of (previous block's
hash, its token ids). A new sequence walks its prompt block by block and reuses every
block whose hash is registered *and* whose stored tokens equal its own (the check that
rules out false sharing). A block whose last owner frees it keeps its hash and goes to the
back of the free queue; allocation takes from the front, so cached blocks are evicted
least-recently-freed first (LRU) and a hit on a free block takes it back off the queue.

Sliding windows (`sliding_window`, set where every layer of the model slides over the same
window and the attention reads only the window: ModelRunner.kv_free_window): once a
sequence's next query no longer sees a block (all its positions before p - window + 1 for
the next position p), the block goes back to the pool and its table entry becomes FREED.
Freed entries are always a prefix of the table (windows only move forward), are never read,
and are skipped by every count, swap and release; a freed block keeps its prefix-cache hash,
so another sequence can still reuse it until it is evicted.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict

from .sequence import Sequence


FREED = -1      # a block_table entry whose block fell out of the sliding window and was returned


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1024)
def tenant_salt(tenant: str | None) -> bytes:
    """The parent of a sequence's first block: its tenant's salt, so that no tenant's
    blocks match another's (one tenant could otherwise learn, from its time to first token
    and the hit rate, whether another recently sent a prefix). None (no tenant): b""."""
    if tenant is None:
        return b""
    return hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=16, person=b"sg-tenant").digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained hash of one full block; 128-bit BLAKE2b, so collisions are not a concern."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, sliding_window: int | None = None):
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks))    # the swap pool
        # Host blocks released during a step stay unusable until the next step: a swap-in
        # copy reading one may still be pending when a swap-out in the same step writes.
        self.host_pending: list[int] = []
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_hit_tokens = 0       # cumulative tokens served from the prefix cache
        self.prefix_query_tokens = 0     # cumulative prompt tokens looked up

    # -- capacity -----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix matching ----------------------------------------------------------------
    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached blocks covering a prefix of `seq`. The last token is never served from
        cache: the model must compute at least one position to produce logits."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return [], []                     # (prompt logprobs need every position's logits)
        bs, ids, hashes, parent = self.block_size, [], [], tenant_salt(seq.tenant)
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids(i * bs, (i + 1) * bs)
            h = block_hash(parent, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            ids.append(bid)
            hashes.append(h)
            parent = h
        return ids, hashes

    def blocks_needed(self, seq: Sequence) -> int:
        """Free blocks that allocating all of `seq`'s tokens would take (cached hits on
        blocks nobody holds still leave the free queue)."""
        hits, _ = self._match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(seq.num_tokens) - len(hits) + revived

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether all of `seq`'s tokens fit, leaving `reserve` blocks free (the watermark)."""
        return self.blocks_needed(seq) + reserve <= self.num_free_blocks

    def num_exclusive_blocks(self, seq: Sequence) -> int:
        """Blocks that freeing `seq` would return to the free queue."""
        return sum(1 for b in seq.block_table if b != FREED and self.blocks[b].ref_count == 1)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hits, hashes = self._match_prefix(seq)
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_queue[bid]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.block_hashes = list(hashes)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.prefix_hit_tokens += seq.num_cached_tokens
        self.prefix_query_tokens += seq.num_tokens
        self._grow(seq, seq.num_tokens)

    # -- growth -------------------------------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Make room for the next `num_new_tokens` tokens to be computed."""
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)

    def rollback(self, seq: Sequence) -> None:
        """Give back the blocks past `seq`'s tokens (slots of rejected speculative tokens,
        never hashed: only computed tokens' blocks are). Stale slots in the blocks kept are
        written again when their positions are computed."""
        keep = self.blocks_for(seq.num_tokens)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq.request_id} needs {need}, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._pop_free())

    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:            # evict its cache entry
            if self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return bid

    # -- after the model ran --------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Register the hashes of blocks that the last step filled with computed tokens, then
        (sliding windows) return the blocks the next query no longer sees."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs if self.enable_prefix_caching else 0):
            tokens = seq.token_ids(i * bs, (i + 1) * bs)
            parent = seq.block_hashes[-1] if seq.block_hashes else tenant_salt(seq.tenant)
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            if seq.block_table[i] == FREED:                 # re-hashed after a swap: the chain only
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tuple(tokens)
                self.hash_to_block[h] = block.block_id
        if self.sliding_window:
            table = seq.block_table
            unseen = max(0, seq.num_computed_tokens - self.sliding_window + 1) // bs   # blocks wholly before
            for i in range(min(len(table), unseen) - 1, -1, -1):
                if table[i] == FREED:
                    break
                self._release([table[i]])
                table[i] = FREED

    @staticmethod
    def num_freed(seq: Sequence) -> int:
        """Leading table entries returned by the sliding window."""
        n = 0
        while n < len(seq.block_table) and seq.block_table[n] == FREED:
            n += 1
        return n

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (device and host); it has nothing computed after."""
        self._release(seq.block_table)
        self.host_pending.extend(seq.host_table)
        seq.block_table, seq.host_table, seq.block_hashes = [], [], []
        seq.num_computed_tokens = 0

    # -- swapping (the host pool) ---------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(seq.block_table) - self.num_freed(seq) <= len(self.host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq` to host blocks; returns (device block, host block) pairs to copy.
        The copies must run before the device blocks are written again (the runner does
        them before the step's forward pass)."""
        freed = self.num_freed(seq)
        live = seq.block_table[freed:]
        pairs = [(bid, self.host_free.pop()) for bid in live]
        self._release(live)
        seq.host_table = [h for _, h in pairs]
        seq.block_table, seq.block_hashes = [FREED] * freed, []     # freed entries stay freed
        return pairs

    def can_swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        return self.blocks_for(seq.num_tokens) - self.num_freed(seq) + reserve <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give `seq` fresh device blocks for all its tokens; returns (host block, device
        block) pairs to copy back. Its computed tokens stay computed."""
        self._grow(seq, seq.num_tokens)
        pairs = list(zip(seq.host_table, seq.block_table[self.num_freed(seq):]))
        self.host_pending.extend(seq.host_table)
        seq.host_table = []
        return pairs

    def end_step(self) -> None:
        """The step's copies are done: host blocks released during it become free."""
        self.host_free.extend(self.host_pending)
        self.host_pending.clear()

    def _release(self, table: list[int]) -> None:
        """Drop one reference to each block. Tail blocks are queued first, so among cached
        blocks the tails are evicted before the prefixes; uncached blocks are reused first."""
        for bid in reversed(table):
            if bid == FREED:
                continue
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_queue[bid] = None
                    self.free_queue.move_to_end(bid, last=False)   # uncached: reuse first
                else:
                    self.free_queue[bid] = None

    # -- introspection (tests, stats) -----------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is either free (ref 0) or owned exactly ref_count times by `live`."""
        owners: dict[int, int] = {}
        for seq in live:
            for bid in seq.block_table[self.num_freed(seq):]:
                owners[bid] = owners.get(bid, 0) + 1
        for block in self.blocks:
            expected = owners.get(block.block_id, 0)
            assert block.ref_count == expected, f"block {block.block_id}: ref {block.ref_count} != {expected} owners"
            assert (block.block_id in self.free_queue) == (expected == 0), f"block {block.block_id} free-queue state wrong"
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, f"stale hash entry for block {bid}"
        held = [h for seq in live for h in seq.host_table]
        assert len(held) == len(set(held)), "a host block is owned twice"
        assert sorted(held + self.host_free + self.host_pending) == list(range(self.num_host_blocks)), "host blocks lost"
