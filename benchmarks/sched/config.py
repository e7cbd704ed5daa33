"""What the scheduling benchmark runs: the simulated cluster (`SimConfig`) and its seeded Poisson
trace, the end-to-end run's shape (`E2EConfig`), and the policies compared."""

from __future__ import annotations

import random
from dataclasses import dataclass

from shared.cluster import KvLayout

SIM_POLICIES = ("round_robin", "random", "hash", "min_tokens")
E2E_POLICIES = ("round_robin", "hash", "min_tokens")
BLOCK_SIZE = 16

LAYOUT = KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=BLOCK_SIZE, dtype="bfloat16")


@dataclass(frozen=True)
class SimConfig:
    num_workers: int = 4  # per pool: N prefill workers and N decode workers
    dp_size: int = 4
    num_requests: int = 12_000
    prompt_min_tokens: int = 100
    prompt_max_tokens: int = 4000
    output_min_tokens: int = 50
    output_max_tokens: int = 400
    # Prefill rank: FIFO, up to chunk_tokens per step; step = overhead + tokens * cost.
    prefill_overhead_s: float = 0.005
    prefill_s_per_token: float = 0.0001  # 10k prompt tokens/s per rank
    chunk_tokens: int = 2048
    # Decode rank: one token per running request per step; step = overhead + KV tokens * cost
    # (attention reads the whole KV of the rank every step).
    decode_overhead_s: float = 0.015
    decode_s_per_kv_token: float = 0.0000003  # 0.3 ms per 1k KV tokens
    target_prefill_utilization: float = 0.85  # of the prefill pool; sets the arrival rate
    report_interval_s: float = 0.5  # load-monitor --load-interval-s
    reservation_grace_s: float = 0.05  # scheduler --reservation-grace-s (default)
    sample_interval_s: float = 0.1
    warmup_fraction: float = 0.15
    seed: int = 7

    @property
    def num_ranks(self) -> int:
        return self.num_workers * self.dp_size

    @property
    def arrival_rate_per_s(self) -> float:
        mean_prompt = (self.prompt_min_tokens + self.prompt_max_tokens) / 2
        per_rank_s = mean_prompt * self.prefill_s_per_token + self.prefill_overhead_s
        return self.target_prefill_utilization * self.num_ranks / per_rank_s


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def make_trace(cfg: SimConfig) -> list[TraceRequest]:
    rng = random.Random(cfg.seed)
    t = 0.0
    trace = []
    for i in range(cfg.num_requests):
        t += rng.expovariate(cfg.arrival_rate_per_s)
        trace.append(
            TraceRequest(
                request_id=f"req-{rng.getrandbits(64):016x}-{i}",
                arrival_s=t,
                prompt_tokens=rng.randint(cfg.prompt_min_tokens, cfg.prompt_max_tokens),
                output_tokens=rng.randint(cfg.output_min_tokens, cfg.output_max_tokens),
            )
        )
    return trace


@dataclass(frozen=True)
class E2EConfig:
    num_requests: int = 80
    arrival_rate_per_s: float = 8.0
    prompt_min_tokens: int = 25  # the simulation's 100..4000, scaled 1/4 to the tiny model
    prompt_max_tokens: int = 1000
    output_min_tokens: int = 64
    output_max_tokens: int = 192
    seed: int = 11
