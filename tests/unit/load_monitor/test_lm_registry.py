"""Membership, leases, eviction and load summing of the load-monitor registry (fake clock)."""

from __future__ import annotations

import pytest

from services.load_monitor.registry import Registry
from shared.cluster import KvLayout, RankLoad, Role, WorkerInfo, sum_rank_loads
from shared.errors import InvalidArgument

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(worker_id: str = "w1", address: str = "10.0.0.1:5000", dp_size: int = 2) -> WorkerInfo:
    return WorkerInfo(worker_id, address, Role.UNIFIED, "m", dp_size, LAYOUT)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def reg(clock: FakeClock) -> Registry:
    return Registry(lease_ttl_s=10.0, stale_after_s=2.0, clock=clock, wall_clock=lambda: 1.5)


def ids(reg: Registry) -> list[str]:
    return [w.info.worker_id for w in reg.snapshot().workers]


def test_register_heartbeat_deregister(reg: Registry, clock: FakeClock) -> None:
    reg.register(info("w1"))
    assert ids(reg) == ["w1"]
    clock.now += 9
    assert reg.heartbeat("w1")
    clock.now += 9  # 18 s after registration, 9 after the heartbeat: still live
    assert ids(reg) == ["w1"]
    assert reg.deregister("w1")
    assert ids(reg) == []
    assert not reg.deregister("w1")
    assert not reg.heartbeat("w1")


def test_expired_lease_is_gone_from_snapshots_at_once(reg: Registry, clock: FakeClock) -> None:
    reg.register(info("w1"))
    clock.now += 10.0
    # expire() has not run yet, but no snapshot shows the worker and heartbeats are refused.
    assert ids(reg) == []
    assert not reg.heartbeat("w1")
    assert [i.worker_id for i in reg.expire()] == ["w1"]
    assert reg.expire() == []


def test_reregistration_on_same_address_starts_clean(reg: Registry) -> None:
    reg.register(info("w1"))
    (target,) = reg.poll_targets()
    assert reg.record_loads(target, [RankLoad(0, num_used_tokens=500)])
    assert reg.snapshot().workers[0].ranks[0].num_used_tokens == 500
    reg.register(info("w2"))  # a new process on the same address
    (worker,) = reg.snapshot().workers
    assert worker.info.worker_id == "w2"
    assert all(r.num_used_tokens == 0 for r in worker.ranks)
    # A poll that started before the re-registration cannot write the old loads back.
    assert not reg.record_loads(target, [RankLoad(0, num_used_tokens=999)])
    assert reg.snapshot().workers[0].ranks[0].num_used_tokens == 0


def test_same_id_reregistering_starts_clean(reg: Registry) -> None:
    reg.register(info("w1"))
    (target,) = reg.poll_targets()
    reg.record_loads(target, [RankLoad(1, num_used_tokens=7)])
    reg.register(info("w1", dp_size=4))
    (worker,) = reg.snapshot().workers
    assert [r.num_used_tokens for r in worker.ranks] == [0, 0, 0, 0]


def test_several_reports_for_a_rank_are_summed(reg: Registry) -> None:
    reg.register(info("w1", dp_size=2))
    (target,) = reg.poll_targets()
    reg.record_loads(
        target,
        [
            RankLoad(
                0,
                num_used_tokens=100,
                num_running=1,
                kv_capacity_tokens=1000,
                prefix_cache_queries_tokens=10,
                prefix_cache_hits_tokens=5,
            ),
            RankLoad(
                0,
                num_used_tokens=50,
                num_running=2,
                num_waiting=3,
                kv_capacity_tokens=1000,
                prefix_cache_queries_tokens=30,
                prefix_cache_hits_tokens=5,
            ),
            RankLoad(1, num_used_tokens=7),
            RankLoad(5, num_used_tokens=10_000),  # no such rank: dropped
        ],
    )
    r0, r1 = reg.snapshot().workers[0].ranks
    assert (r0.dp_rank, r0.num_used_tokens, r0.num_running, r0.num_waiting) == (0, 150, 3, 3)
    assert r0.kv_capacity_tokens == 2000
    assert r0.prefix_cache_hit_rate == pytest.approx(10 / 40)
    assert (r1.dp_rank, r1.num_used_tokens) == (1, 7)


def test_missing_ranks_are_zero() -> None:
    ranks = sum_rank_loads([RankLoad(2, num_used_tokens=3)], 3)
    assert [(r.dp_rank, r.num_used_tokens) for r in ranks] == [(0, 0), (1, 0), (2, 3)]
    assert ranks[0].prefix_cache_hit_rate == 0.0


def test_age_and_stale_flag(reg: Registry, clock: FakeClock) -> None:
    reg.register(info("w1"))
    clock.now += 1.0
    (w,) = reg.snapshot().workers
    assert (w.age_ms, w.stale) == (1000, False)  # never polled: age since registration
    clock.now += 1.5
    (w,) = reg.snapshot().workers
    assert w.stale
    (target,) = reg.poll_targets()
    reg.record_loads(target, [])
    clock.now += 0.25
    (w,) = reg.snapshot().workers
    assert (w.age_ms, w.stale) == (250, False)


def test_versions_increase_and_timestamp(reg: Registry) -> None:
    a, b = reg.snapshot(), reg.snapshot()
    assert b.version > a.version
    assert a.timestamp_ms == 1500


def test_worker_id_assigned_when_empty(reg: Registry) -> None:
    registered = reg.register(info(""))
    assert registered.worker_id.startswith("worker-")
    assert ids(reg) == [registered.worker_id]


@pytest.mark.parametrize(
    "bad",
    [
        info(address="nohostport"),
        info(dp_size=0),
        WorkerInfo("w", "h:1", Role.DECODE, "", 1, LAYOUT),
        WorkerInfo("w", "h:1", Role.DECODE, "m", 1, KvLayout(1, 1, 1, 0, "float32")),
        # LoRA adapter names are model ids requests route by
        WorkerInfo("w", "h:1", Role.DECODE, "m", 1, LAYOUT, lora_adapters=("sql", "sql")),
        WorkerInfo("w", "h:1", Role.DECODE, "m", 1, LAYOUT, lora_adapters=("",)),
        WorkerInfo("w", "h:1", Role.DECODE, "m", 1, LAYOUT, lora_adapters=("m",)),
    ],
)
def test_invalid_registrations(reg: Registry, bad: WorkerInfo) -> None:
    with pytest.raises(InvalidArgument):
        reg.register(bad)


def test_count_by_role(reg: Registry) -> None:
    reg.register(info("a", "h:1"))
    reg.register(WorkerInfo("b", "h:2", Role.PREFILL, "m", 1, LAYOUT))
    counts = reg.count_by_role()
    assert counts[Role.UNIFIED] == 1 and counts[Role.PREFILL] == 1 and counts[Role.DECODE] == 0
