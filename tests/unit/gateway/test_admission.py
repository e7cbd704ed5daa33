"""Bounded admission and per-worker circuit breakers (no grpc)."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.gateway.admission import Admission, Overloaded
from services.gateway.breaker import CircuitBreakers, backoff_s


async def _hold(adm: Admission, release: asyncio.Event, log: list[str], name: str, priority: int = 0) -> None:
    async with adm.slot(priority):
        log.append(name)
        await release.wait()


async def test_bounds_running_then_queue_then_refuses_at_once() -> None:
    adm = Admission(max_inflight=2, max_queued=1, max_wait_s=10)
    release = asyncio.Event()
    order: list[str] = []
    tasks = [asyncio.ensure_future(_hold(adm, release, order, n)) for n in ("a", "b", "c")]
    await asyncio.sleep(0.01)
    assert (adm.num_running, adm.num_queued) == (2, 1)
    with pytest.raises(Overloaded, match="at capacity") as info:
        async with adm.slot():
            pass
    assert info.value.retry_after_s == 1.0
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"]
    assert (adm.num_running, adm.num_queued) == (0, 0)


async def test_queue_wait_is_bounded() -> None:
    adm = Admission(max_inflight=1, max_queued=5, max_wait_s=0.05)
    release = asyncio.Event()
    holder = asyncio.ensure_future(_hold(adm, release, [], "a"))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded, match="no slot freed within"):
        async with adm.slot():
            pass
    release.set()
    await holder
    assert adm.num_running == 0


async def test_a_cancelled_waiter_never_leaks_a_slot() -> None:
    adm = Admission(max_inflight=1, max_queued=5, max_wait_s=10)
    release = asyncio.Event()
    order: list[str] = []
    holder = asyncio.ensure_future(_hold(adm, release, order, "a"))
    await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(_hold(adm, release, order, "b"))
    after = asyncio.ensure_future(_hold(adm, release, order, "c"))
    await asyncio.sleep(0.01)
    waiting.cancel()
    release.set()
    await asyncio.gather(holder, after)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert order == ["a", "c"]
    assert (adm.num_running, adm.num_queued) == (0, 0)


async def test_waiters_are_served_by_priority_then_arrival() -> None:
    adm = Admission(max_inflight=1, max_queued=10, max_wait_s=10)
    gate, release = asyncio.Event(), asyncio.Event()
    order: list[str] = []
    holder = asyncio.ensure_future(_hold(adm, gate, order, "holder"))
    await asyncio.sleep(0.01)
    queued = []
    for name, priority in (("low", 5), ("a0", 0), ("urgent", -3), ("b0", 0), ("low2", 5)):
        queued.append(asyncio.ensure_future(_hold(adm, release, order, name, priority)))
        await asyncio.sleep(0)  # arrival order
    await asyncio.sleep(0.01)
    assert adm.num_queued == 5
    release.set()  # each waiter leaves as soon as it gets the slot
    gate.set()
    await asyncio.gather(holder, *queued)
    assert order == ["holder", "urgent", "a0", "b0", "low", "low2"]
    assert (adm.num_running, adm.num_queued) == (0, 0)


async def test_a_full_queue_sheds_its_worst_waiter_for_a_better_request() -> None:
    adm = Admission(max_inflight=1, max_queued=2, max_wait_s=10)
    release = asyncio.Event()
    order: list[str] = []
    holder = asyncio.ensure_future(_hold(adm, release, order, "holder"))
    await asyncio.sleep(0.01)
    late = asyncio.ensure_future(_hold(adm, release, order, "batch-1", 10))
    later = asyncio.ensure_future(_hold(adm, release, order, "batch-2", 10))
    await asyncio.sleep(0.01)
    # equal (or worse) priority than the worst waiter: refused at once, nobody evicted
    with pytest.raises(Overloaded, match="at capacity"):
        async with adm.slot(10):
            pass
    urgent = asyncio.ensure_future(_hold(adm, release, order, "urgent", 0))
    await asyncio.sleep(0.01)
    assert later.done()  # the newest of the worst priority gave up its place
    with pytest.raises(Overloaded, match="took this one's place") as info:
        await later
    assert info.value.retry_after_s == 1.0
    assert adm.num_queued == 2
    release.set()
    await asyncio.gather(holder, late, urgent)
    assert order == ["holder", "urgent", "batch-1"]
    assert (adm.num_running, adm.num_queued) == (0, 0)


async def test_unbounded_when_max_inflight_is_zero() -> None:
    adm = Admission(max_inflight=0, max_queued=0, max_wait_s=1)
    async with adm.slot(), adm.slot():
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_probes_after_cooldown() -> None:
    clock = Clock()
    b = CircuitBreakers(failure_threshold=3, cooldown_s=5.0, clock=clock)
    b.record_failure("w1")
    b.record_failure("w1")
    b.record_success("w1")  # not consecutive any more
    b.record_failure("w1")
    b.record_failure("w1")
    assert b.exclusions() == ()
    b.record_failure("w1")
    assert b.exclusions() == ("w1",) and b.is_open("w1")
    clock.now += 5.0
    assert b.exclusions() == ()  # half-open: this decision may probe it
    assert b.exclusions() == ("w1",)  # only one probe at a time
    b.record_failure("w1")  # the probe failed: open again, a new cooldown
    assert b.exclusions() == ("w1",)
    clock.now += 5.0
    assert b.exclusions() == ()
    b.record_success("w1")
    assert not b.is_open("w1") and b.exclusions() == ()


def test_a_lost_probe_is_retried_after_another_cooldown() -> None:
    clock = Clock()
    b = CircuitBreakers(failure_threshold=1, cooldown_s=2.0, clock=clock)
    b.record_failure("w")
    clock.now += 2.0
    assert b.exclusions() == ()  # probe let through (but the scheduler picked another worker)
    clock.now += 1.0
    assert b.exclusions() == ("w",)
    clock.now += 1.0
    assert b.exclusions() == ()


def test_disabled_breakers_never_exclude() -> None:
    b = CircuitBreakers(failure_threshold=0)
    for _ in range(10):
        b.record_failure("w")
    assert b.exclusions() == ()


def test_backoff_is_jittered_exponential_and_capped() -> None:
    rng = random.Random(7)
    draws = [backoff_s(n, base_s=0.05, cap_s=1.0, rng=rng) for n in (1, 2, 3, 10) for _ in range(200)]
    assert all(0 <= d <= 1.0 for d in draws)
    assert max(draws[:200]) <= 0.05 and max(draws[600:]) > 0.5
    assert len({round(d, 6) for d in draws[:200]}) > 150  # jittered, not a fixed pause
