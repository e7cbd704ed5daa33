"""KV block bookkeeping for one rank: reference counts, per-request block tables, prefix cache
(chained block hashes from shared.block_hash) and LRU eviction among unreferenced blocks.

Invariant: a block is in `_free` iff its ref_count is 0; a free block may still hold a cached
prefix (hash set) until it is handed out again, which evicts it (least recently freed first).
`on_evict` (the host tier, kv_offload.py) is told every evicted (block, hash) before `allocate`
returns, so before anything can write those blocks.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

from shared.block_hash import chain_hash


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        on_evict: Callable[[list[tuple[int, int]]], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        # unreferenced blocks, eviction order first (uncached ones are kept at the front)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cursor = 0  # next-fit position for runs of fresh blocks
        self.prefix_queries_tokens = 0  # tokens looked up in the prefix cache (tokens)
        self.prefix_hits_tokens = 0  # of which found (tokens)
        self._on_evict = on_evict
        self._evicted: list[tuple[int, int]] = []  # (block, hash) evicted by the current allocate

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

    def lookup_prefix(self, token_ids: Sequence[int], max_blocks: int, root: int | None = None) -> list[int]:
        """Block ids of the longest cached chain of full blocks of `token_ids` (at most
        max_blocks) starting at `root` (the request's hash_root). Takes no reference."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent = root
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

    def allocate(self, num_blocks: int, after: int | None = None, want_blocks: int = 0) -> list[int]:
        """Fresh blocks (ref_count 1), preferring consecutive ids (attention then reads a
        request's K/V as a zero-copy view). Growing a request (`after` = its last block): the
        blocks right after it when free, else any. A new request: a free run of `want_blocks`
        (room to grow) or `num_blocks`, else any. "Any" is least recently freed first (never
        cached ones before cached ones); handing out a cached block evicts it."""
        if num_blocks > len(self._free):
            raise RuntimeError("allocate() without can_allocate()")
        if num_blocks == 0:
            return []
        blocks = self._allocate(num_blocks, after, want_blocks)
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            if self._on_evict is not None:
                self._on_evict(evicted)
        return blocks

    def _allocate(self, num_blocks: int, after: int | None, want_blocks: int) -> list[int]:
        if after is not None:
            if self._run_is_free(after + 1, num_blocks):
                return self._take_run(after + 1, num_blocks)
            # the request's blocks are not consecutive any more: any blocks will do
            return [self._take(b) for b in list(itertools.islice(self._free, num_blocks))]
        for size in dict.fromkeys((max(num_blocks, want_blocks), num_blocks)):
            start = self._find_run(size)
            if start is not None:
                self._cursor = (start + size) % self.num_blocks
                return self._take_run(start, num_blocks)
        return [self._take(b) for b in list(itertools.islice(self._free, num_blocks))]

    def _run_is_free(self, start: int, length: int) -> bool:
        if start + length > self.num_blocks:
            return False
        refs = self._ref_counts
        return all(refs[b] == 0 for b in range(start, start + length))

    def _find_run(self, length: int) -> int | None:
        """Start of `length` consecutive free blocks: first among never-cached (or evicted)
        blocks, scanning from a moving cursor (next fit); else a run made only of the older
        half of the unreferenced blocks in LRU order (eviction stays approximately LRU)."""
        if length > len(self._free):
            return None
        refs, hashes, n = self._ref_counts, self._hashes, self.num_blocks
        for lo, hi in ((self._cursor, n), (0, self._cursor)):
            run = 0
            for b in range(lo, hi):
                if refs[b] == 0 and hashes[b] is None:
                    run += 1
                    if run == length:
                        return b - length + 1
                else:
                    run = 0
        limit = max(length, len(self._free) // 2)
        lru_rank = {b: i for i, b in enumerate(self._free) if i < limit}
        for b in lru_rank:
            if all(x in lru_rank for x in range(b, b + length)):
                return b
        return None

    def _take_run(self, start: int, length: int) -> list[int]:
        return [self._take(b) for b in range(start, start + length)]

    def _take(self, b: int) -> int:
        del self._free[b]
        h = self._hashes[b]
        if h is not None:
            if self._hash_to_block.get(h) == b:
                del self._hash_to_block[h]
                self._evicted.append((b, h))
            self._hashes[b] = None
        self._ref_counts[b] = 1
        return b

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
