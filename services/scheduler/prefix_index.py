"""Which workers recently served which prompt prefixes (chained KV block hashes), for cache-aware
routing and for estimating a decode worker's prefix-cache hits.

Block hashes are chained (block i's hash covers blocks 0..i), so one hash names a whole prefix:
a worker holding the hash at depth d holds the first d blocks. To keep a decision cheap the
index stores only sampled depths: 1, 2, 4, ..., every `stride_blocks` blocks, and the full
prompt. A match is therefore found at the deepest sampled depth both share; it may be shorter
than the real shared prefix by less than the spacing of the samples there (never longer).

Each worker remembers at most `max_prefixes_per_worker` sampled prefixes, least recently served
evicted first. Not thread-safe: the router calls it inside its own lock.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Sequence

DEFAULT_STRIDE_BLOCKS = 32


@functools.lru_cache(maxsize=4096)
def sampled_depths(num_blocks: int, stride_blocks: int = DEFAULT_STRIDE_BLOCKS) -> tuple[int, ...]:
    """Depths (in blocks, deepest first) the index stores for a prompt of `num_blocks` blocks."""
    depths = {num_blocks} if num_blocks > 0 else set()
    d = 1
    while d < min(num_blocks, stride_blocks):
        depths.add(d)
        d *= 2
    depths.update(range(stride_blocks, num_blocks, stride_blocks))
    return tuple(sorted(depths, reverse=True))


class PrefixIndex:
    def __init__(
        self, max_prefixes_per_worker: int = 65536, stride_blocks: int = DEFAULT_STRIDE_BLOCKS
    ) -> None:
        self.max_prefixes_per_worker = max_prefixes_per_worker
        self.stride_blocks = stride_blocks
        # Prefix hash -> the worker holding it, or the set of them when several do. A plain str
        # for the common single holder keeps millions of entries cheap (and out of the GC).
        self._holders: dict[int, str | set[str]] = {}
        self._recent: dict[str, dict[int, None]] = {}  # worker -> prefix hashes, oldest first

    def longest_match(self, hashes: Sequence[int], candidates: Container[str]) -> tuple[list[str], int]:
        """(candidates holding the longest stored prefix of `hashes`, its depth in blocks);
        ([], 0) when none holds any."""
        holders_of = self._holders
        for depth in sampled_depths(len(hashes), self.stride_blocks):
            holders = holders_of.get(hashes[depth - 1])
            if holders is None:
                continue
            if isinstance(holders, str):
                if holders in candidates:
                    return [holders], depth
                continue
            found = [w for w in holders if w in candidates]
            if found:
                return found, depth
        return [], 0

    def matched_blocks(self, hashes: Sequence[int], worker_id: str) -> int:
        """Leading blocks of `hashes` that `worker_id` is known to hold (sampled, see above)."""
        recent = self._recent.get(worker_id)
        if not recent:
            return 0
        for depth in sampled_depths(len(hashes), self.stride_blocks):
            if hashes[depth - 1] in recent:
                return depth
        return 0

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        """`worker_id` now holds the prompt prefix `hashes` (most recently served)."""
        recent = self._recent.get(worker_id)
        if recent is None:
            recent = self._recent[worker_id] = {}
        holders_of = self._holders
        for depth in sampled_depths(len(hashes), self.stride_blocks):
            h = hashes[depth - 1]
            if h in recent:
                del recent[h]  # re-inserted below: now the most recent
                recent[h] = None
                continue
            recent[h] = None
            holders = holders_of.get(h)
            if holders is None:
                holders_of[h] = worker_id
            elif isinstance(holders, str):
                holders_of[h] = {holders, worker_id}
            else:
                holders.add(worker_id)
        excess = len(recent) - self.max_prefixes_per_worker
        if excess > 0:
            oldest = iter(recent)
            for h in [next(oldest) for _ in range(excess)]:
                del recent[h]
                self._drop_holder(h, worker_id)

    def forget(self, worker_id: str) -> None:
        """Drop everything `worker_id` held (it left, or came back with an empty cache)."""
        for h in self._recent.pop(worker_id, {}):
            self._drop_holder(h, worker_id)

    def workers(self) -> list[str]:
        return list(self._recent)

    def _drop_holder(self, h: int, worker_id: str) -> None:
        holders = self._holders.get(h)
        if holders is None:
            return
        if isinstance(holders, str):
            if holders == worker_id:
                del self._holders[h]
            return
        holders.discard(worker_id)
        if len(holders) == 1:
            self._holders[h] = next(iter(holders))
        elif not holders:
            del self._holders[h]
