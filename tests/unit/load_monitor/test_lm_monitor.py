"""The load-monitor's poll loop, watch stream and eviction, with a fake worker fetcher."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from services.load_monitor.monitor import LoadMonitor, LoadReport, identity_mismatch
from services.load_monitor.registry import Registry
from shared.cluster import KvLayout, LoadSnapshot, RankLoad, Role, WorkerInfo
from shared.metrics import REGISTERED_WORKERS

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")


def info(worker_id: str, address: str, role: Role = Role.UNIFIED) -> WorkerInfo:
    return WorkerInfo(worker_id, address, role, "m", 2, LAYOUT)


class FakeWorkers:
    """GetLoad answers by address; an address missing from `loads` fails like a dead worker."""

    def __init__(self) -> None:
        self.loads: dict[str, LoadReport] = {}
        self.calls: list[tuple[str, float]] = []
        self.forgotten: list[str] = []

    async def fetch(self, address: str, timeout_s: float) -> LoadReport:
        self.calls.append((address, timeout_s))
        if address not in self.loads:
            raise ConnectionError("unreachable")
        return self.loads[address]

    async def forget(self, address: str) -> None:
        self.forgotten.append(address)


def make(fake: FakeWorkers, interval_s: float = 0.05, ttl_s: float = 10.0) -> LoadMonitor:
    return LoadMonitor(
        Registry(lease_ttl_s=ttl_s, stale_after_s=1.0),
        fetch=fake.fetch,
        load_interval_s=interval_s,
        load_timeout_s=0.2,
        forget=fake.forget,
    )


def used(snapshot: LoadSnapshot) -> dict[str, list[int]]:
    return {w.info.worker_id: [r.num_used_tokens for r in w.ranks] for w in snapshot.workers}


async def test_poll_sums_duplicate_ranks_and_keeps_last_loads_on_failure() -> None:
    fake = FakeWorkers()
    mon = make(fake, interval_s=1.0)
    mon.register(info("w1", "h:1"))
    fake.loads["h:1"] = LoadReport("w1", [RankLoad(0, 10), RankLoad(0, 5), RankLoad(1, 3)])
    await mon.poll_once()
    assert used(mon.snapshot()) == {"w1": [15, 3]}
    assert fake.calls == [("h:1", 0.2)]  # per-call timeout passed through
    assert make(fake, interval_s=0.1).load_timeout_s == 0.1  # capped at one interval
    del fake.loads["h:1"]  # the worker stops answering: its last loads stay, aging
    await mon.poll_once()
    assert used(mon.snapshot()) == {"w1": [15, 3]}


async def test_report_from_another_worker_id_is_rejected() -> None:
    fake = FakeWorkers()
    mon = make(fake)
    mon.register(info("w1", "h:1"))
    fake.loads["h:1"] = LoadReport("someone-else", [RankLoad(0, 99)])
    await mon.poll_once()
    assert used(mon.snapshot()) == {"w1": [0, 0]}


async def test_watch_streams_initial_then_every_change_and_poll() -> None:
    fake = FakeWorkers()
    mon = make(fake)
    stream = mon.watch()
    first = await anext(stream)
    assert first.workers == ()
    mon.register(info("w1", "h:1"))
    assert used(await anext(stream)) == {"w1": [0, 0]}
    fake.loads["h:1"] = LoadReport("", [RankLoad(1, 42)])
    await mon.poll_once()
    assert used(await anext(stream)) == {"w1": [0, 42]}
    assert await mon.deregister("w1")
    assert used(await anext(stream)) == {}
    assert fake.forgotten == ["h:1"]
    await stream.aclose()
    assert mon.num_watchers == 0


async def test_slow_watcher_gets_only_the_newest_snapshot() -> None:
    mon = make(FakeWorkers())
    stream = mon.watch()
    await anext(stream)
    for i in range(5):
        mon.register(info(f"w{i}", f"h:{i}"))
    latest = await anext(stream)
    assert len(latest.workers) == 5
    await stream.aclose()


async def test_lease_expiry_evicts_and_publishes() -> None:
    fake = FakeWorkers()
    mon = make(fake, ttl_s=0.5)
    mon.register(info("w1", "h:1"))
    mon.register(info("w2", "h:2"))
    fake.loads["h:1"] = LoadReport("w1", [RankLoad(0, 5)])
    stream = mon.watch()
    await anext(stream)
    mon.start()
    try:

        async def until_gone() -> LoadSnapshot:
            while True:
                mon.heartbeat("w2")
                snap = await anext(stream)
                if "w1" not in used(snap):
                    return snap
                await asyncio.sleep(0.01)

        snap = await asyncio.wait_for(until_gone(), 5.0)
        assert list(used(snap)) == ["w2"]
        # Coming back on the same address starts clean.
        fake.loads["h:1"] = LoadReport("w1b", [])
        mon.register(info("w1b", "h:1"))
        assert used(mon.snapshot())["w1b"] == [0, 0]
    finally:
        await mon.stop()
        await stream.aclose()
    assert "h:1" in fake.forgotten


async def test_poll_loop_runs_every_interval() -> None:
    fake = FakeWorkers()
    mon = make(fake, interval_s=0.05)
    mon.register(info("w1", "h:1"))
    fake.loads["h:1"] = LoadReport("w1", [])
    mon.start()
    try:
        await asyncio.sleep(0.5)
    finally:
        await mon.stop()
    assert 3 <= len(fake.calls) <= 15


async def test_registered_workers_gauge() -> None:
    mon = make(FakeWorkers())
    mon.register(info("p1", "h:1", Role.PREFILL))
    mon.register(info("d1", "h:2", Role.DECODE))
    mon.register(info("d2", "h:3", Role.DECODE))
    assert REGISTERED_WORKERS.labels(role="decode")._value.get() == 2
    await mon.deregister("d1")
    assert REGISTERED_WORKERS.labels(role="decode")._value.get() == 1
    assert REGISTERED_WORKERS.labels(role="prefill")._value.get() == 1


async def test_registration_reply() -> None:
    reg = make(FakeWorkers()).register(info("w1", "h:1"))
    assert (reg.worker_id, reg.lease_ttl_ms) == ("w1", 10_000)
    assert 0 < reg.heartbeat_interval_ms < reg.lease_ttl_ms


async def test_stop_ends_watch_streams() -> None:
    mon = make(FakeWorkers())
    mon.start()
    stream = mon.watch()
    await anext(stream)

    async def drain() -> int:
        return len([s async for s in stream])

    reader = asyncio.create_task(drain())
    await asyncio.sleep(0.05)
    await mon.stop()
    await asyncio.wait_for(reader, 2.0)
    assert mon.num_watchers == 0


def test_a_registration_listing_adapters_its_worker_does_not_serve_is_a_mismatch() -> None:
    """Routing trusts lora_adapters: a registration claiming an adapter the worker's own Info
    does not list would send that adapter's requests to a worker without it."""
    served = replace(info("w", "h:1"), lora_adapters=("sql",))
    assert identity_mismatch(served, served) is None
    claimed = replace(served, lora_adapters=("sql", "chat"))
    assert identity_mismatch(claimed, served) == "lora_adapters ('sql',) (registered: ('sql', 'chat'))"
