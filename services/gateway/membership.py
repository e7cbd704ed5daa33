"""Noticing a decode worker that left the cluster while it carries streams: the worker was
removed from membership (lease expired, deregistered) but its connection may stay open (a
SIGSTOPped or hung process), so its streams would wait for their deadlines. While streams are
tracked, the watch polls the scheduler's membership; a worker carrying a stream that is no longer
a member is probed with a health check, and if it does not answer, its streams are abandoned
(they raise WorkerGone and migrate like on UNAVAILABLE).

Only membership decides: a stream that is merely slow (no frame for a long time) on a worker
that is still a member is left alone. A worker that left membership but answers the probe
(draining after Deregister, or cut off from the load-monitor only) keeps its streams.
No grpc here: the scheduler and the probe are reached through `ports.MembershipSource`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from services.gateway.ports import DecodeStream, MembershipSource, WorkerTarget

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class _Tracked:
    target: WorkerTarget
    stream: DecodeStream
    since_s: float  # when tracking began (the watch's clock)


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
        self._tracked: set[_Tracked] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self._poll_s > 0

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    @contextlib.contextmanager
    def tracking(self, target: WorkerTarget, stream: DecodeStream) -> Iterator[None]:
        """Watch `target` for as long as `stream` is being read (polling runs while any is)."""
        if not self.enabled:
            yield
            return
        entry = _Tracked(target, stream, self._clock())
        self._tracked.add(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="gateway-membership-watch")
        try:
            yield
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
                f"decode worker {worker_id} ({address}) left the cluster's membership (lease "
                f"expired or deregistered) and did not answer a health check within "
                f"{self._probe_timeout_s:g} s"
            )
            streams = [t for t in self._tracked if t.target.worker_id == worker_id]
            log.warning(
                "worker_gone_abandoning_streams", worker_id=worker_id, worker=address, streams=len(streams)
            )
            for t in streams:
                t.stream.abandon(reason)
        return gone

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
