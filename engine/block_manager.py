"""KV block bookkeeping: per-sequence block tables, one per KV-cache group, over one shared
pool of blocks (block_pool.py), with prefix caching. Plain ints only; never imports torch.

KV-cache groups (kv_groups.py, as vLLM's hybrid KV cache manager): a model whose layers all
attend alike has one group; a hybrid (Gemma 2/3, gpt-oss: some layers slide over a window,
the others see the whole context) has a full-attention group and sliding groups, each layer
reading its group's table. `windows` gives each group's window (None: full attention).

Sliding groups: once a sequence's next query no longer sees a block (all its positions
before p - window + 1 for the next position p), the block goes back to the pool and its
table entry becomes FREED. Freed entries are always a prefix of the table (windows only move
forward), are never read, and are skipped by every count, swap and release; a freed block
keeps its prefix-cache hash, so another sequence can still reuse it until it is evicted.
The full group keeps every block.

Prefix caching: a sequence's prompt is hashed block by block (one chain, shared by the
groups); each group looks the hashes up in its own index. A hit of k blocks must be valid in
every group: the full group holds blocks 0..k-1, and a sliding group holds the blocks the
next query still sees (from the one holding position k*bs - window + 1 to k - 1); the
entries before that are FREED. The longest such k wins (a sliding group's early blocks may
be gone while later ones are cached).
"""

from __future__ import annotations

from .block_pool import FREED, BlockPool, block_hash, cdiv, tenant_salt
from .sequence import Sequence

