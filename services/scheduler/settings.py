"""Settings of the scheduler (flags `--field-name`, env `PDSERVE_FIELD_NAME`). Every field has a
default, so a config that predates a field keeps loading."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.policies import RANK_POLICIES, UNIFIED_DISAGGREGATE_THRESHOLD, WORKER_POLICIES
from shared.settings import field
from shared.tls import TlsSettings


@dataclass(frozen=True)
class Settings(TlsSettings):
    """pdserve scheduler: picks prefill/decode workers, DP ranks and the serving mode."""

    listen: str = field("0.0.0.0:50052", "host:port to serve gRPC on")
    metrics_port: int = field(9101, "Prometheus /metrics port (-1 disables, 0 picks a free one)")
    load_monitor_address: str = field("127.0.0.1:50053", "host:port of the load-monitor")
    prefill_policy: str = field(
        "cache_aware",
        "prefill worker choice (also the unified worker in aggregated mode): "
        "round_robin | random | power_of_two | cache_aware",
        choices=WORKER_POLICIES,
    )
    decode_policy: str = field(
        "power_of_two",
        "decode worker choice: round_robin | random | power_of_two | cache_aware",
        choices=WORKER_POLICIES,
    )
    dp_rank_policy: str = field(
        "min_tokens",
        "DP rank inside the chosen worker: min_tokens | round_robin | hash (of the request id)",
        choices=RANK_POLICIES,
    )
    local_prefill_threshold: int = field(
        0,
        "prefill on the decode worker when the prompt's uncached part is below this many tokens "
        "(0 = always disaggregate: the default, chosen from the goodput benchmark, where local "
        "prefill on a CPU decode worker stalled its decode batch and lowered goodput)",
    )
    unified_disaggregate_threshold: int = field(
        UNIFIED_DISAGGREGATE_THRESHOLD,
        "with two or more unified workers: a prompt whose uncached part is at least this many "
        "tokens prefills on the least loaded unified worker and decodes on another; shorter ones "
        "run aggregated (0 = off: every request aggregated on one unified worker). The default "
        "was chosen from the goodput benchmark on CPU",
    )
    reservation_grace_s: float = field(
        0.05,
        "a load report polled at T replaces the reservations made before T minus this (seconds): "
        "time for a routed request to show up in its worker's report",
    )
    cache_aware_balance_abs_tokens: int = field(
        8192, "cache_aware ignores prefix matches when loads differ by more than this (tokens) ..."
    )
    cache_aware_balance_rel: float = field(
        1.5, "... and the most loaded worker has more than this times the least loaded's tokens"
    )
    cache_aware_min_match_share: float = field(
        0.5,
        "cache_aware follows a prefix match only when it covers at least this share of the "
        "prompt's full blocks (a chat template's one shared block must not pile requests up)",
    )
    prefix_entries_per_worker: int = field(
        65536, "prompt prefixes (sampled block-hash depths) remembered per worker for cache_aware (count)"
    )
    seed: int = field(-1, "seed of the random policies (-1 = nondeterministic)")
    watch_backoff_max_s: float = field(
        5.0, "longest wait between two reconnects to the load-monitor (seconds)"
    )
    log_level: str = field("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = field("auto", "log format", choices=("auto", "json", "console"))
    drain_grace_s: float = field(30.0, "seconds to finish in-flight calls on SIGTERM")

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")
        if self.unified_disaggregate_threshold < 0:
            raise ValueError("unified_disaggregate_threshold must be >= 0")
        if not 0.0 <= self.cache_aware_min_match_share <= 1.0:
            raise ValueError("cache_aware_min_match_share must be within [0, 1]")
        if self.reservation_grace_s < 0:
            raise ValueError("reservation_grace_s must be >= 0")
        if self.prefix_entries_per_worker < 1:
            raise ValueError("prefix_entries_per_worker must be >= 1")
        if self.watch_backoff_max_s <= 0:
            raise ValueError("watch_backoff_max_s must be > 0")
