"""Membership with leases and the latest per-rank loads of every live worker (no I/O here).

Invariants:
- A worker is in a snapshot iff its lease has not expired and it has not deregistered. Snapshots
  check the lease themselves, so an expired worker is gone at once, even before `expire()` runs.
- Removing a worker (deregister, expiry, or a new registration on its address) drops its loads
  with it: a worker that comes back starts with zero loads.
- Each registration has its own epoch; a poll that started before a re-registration cannot write
  the old process's loads into the new registration.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from shared.cluster import (
    LoadSnapshot,
    RankLoad,
    Role,
    WorkerInfo,
    WorkerLoad,
    sum_rank_loads,
)
from shared.errors import InvalidArgument


@dataclass
class _Member:
    info: WorkerInfo
    epoch: int
    registered_s: float  # monotonic clock
    lease_expires_s: float
    ranks: tuple[RankLoad, ...]
    polled_s: float | None = None  # last successful poll; None until the first one


@dataclass(frozen=True)
class PollTarget:
    """What a poll round needs to know about one member."""

    worker_id: str
    address: str
    epoch: int


class Registry:
    """Live workers and their loads. Not thread-safe: owned by one event loop."""

    def __init__(
        self,
        lease_ttl_s: float,
        stale_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be > 0")
        self.lease_ttl_s = lease_ttl_s
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._members: dict[str, _Member] = {}
        self._next_epoch = 1
        self._version = 0  # of the last snapshot built

    # --- membership ---

    def register(self, info: WorkerInfo) -> WorkerInfo:
        """Adds (or re-adds, clean) a worker; a previous member on the same address or with the
        same id is removed first. Returns the info as registered (worker_id filled in)."""
        if not info.address or ":" not in info.address:
            raise InvalidArgument(f"worker address must be host:port, got {info.address!r}")
        if info.dp_size < 1:
            raise InvalidArgument(f"dp_size must be >= 1, got {info.dp_size}")
        if not info.model_id:
            raise InvalidArgument("model_id is required")
        # adapter names are model ids requests route by: none empty, repeated or the base model's
        if "" in info.lora_adapters or len(set(info.lora_adapters)) != len(info.lora_adapters):
            raise InvalidArgument(
                f"lora_adapters must be distinct, non-empty names, got {list(info.lora_adapters)}"
            )
        if info.model_id in info.lora_adapters:
            raise InvalidArgument(f"lora_adapters lists the base model id {info.model_id!r}")
        if info.kv_layout.block_size < 1:
            raise InvalidArgument(f"kv_layout.block_size must be >= 1, got {info.kv_layout.block_size}")
        if not info.worker_id:
            info = replace(info, worker_id=f"worker-{uuid.uuid4().hex[:12]}")
        for wid in [w for w, m in self._members.items() if m.info.address == info.address]:
            del self._members[wid]
        now = self._clock()
        self._members[info.worker_id] = _Member(
            info=info,
            epoch=self._next_epoch,
            registered_s=now,
            lease_expires_s=now + self.lease_ttl_s,
            ranks=sum_rank_loads((), info.dp_size),
        )
        self._next_epoch += 1
        return info

    def heartbeat(self, worker_id: str) -> bool:
        """Renews the lease; False when the worker is unknown (expired or never registered)."""
        member = self._live(worker_id)
        if member is None:
            return False
        member.lease_expires_s = self._clock() + self.lease_ttl_s
        return True

    def deregister(self, worker_id: str) -> bool:
        """Removes the worker and its loads; False when it was not registered."""
        return self._members.pop(worker_id, None) is not None

    def expire(self) -> list[WorkerInfo]:
        """Drops every member whose lease ran out; returns them."""
        now = self._clock()
        gone = [m.info for m in self._members.values() if m.lease_expires_s <= now]
        for info in gone:
            del self._members[info.worker_id]
        return gone

    def now(self) -> float:
        """The registry's monotonic clock (seconds)."""
        return self._clock()

    def next_expiry_s(self) -> float | None:
        """Monotonic time of the earliest lease end (None without members)."""
        return min((m.lease_expires_s for m in self._members.values()), default=None)

    def count_by_role(self) -> dict[Role, int]:
        now = self._clock()
        counts = dict.fromkeys(Role, 0)
        for m in self._members.values():
            if m.lease_expires_s > now:
                counts[m.info.role] += 1
        return counts

    # --- loads ---

    def poll_targets(self) -> list[PollTarget]:
        now = self._clock()
        return [
            PollTarget(wid, m.info.address, m.epoch)
            for wid, m in self._members.items()
            if m.lease_expires_s > now
        ]

    def is_current(self, target: PollTarget) -> bool:
        """Whether `target` is still the live registration it was when the poll started."""
        member = self._members.get(target.worker_id)
        return member is not None and member.epoch == target.epoch

    def record_loads(self, target: PollTarget, reports: Iterable[RankLoad]) -> bool:
        """Stores a successful poll's loads (duplicate ranks summed). False, and nothing stored,
        when the worker left or re-registered since the poll started."""
        member = self._members.get(target.worker_id)
        if member is None or member.epoch != target.epoch:
            return False
        member.ranks = sum_rank_loads(reports, member.info.dp_size)
        member.polled_s = self._clock()
        return True

    # --- snapshots ---

    def snapshot(self) -> LoadSnapshot:
        """Live members with their loads; every call is a new snapshot with a higher version."""
        now = self._clock()
        self._version += 1
        workers = []
        for m in self._members.values():
            if m.lease_expires_s <= now:
                continue
            since_s = m.polled_s if m.polled_s is not None else m.registered_s
            age_s = max(0.0, now - since_s)
            workers.append(
                WorkerLoad(
                    info=m.info,
                    ranks=m.ranks,
                    age_ms=int(age_s * 1000),
                    stale=age_s > self.stale_after_s,
                )
            )
        return LoadSnapshot(
            workers=tuple(workers),
            version=self._version,
            timestamp_ms=int(self._wall_clock() * 1000),
        )

    def _live(self, worker_id: str) -> _Member | None:
        member = self._members.get(worker_id)
        if member is None or member.lease_expires_s <= self._clock():
            return None
        return member
