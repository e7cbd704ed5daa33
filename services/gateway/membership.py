"""Noticing a worker that left the cluster while streams depend on it (a decode worker carrying
them; a prefill worker whose KV handoff a stream waits for after it answered with the first
token): the worker was removed from membership (lease expired, deregistered) but its connection
may stay open (a SIGSTOPped or hung process), or there is none to break (the handoff's), so the
streams would wait for their deadlines. While streams are tracked, the watch polls the
scheduler's membership; a tracked worker that is no longer a member is probed with a health
check, and if it does not answer, the streams depending on it are abandoned (they raise
WorkerGone naming it and migrate like on UNAVAILABLE).

Only membership decides: a stream that is merely slow (no frame for a long time) on a worker
that is still a member is left alone. A worker that left membership but answers the probe
(draining after Deregister, or cut off from the load-monitor only) keeps its streams.
No grpc here: the scheduler and the probe are reached through `ports.MembershipSource`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import structlog

from services.gateway.ports import DecodeStream, MembershipSource, WorkerTarget

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class Watched:
    """One tracked stream. `gone` is set (and `reason` says why) when its worker was found gone,
    so that a wait that is not a read of the stream (the prefill before the handoff) can end too."""

    target: WorkerTarget
    stream: DecodeStream
    since_s: float  # when tracking began (the watch's clock)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""


class MembershipWatch:
    def __init__(
        self,
        source: MembershipSource,
        poll_s: float = 1.0,
        probe_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`poll_s`: seconds between two membership checks while streams are tracked (<= 0: never
        checked, tracking is a no-op). `probe_timeout_s`: how long a worker that left membership
        gets to answer its health check (s)."""
        self._source = source
        self._poll_s = poll_s
        self._probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._tracked: set[Watched] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self._poll_s > 0

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    @contextlib.contextmanager
    def tracking(self, target: WorkerTarget, stream: DecodeStream) -> Iterator[Watched | None]:
        """Watch `target` for as long as `stream` depends on it (polling runs while any is
        watched); when it is found gone the stream is abandoned with its id. Yields the entry
        (None when the watch is disabled)."""
        if not self.enabled:
            yield None
            return
        entry = Watched(target, stream, self._clock())
        self._tracked.add(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="gateway-membership-watch")
        try:
            yield entry
        finally:
            self._tracked.discard(entry)

    async def _loop(self) -> None:
        while self._tracked:
            await asyncio.sleep(self._poll_s)
            try:
                await self.check()
            except Exception:  # the watch must not die with one bad round; the next one retries
                log.exception("membership_check_failed")
        self._task = None

    async def check(self) -> list[str]:
        """One round: abandon the streams of tracked workers that left membership and do not
        answer a health check. Returns the ids of the workers found gone."""
        asked_s = self._clock()
        members = await self._source.members(max(self._poll_s, self._probe_timeout_s))
        if members is None:  # the scheduler cannot tell (unreachable, stale): assume nothing
            return []
        # Only streams that began before the question: a worker registered (and chosen) since
        # an older answer was given must not be judged by it.
        suspects = {
            t.target.worker_id: t.target.address
            for t in self._tracked
            if t.since_s < asked_s and t.target.worker_id not in members
        }
        if not suspects:
            return []
        answers = await asyncio.gather(
            *(self._source.responds(address, self._probe_timeout_s) for address in suspects.values())
        )
        gone = []
        for (worker_id, address), alive in zip(suspects.items(), answers, strict=True):
            if alive:
                log.info("worker_left_membership_but_responds", worker_id=worker_id, worker=address)
                continue
            gone.append(worker_id)
            reason = (
                f"worker {worker_id} ({address}) left the cluster's membership (lease "
                f"expired or deregistered) and did not answer a health check within "
                f"{self._probe_timeout_s:g} s"
            )
            streams = [t for t in self._tracked if t.target.worker_id == worker_id]
            log.warning(
                "worker_gone_abandoning_streams", worker_id=worker_id, worker=address, streams=len(streams)
            )
            for t in streams:
                t.reason = reason
                t.gone.set()
                t.stream.abandon(reason, worker_id)
        return gone

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