__all__ = ["FREED", "BlockManager", "block_hash", "cdiv", "tenant_salt"]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, sliding_window: int | None = None,
                 windows: tuple[int | None, ...] | None = None):
        self.block_size = block_size
        self.windows = tuple(windows) if windows is not None else (sliding_window,)
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks))    # the swap pool
        # Host blocks released during a step stay unusable until the next step: a swap-in
        # copy reading one may still be pending when a swap-out in the same step writes.
        self.host_pending: list[int] = []
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, len(self.windows))
        self.blocks = self.pool.blocks
        self.prefix_hit_tokens = 0       # cumulative tokens served from the prefix cache
        self.prefix_query_tokens = 0     # cumulative prompt tokens looked up

    # -- capacity -----------------------------------------------------------------------
    @property
    def sliding_window(self) -> int | None:
        """The window when every group slides over the same one, else None."""
        return self.windows[0] if len(set(self.windows)) == 1 else None

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.pool.free_queue)

    @property
    def hash_to_block(self) -> dict[bytes, int]:
        return self.pool.hash_to_block

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one table needs for `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def blocks_for_all(self, num_tokens: int) -> int:
        """Blocks all of a sequence's tables need for `num_tokens` tokens at allocation (the
        sliding groups give theirs back as the window moves on)."""
        return self.num_groups * self.blocks_for(num_tokens)

    def _first_seen(self, group: int, num_computed: int) -> int:
        """The first block of `group` that the query at position `num_computed` sees."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    # -- prefix matching ----------------------------------------------------------------
    def _match_prefix(self, seq: Sequence) -> tuple[list[list[int]], list[bytes]]:
        """Per group, the table prefix a hit gives (FREED where a sliding group needs no
        block), and the hit blocks' hashes. The last token is never served from cache: the
        model must compute at least one position to produce logits."""
        none = [[] for _ in self.windows]
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return none, []                   # (prompt logprobs need every position's logits)
        bs, pool, parent = self.block_size, self.pool, tenant_salt(seq.tenant)
        full = [g for g, w in enumerate(self.windows) if w is None]
        hashes: list[bytes] = []
        found: list[list[int | None]] = [[] for _ in self.windows]      # per group, per block
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids(i * bs, (i + 1) * bs)
            h = block_hash(parent, tokens)
            hit = [pool.lookup(g, h, tokens) for g in range(len(self.windows))]
            if any(hit[g] is None for g in full):                       # the full chain ends here
                break
            hashes.append(h)
            for g, bid in enumerate(hit):
                found[g].append(bid)
            parent = h
        for k in range(len(hashes), 0, -1):                             # the longest hit valid everywhere
            if all(b is not None for g in range(len(self.windows)) for b in found[g][self._first_seen(g, k * bs):k]):
                tables = []
                for g in range(len(self.windows)):
                    lo = self._first_seen(g, k * bs)
                    tables.append([FREED] * lo + found[g][lo:k])
                return tables, hashes[:k]
        return none, []

    def blocks_needed(self, seq: Sequence) -> int:
        """Free blocks that allocating all of `seq`'s tokens would take (cached hits on
        blocks nobody holds still leave the free queue)."""
        tables, hashes = self._match_prefix(seq)
        revived = sum(1 for t in tables for b in t if b != FREED and self.blocks[b].ref_count == 0)
        return self.blocks_for_all(seq.num_tokens) - self.num_groups * len(hashes) + revived

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether all of `seq`'s tokens fit, leaving `reserve` blocks free (the watermark)."""
        return self.blocks_needed(seq) + reserve <= self.num_free_blocks

    def num_exclusive_blocks(self, seq: Sequence) -> int:
        """Blocks that freeing `seq` would return to the free queue."""
        return sum(1 for t in seq.block_tables for b in t if b != FREED and self.blocks[b].ref_count == 1)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens in every group, reusing cached prefix blocks."""
        assert not any(seq.block_tables), f"{seq.request_id} already holds blocks"
        tables, hashes = self._match_prefix(seq)
        for table in tables:
            for bid in table:
                if bid != FREED:
                    self.pool.take(bid)
        seq.block_tables = tables
        seq.block_hashes = list(hashes)
        seq.num_cached_tokens = len(hashes) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.prefix_hit_tokens += seq.num_cached_tokens
        self.prefix_query_tokens += seq.num_tokens
        self._grow(seq, seq.num_tokens)

    # -- growth -------------------------------------------------------------------------
    def _need(self, seq: Sequence, num_tokens: int) -> int:
        want = self.blocks_for(num_tokens)
        return sum(max(0, want - len(t)) for t in seq.block_tables) if seq.block_tables \
            else self.blocks_for_all(num_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self._need(seq, seq.num_computed_tokens + num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Make room for the next `num_new_tokens` tokens to be computed."""
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)

    def rollback(self, seq: Sequence) -> None:
        """Give back every group's blocks past `seq`'s tokens (slots of rejected speculative
        tokens, never hashed: only computed tokens' blocks are). `commit` must not have seen
        the rejected tokens as computed, or a sliding group may have returned a block the
        accepted position's window still reads."""
        keep = self.blocks_for(seq.num_tokens)
        for table in seq.block_tables:
            self.pool.release(table[keep:])
            del table[keep:]

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self._need(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq.request_id} needs {need}, {self.num_free_blocks} free")
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        want = self.blocks_for(num_tokens)
        for table in seq.block_tables:
            while len(table) < want:
                table.append(self.pool.pop_free())

    # -- after the model ran --------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Register the hashes of blocks that the last step filled with computed tokens, then
        (sliding groups) return the blocks the next query no longer sees."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs if self.enable_prefix_caching else 0):
            tokens = seq.token_ids(i * bs, (i + 1) * bs)
            parent = seq.block_hashes[-1] if seq.block_hashes else tenant_salt(seq.tenant)
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            for g, table in enumerate(seq.block_tables):
                if table[i] != FREED:                 # FREED: re-hashed after a swap, the chain only
                    self.pool.register(g, table[i], h, tokens)
        for g, table in enumerate(seq.block_tables):
            if self.windows[g] is None:
                continue
            # Oldest first, so that the free queue evicts the window's oldest blocks first.
            for i in range(self.num_freed(seq, g), min(len(table), self._first_seen(g, seq.num_computed_tokens))):
                self.pool.release([table[i]])
                table[i] = FREED

    @staticmethod
    def num_freed(seq: Sequence, group: int = 0) -> int:
        """Leading entries of `group`'s table returned by the sliding window."""
        table = seq.block_tables[group] if seq.block_tables else []
        n = 0
        while n < len(table) and table[n] == FREED:
            n += 1
        return n

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (device and host); it has nothing computed after."""
        for table in seq.block_tables:
            self.pool.release(table)
        for host in seq.host_tables:
            self.host_pending.extend(host)
        seq.block_tables, seq.host_tables, seq.block_hashes = [], [], []
        seq.num_computed_tokens = 0

    # -- swapping (the host pool) ---------------------------------------------------------
    def _live(self, seq: Sequence) -> int:
        return sum(len(t) - self.num_freed(seq, g) for g, t in enumerate(seq.block_tables))

    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < self._live(seq) <= len(self.host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq` to host blocks; returns (device block, host block) pairs to copy.
        The copies must run before the device blocks are written again (the runner does
        them before the step's forward pass). Freed entries stay freed."""
        pairs: list[tuple[int, int]] = []
        seq.host_tables = []
        for g, table in enumerate(seq.block_tables):
            freed = self.num_freed(seq, g)
            live = table[freed:]
            mine = [(bid, self.host_free.pop()) for bid in live]
            self.pool.release(live)
            seq.host_tables.append([h for _, h in mine])
            seq.block_tables[g] = [FREED] * freed
            pairs += mine
        seq.block_hashes = []
        return pairs

    def swap_in_need(self, seq: Sequence) -> int:
        """Free blocks that swapping `seq` back in takes."""
        return sum(self.blocks_for(seq.num_tokens) - self.num_freed(seq, g) for g in range(len(seq.block_tables)))

    def can_swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        return self.swap_in_need(seq) + reserve <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give `seq` fresh device blocks for all its tokens; returns (host block, device
        block) pairs to copy back. Its computed tokens stay computed."""
        freed = [self.num_freed(seq, g) for g in range(len(seq.block_tables))]
        self._grow(seq, seq.num_tokens)
        pairs: list[tuple[int, int]] = []
        for g, host in enumerate(seq.host_tables):
            pairs += zip(host, seq.block_tables[g][freed[g]:])
            self.host_pending.extend(host)
        seq.host_tables = []
        return pairs

    def end_step(self) -> None:
        """The step's copies are done: host blocks released during it become free."""
        self.host_free.extend(self.host_pending)
        self.host_pending.clear()

    # -- introspection (tests, stats) -----------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is either free (ref 0) or owned exactly ref_count times by `live`;
        every sequence has one table per group, of which only sliding ones have FREED entries,
        all leading."""
        owners: dict[int, int] = {}
        for seq in live:
            assert len(seq.block_tables) in (0, self.num_groups), f"{seq.request_id}: {len(seq.block_tables)} tables"
            for g, table in enumerate(seq.block_tables):
                freed = self.num_freed(seq, g)
                assert FREED not in table[freed:], f"{seq.request_id}: group {g} has a FREED entry after a live one"
                assert freed == 0 or self.windows[g] is not None, f"{seq.request_id}: full group {g} lost blocks"
                for bid in table[freed:]:
                    owners[bid] = owners.get(bid, 0) + 1
        self.pool.check(owners)
        held = [h for seq in live for host in seq.host_tables for h in host]
        assert len(held) == len(set(held)), "a host block is owned twice"
        assert sorted(held + self.host_free + self.host_pending) == list(range(self.num_host_blocks)), "host blocks lost"
