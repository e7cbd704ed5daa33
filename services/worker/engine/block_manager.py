"""KV block bookkeeping for one rank: reference counts, per-request block tables, prefix cache
(chained block hashes from shared.block_hash) and LRU eviction among unreferenced blocks.

Invariant: a block is in `_free` iff its ref_count is 0; a free block may still hold a cached
prefix (hash set) until it is handed out again, which evicts it (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shared.block_hash import chain_hash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        # unreferenced blocks, eviction order first (uncached ones are kept at the front)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_queries_tokens = 0  # tokens looked up in the prefix cache (tokens)
        self.prefix_hits_tokens = 0  # of which found (tokens)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def lookup_prefix(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached chain of full blocks of `token_ids` (at most
        max_blocks). Takes no reference."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(min(max_blocks, len(token_ids) // bs)):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries_tokens += num_query_tokens
            self.prefix_hits_tokens += num_hit_tokens

    def can_allocate(self, num_new_blocks: int, cached: Sequence[int] = ()) -> bool:
        # cached blocks that are currently free leave the free list when taken
        free_cached = sum(1 for b in cached if self._ref_counts[b] == 0)
        return num_new_blocks <= len(self._free) - free_cached

    # ---- mutations -----------------------------------------------------------------------
    def take(self, block_ids: Sequence[int]) -> None:
        """Reference cached blocks (prefix hits)."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks (ref_count 1), evicting the least recently freed cached ones."""
        if num_blocks > len(self._free):
            raise RuntimeError("allocate() without can_allocate()")
        out: list[int] = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            h = self._hashes[b]
            if h is not None:
                if self._hash_to_block.get(h) == b:
                    del self._hash_to_block[h]
                self._hashes[b] = None
            self._ref_counts[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference of each block; tail blocks are freed first so they are evicted
        first (a shared prefix outlives the suffixes hanging off it)."""
        for b in reversed(block_ids):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                if self._hashes[b] is None:
                    self._free.move_to_end(b, last=False)
            elif self._ref_counts[b] < 0:
                raise RuntimeError(f"block {b} freed twice")

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full, computed block under its chain hash (first writer wins)."""
        if not self.enable_prefix_caching or self._hashes[block_id] is not None:
            return
        if block_hash not in self._hash_to_block:
            self._hash_to_block[block_hash] = block_id
            self._hashes[block_id] = block_hash

    def block_hash(self, block_id: int) -> int | None:
        return self._hashes[block_id]
