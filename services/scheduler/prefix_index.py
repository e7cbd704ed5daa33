"""Which workers recently served which prefix blocks (chained block hashes), for cache-aware
routing and for estimating a decode worker's prefix-cache hits.

Block hashes are chained (block i's hash covers blocks 0..i), so a worker holding the hash of
block i holds the whole prefix up to i: the longest match is the deepest block some candidate
holds. Each worker keeps at most `max_blocks_per_worker` hashes, least recently served evicted.
Not thread-safe: the router calls it inside its own lock.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


class PrefixIndex:
    def __init__(self, max_blocks_per_worker: int = 65536) -> None:
        self.max_blocks_per_worker = max_blocks_per_worker
        self._holders: dict[int, set[str]] = {}  # block hash -> worker ids
        self._recent: dict[str, dict[int, None]] = {}  # worker id -> hashes, oldest first

    def longest_match(
        self, hashes: Sequence[int], candidates: Container[str]
    ) -> tuple[list[str], int]:
        """(candidates holding the longest prefix, its length in blocks); ([], 0) on no match."""
        holders_of = self._holders
        for depth in range(len(hashes), 0, -1):
            holders = holders_of.get(hashes[depth - 1])
            if holders:
                found = [w for w in holders if w in candidates]
                if found:
                    return sorted(found), depth
        return [], 0

    def matched_blocks(self, hashes: Sequence[int], worker_id: str) -> int:
        """Leading blocks of `hashes` that `worker_id` served recently."""
        recent = self._recent.get(worker_id)
        if not recent:
            return 0
        for depth in range(len(hashes), 0, -1):
            if hashes[depth - 1] in recent:
                return depth
        return 0

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        """`worker_id` now holds every block of `hashes` (most recently served)."""
        recent = self._recent.get(worker_id)
        if recent is None:
            recent = self._recent[worker_id] = {}
        holders_of = self._holders
        for h in hashes:
            if recent.pop(h, 0) is None:  # already held: refresh its recency only
                recent[h] = None
                continue
            recent[h] = None
            holders = holders_of.get(h)
            if holders is None:
                holders_of[h] = {worker_id}
            else:
                holders.add(worker_id)
        excess = len(recent) - self.max_blocks_per_worker
        if excess > 0:
            for h in _first(recent, excess):
                del recent[h]
                self._drop_holder(h, worker_id)

    def forget(self, worker_id: str) -> None:
        """Drop everything `worker_id` held (it left or came back clean)."""
        for h in self._recent.pop(worker_id, {}):
            self._drop_holder(h, worker_id)

    def workers(self) -> list[str]:
        return list(self._recent)

    def _drop_holder(self, h: int, worker_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]


def _first(d: dict[int, None], n: int) -> list[int]:
    it = iter(d)
    return [next(it) for _ in range(n)]
