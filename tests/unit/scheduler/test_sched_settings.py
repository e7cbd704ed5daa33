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
        "cache_aware",
        "power_of_two",
        "min_tokens",
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
