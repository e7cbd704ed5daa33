"""Scheduler and load-monitor settings: documented defaults, flags, env, missing = default."""

from __future__ import annotations

import pytest

from services.load_monitor.settings import Settings as LoadMonitorSettings
from services.scheduler.server import make_router
from services.scheduler.settings import Settings
from shared.settings import parse_settings


def test_scheduler_defaults() -> None:
    s = parse_settings(Settings, [], env={})
    assert s.listen == "0.0.0.0:50052" and s.metrics_port == 9101
    assert s.load_monitor_address == "127.0.0.1:50053"
    assert (s.prefill_policy, s.decode_policy, s.dp_rank_policy) == (
        "cache_aware", "power_of_two", "min_tokens",
    )
    assert s.local_prefill_threshold == 0
    r = make_router(s)
    assert r.policies.dp_rank == "min_tokens"


def test_scheduler_flags_and_env() -> None:
    s = parse_settings(
        Settings,
        ["--dp-rank-policy", "hash", "--local-prefill-threshold", "128"],
        env={"PDSERVE_DECODE_POLICY": "round_robin", "PDSERVE_UNRELATED": "x"},
    )
    assert (s.dp_rank_policy, s.decode_policy, s.local_prefill_threshold) == ("hash", "round_robin", 128)
    # Only some fields set (an older config): the rest take their defaults.
    assert s.prefill_policy == "cache_aware"


def test_scheduler_rejects_unknown_policy() -> None:
    with pytest.raises(SystemExit):
        parse_settings(Settings, ["--dp-rank-policy", "bytes"], env={})


def test_load_monitor_defaults() -> None:
    s = parse_settings(LoadMonitorSettings, [], env={})
    assert s.listen == "0.0.0.0:50053" and s.metrics_port == 9102
    assert (s.load_interval_s, s.lease_ttl_s) == (0.5, 10.0)
    assert s.stale_after_s > s.load_interval_s
    with pytest.raises(SystemExit):
        parse_settings(LoadMonitorSettings, ["--load-interval-s", "0"], env={})


def test_snapshot_conversion_skips_unusable_workers() -> None:
    from services.scheduler.convert import snapshot_from_pb
    from shared.proto import common_pb2, load_monitor_pb2

    def entry(worker_id: str, role: int) -> load_monitor_pb2.WorkerLoad:
        return load_monitor_pb2.WorkerLoad(
            info=common_pb2.WorkerInfo(
                worker_id=worker_id, address="h:1", role=role, model_id="m", dp_size=2,  # type: ignore[arg-type]
                kv_layout=common_pb2.KvLayout(block_size=16, dtype="float32"),
            ),
            ranks=[
                common_pb2.RankLoad(dp_rank=1, num_used_tokens=5),
                common_pb2.RankLoad(dp_rank=1, num_used_tokens=2),
            ],
        )

    pb = load_monitor_pb2.LoadSnapshot(
        workers=[entry("ok", common_pb2.WORKER_ROLE_DECODE), entry("odd", 7)], version=3
    )
    snapshot, skipped = snapshot_from_pb(pb)
    assert [w.info.worker_id for w in snapshot.workers] == ["ok"] and skipped == ["odd"]
    assert [r.num_used_tokens for r in snapshot.workers[0].ranks] == [0, 7]  # summed per rank
