"""The load-monitor's behaviour: membership calls (a registration is admitted only when the worker
at the registered address confirms the identity), the load poll loop, lease expiry and the stream
of snapshots to watchers. Worker calls go through injected functions (no grpc here)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from services.load_monitor.registry import PollTarget, Registry
from shared.cluster import LoadSnapshot, RankLoad, WorkerInfo
from shared.errors import FailedPrecondition, Unavailable
from shared.metrics import REGISTERED_WORKERS

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """What one worker answered to GetLoad."""

    worker_id: str  # as the worker reports it; "" when it does not say
    ranks: Sequence[RankLoad]


# (address, timeout_s) -> the worker's report; raises on any failure (timeout, connection, ...).
LoadFetcher = Callable[[str, float], Awaitable[LoadReport]]
# Called with the address of a worker that left, so its client can be closed.
Forget = Callable[[str], Awaitable[None]]
# (address, timeout_s) -> the identity the worker there reports (its Info); raises on failure.
InfoFetcher = Callable[[str, float], Awaitable[WorkerInfo]]


def identity_mismatch(registered: WorkerInfo, reported: WorkerInfo) -> str | None:
    """What differs between a registration and what the worker at its address says it is (None:
    nothing). Routing trusts these fields: a fake model id, max_model_len or address would send
    real requests to a wrong or dead place (lora_adapters: an adapter's requests to a worker
    without it)."""
    fields = (
        "worker_id",
        "address",
        "role",
        "model_id",
        "max_model_len",
        "dp_size",
        "kv_layout",
        "lora_adapters",
    )
    diffs = [
        f"{name} {getattr(reported, name)!r} (registered: {getattr(registered, name)!r})"
        for name in fields
        if getattr(registered, name) != getattr(reported, name)
    ]
    return "; ".join(diffs) or None


@dataclass(frozen=True)
class Registration:
    worker_id: str
    lease_ttl_ms: int
    heartbeat_interval_ms: int


@dataclass(eq=False)  # identity-hashed: kept in a set
class _Watcher:
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    latest: LoadSnapshot | None = None  # newest snapshot not yet delivered (older ones dropped)


class LoadMonitor:
    """Membership + loads, polled every `load_interval_s`, published to every watcher after each
    change and each poll round. Owned by one event loop."""

    def __init__(
        self,
        registry: Registry,
        fetch: LoadFetcher,
        load_interval_s: float,
        load_timeout_s: float,
        forget: Forget | None = None,
        info: InfoFetcher | None = None,
    ) -> None:
        """`info`: when given, `admit` checks each registration against the worker's own Info."""
        self.registry = registry
        self._fetch = fetch
        self._forget = forget
        self._info = info
        self.load_interval_s = load_interval_s
        # A poll round waits for its slowest answer: never longer than one interval.
        self.load_timeout_s = min(load_timeout_s, load_interval_s)
        self._watchers: set[_Watcher] = set()
        self._failing: set[str] = set()  # worker ids whose last poll failed (log once per outage)
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False  # set by stop(): watch streams end so watchers reconnect elsewhere
        self._update_gauge()

    # --- membership ---

    async def admit(self, info: WorkerInfo) -> Registration:
        """Register `info` once the worker at `info.address` confirmed it is that worker.
        Raises Unavailable when it cannot be asked (the worker retries), FailedPrecondition when
        it reports another identity (a fabricated or misconfigured registration)."""
        if self._info is not None:
            try:
                reported = await self._info(info.address, self.load_timeout_s)
            except Exception as exc:
                log.warning(
                    "registration_unverified",
                    worker_id=info.worker_id,
                    address=info.address,
                    error=str(exc) or type(exc).__name__,
                )
                raise Unavailable(
                    f"cannot verify the registration of {info.worker_id!r}: Info at {info.address} "
                    f"failed ({exc}); the worker must serve Info there (with the cluster token) "
                    "before it registers"
                ) from None
            problem = identity_mismatch(info, reported)
            if problem is not None:
                log.warning(
                    "registration_refused", worker_id=info.worker_id, address=info.address, mismatch=problem
                )
                raise FailedPrecondition(
                    f"registration refused: the worker at {info.address} reports {problem}"
                )
        return self.register(info)

    def register(self, info: WorkerInfo) -> Registration:
        previous = {m.address for m in self._addresses()}
        registered = self.registry.register(info)
        log.info(
            "worker_registered",
            worker_id=registered.worker_id,
            address=registered.address,
            role=registered.role.value,
            model_id=registered.model_id,
            lora_adapters=list(registered.lora_adapters),
            dp_size=registered.dp_size,
            rejoined=registered.address in previous,
        )
        self._failing.discard(registered.worker_id)
        self._changed()
        ttl_ms = int(self.registry.lease_ttl_s * 1000)
        return Registration(registered.worker_id, ttl_ms, max(1, ttl_ms // 3))

    def heartbeat(self, worker_id: str) -> bool:
        return self.registry.heartbeat(worker_id)

    async def deregister(self, worker_id: str) -> bool:
        address = next((a.address for a in self._addresses() if a.worker_id == worker_id), None)
        found = self.registry.deregister(worker_id)
        if found:
            log.info("worker_deregistered", worker_id=worker_id)
            self._changed()
            if address is not None:
                await self._forget_address(address)
        return found

    async def expire(self) -> list[WorkerInfo]:
        gone = self.registry.expire()
        for info in gone:
            log.warning("worker_lease_expired", worker_id=info.worker_id, address=info.address)
        if gone:
            self._changed()
            for info in gone:
                await self._forget_address(info.address)
        return gone

    # --- loads ---

    def snapshot(self) -> LoadSnapshot:
        return self.registry.snapshot()

    async def poll_once(self) -> None:
        """One GetLoad to every live worker at once (each with its own timeout), then publish."""
        targets = self.registry.poll_targets()
        results = await asyncio.gather(
            *(self._fetch(t.address, self.load_timeout_s) for t in targets), return_exceptions=True
        )
        for target, result in zip(targets, results, strict=True):
            self._record(target, result)
        self._failing.intersection_update(t.worker_id for t in targets)
        self._publish()

    def _record(self, target: PollTarget, result: LoadReport | BaseException) -> None:
        if not self.registry.is_current(target):
            return  # left or re-registered while polled (its channel may have been closed)
        if isinstance(result, LoadReport) and result.worker_id not in ("", target.worker_id):
            result = RuntimeError(f"address now serves worker {result.worker_id!r}, not {target.worker_id!r}")
        if isinstance(result, BaseException):
            if target.worker_id not in self._failing:
                self._failing.add(target.worker_id)
                log.warning(
                    "load_poll_failed",
                    worker_id=target.worker_id,
                    address=target.address,
                    error=str(result) or type(result).__name__,
                )
            return
        if target.worker_id in self._failing:
            self._failing.discard(target.worker_id)
            log.info("load_poll_recovered", worker_id=target.worker_id)
        self.registry.record_loads(target, result.ranks)

    # --- watchers ---

    async def watch(self) -> AsyncGenerator[LoadSnapshot, None]:
        """The latest snapshot at once, then the newest one after every change or poll round.
        A slow watcher skips intermediate snapshots rather than queueing them."""
        watcher = _Watcher()
        self._watchers.add(watcher)
        try:
            yield self.snapshot()
            while not self._closed:
                await watcher.changed.wait()
                watcher.changed.clear()
                if self._closed:
                    break
                snapshot, watcher.latest = watcher.latest, None
                if snapshot is not None:
                    yield snapshot
        finally:
            self._watchers.discard(watcher)

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    def _publish(self) -> None:
        if not self._watchers:
            return
        snapshot = self.snapshot()
        for watcher in self._watchers:
            watcher.latest = snapshot
            watcher.changed.set()

    def _changed(self) -> None:
        self._update_gauge()
        self._publish()

    def _update_gauge(self) -> None:
        for role, count in self.registry.count_by_role().items():
            REGISTERED_WORKERS.labels(role=role.value).set(count)

    # --- background loops ---

    def start(self) -> None:
        self._closed = False
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="load-poll"),
            asyncio.create_task(self._expiry_loop(), name="lease-expiry"),
        ]

    async def stop(self) -> None:
        """Stop polling and expiring, and end every watch stream."""
        self._closed = True
        for watcher in self._watchers:
            watcher.changed.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _poll_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except Exception:
                log.exception("poll_round_failed")
            await asyncio.sleep(max(0.0, self.load_interval_s - (loop.time() - started)))

    async def _expiry_loop(self) -> None:
        while True:
            try:
                await self.expire()
            except Exception:
                log.exception("expiry_failed")
            next_s = self.registry.next_expiry_s()
            wait_s = self.registry.lease_ttl_s if next_s is None else next_s - self._now()
            await asyncio.sleep(min(max(wait_s, 0.01), 1.0))

    def _now(self) -> float:
        return self.registry.now()

    def _addresses(self) -> list[PollTarget]:
        return self.registry.poll_targets()

    async def _forget_address(self, address: str) -> None:
        if self._forget is None:
            return
        if any(t.address == address for t in self._addresses()):
            return  # a new registration took over the address: keep the client
        try:
            await self._forget(address)
        except Exception:
            log.exception("forget_failed", address=address)
