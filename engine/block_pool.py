"""The shared pool of KV blocks: ref counts, the free queue and the prefix-cache index.
Plain ints only; never imports torch. The block manager (block_manager.py) keeps the
per-sequence tables on top of it.

Every block is one `block_size`-token page of a KV-cache group (kv_groups.py): the pool is
shared by all groups, and a block serves one group at a time. A full, computed block is
named by a chained hash of (previous block's hash, its token ids), registered in its
group's index: the same tokens have one cached block per group. A block whose last owner
releases it keeps its hash and goes to the back of the free queue; allocation takes from the
front, so cached blocks are evicted least-recently-freed first (LRU) and a hit on a free
block takes it back off the queue.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict

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
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "group")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.group = 0                  # the KV-cache group whose index holds its hash


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int = 1):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.indexes: list[dict[bytes, int]] = [{} for _ in range(num_groups)]   # per group: hash -> block

    @property
    def hash_to_block(self) -> dict[bytes, int]:
        """Group 0's index (the only one of a model whose layers all attend alike)."""
        return self.indexes[0]

    def lookup(self, group: int, h: bytes, tokens: list[int]) -> int | None:
        """The cached block of `group` holding exactly `tokens` under hash `h`, if any (the
        token check rules out false sharing)."""
        bid = self.indexes[group].get(h)
        if bid is None or self.blocks[bid].token_ids != tuple(tokens):
            return None
        return bid

    def register(self, group: int, bid: int, h: bytes, tokens: list[int]) -> None:
        """Name a full, computed block by its hash (the first block with it wins)."""
        block = self.blocks[bid]
        if block.hash is None and h not in self.indexes[group]:
            block.hash, block.token_ids, block.group = h, tuple(tokens), group
            self.indexes[group][h] = bid

    def take(self, bid: int) -> None:
        """One more reference to a cached block (off the free queue if nobody held it)."""
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free_queue[bid]
        block.ref_count += 1

    def pop_free(self) -> int:
        """A block from the front of the free queue, its cache entry evicted."""
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            index = self.indexes[block.group]
            if index.get(block.hash) == bid:
                del index[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return bid

    def release(self, table: list[int]) -> None:
        """Drop one reference to each block. Tail blocks are queued first, so among cached
        blocks the tails are evicted before the prefixes; uncached blocks are reused first."""
        for bid in reversed(table):
            if bid == FREED:
                continue
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                self.free_queue[bid] = None
                if block.hash is None:
                    self.free_queue.move_to_end(bid, last=False)   # uncached: reuse first

    def check(self, owners: dict[int, int]) -> None:
        """Every block is free (ref 0) or held exactly ref_count times (`owners`); every
        index entry names a block that carries its hash."""
        for block in self.blocks:
            expected = owners.get(block.block_id, 0)
            assert block.ref_count == expected, f"block {block.block_id}: ref {block.ref_count} != {expected} owners"
            assert (block.block_id in self.free_queue) == (expected == 0), f"block {block.block_id} free-queue state wrong"
        for group, index in enumerate(self.indexes):
            for h, bid in index.items():
                assert self.blocks[bid].hash == h and self.blocks[bid].group == group, f"stale hash entry for block {bid}"
