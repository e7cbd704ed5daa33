"""Settings of the load-monitor (flags `--field-name`, env `PDSERVE_FIELD_NAME`)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.settings import field
from shared.tls import TlsSettings


@dataclass(frozen=True)
class Settings(TlsSettings):
    """pdserve load-monitor: worker membership (leases) and per-DP-rank load snapshots."""

    listen: str = field("0.0.0.0:50053", "host:port to serve gRPC on")
    metrics_port: int = field(9102, "Prometheus /metrics port (-1 disables, 0 picks a free one)")
    load_interval_s: float = field(0.5, "seconds between two GetLoad polls of every worker")
    load_timeout_s: float = field(
        0.4,
        "per-call timeout of one GetLoad poll (seconds); capped at load_interval_s so that one "
        "slow worker cannot delay everyone's reports",
    )
    lease_ttl_s: float = field(10.0, "a worker not heard from (Heartbeat) for this long is removed")
    stale_after_s: float = field(2.0, "a worker whose loads are older than this (seconds) is flagged stale")
    log_level: str = field("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = field("auto", "log format", choices=("auto", "json", "console"))
    drain_grace_s: float = field(30.0, "seconds to finish in-flight calls on SIGTERM")

    def __post_init__(self) -> None:
        if self.load_interval_s <= 0:
            raise ValueError("load_interval_s must be > 0")
        if self.load_timeout_s <= 0:
            raise ValueError("load_timeout_s must be > 0")
        if self.lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be > 0")
        if self.stale_after_s <= 0:
            raise ValueError("stale_after_s must be > 0")
