"""Tokens reserved per (worker, DP rank) by routing decisions since the worker's last load report.

A reservation is a (time, tokens) entry. A load report polled at time T covers (replaces) the
entries made at or before T: the tokens they stand for are then in the reported `num_used_tokens`.
Not thread-safe: the router calls it inside its own lock.
"""

from __future__ import annotations

from collections import deque


class _WorkerReservations:
    __slots__ = ("entries", "totals")

    def __init__(self, dp_size: int) -> None:
        self.totals = [0] * dp_size  # tokens per rank
        self.entries: deque[tuple[float, int, int]] = deque()  # (time_s, rank, tokens), by time


class Reservations:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerReservations] = {}

    def totals(self, worker_id: str, dp_size: int) -> list[int]:
        """Reserved tokens per rank (a copy; zeros for a worker without reservations)."""
        w = self._workers.get(worker_id)
        if w is None or len(w.totals) != dp_size:
            return [0] * dp_size
        return list(w.totals)

    def add(self, worker_id: str, dp_size: int, rank: int, tokens: int, now_s: float) -> None:
        w = self._workers.get(worker_id)
        if w is None or len(w.totals) != dp_size:
            w = self._workers[worker_id] = _WorkerReservations(dp_size)
        w.totals[rank] += tokens
        w.entries.append((now_s, rank, tokens))

    def cover(self, worker_id: str, reported_at_s: float) -> None:
        """A load report polled at `reported_at_s` replaces the reservations made until then."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        while w.entries and w.entries[0][0] <= reported_at_s:
            _, rank, tokens = w.entries.popleft()
            w.totals[rank] -= tokens

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def retain(self, worker_ids: set[str]) -> None:
        """Forget the reservations of workers that left."""
        for wid in [w for w in self._workers if w not in worker_ids]:
            del self._workers[wid]
