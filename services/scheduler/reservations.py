"""Tokens reserved per (worker, DP rank) by routing decisions since the worker's last load report.

A reservation is a (time, tokens) entry per rank, oldest first. A load report polled at time T
covers (replaces) the entries made at or before T: their tokens are then in the reported
`num_used_tokens`. Except for requests the rank still has waiting: a waiting request holds no KV
yet, so it is not in `num_used_tokens`; the newest `num_waiting` covered entries of that rank
(routing is FIFO, so the waiting ones are the most recent) stay reserved until a later report.
Not thread-safe: the router calls it inside its own lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class _WorkerReservations:
    __slots__ = ("entries", "totals")

    def __init__(self, dp_size: int) -> None:
        self.totals = [0] * dp_size  # tokens per rank
        self.entries: list[deque[tuple[float, int]]] = [deque() for _ in range(dp_size)]


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
        w.entries[rank].append((now_s, tokens))

    def cover(self, worker_id: str, reported_at_s: float, num_waiting: Sequence[int] = ()) -> None:
        """A load report polled at `reported_at_s` replaces the reservations made until then,
        except the newest `num_waiting[rank]` of them on each rank (still waiting there)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        for rank, entries in enumerate(w.entries):
            covered = 0
            for t, _ in entries:
                if t > reported_at_s:
                    break
                covered += 1
            keep = num_waiting[rank] if rank < len(num_waiting) else 0
            for _ in range(covered - min(keep, covered)):
                w.totals[rank] -= entries.popleft()[1]

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def retain(self, worker_ids: set[str]) -> None:
        """Forget the reservations of workers that left."""
        for wid in [w for w in self._workers if w not in worker_ids]:
            del self._workers[wid]
