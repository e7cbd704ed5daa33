"""The scheduling benchmark's report: its targets (checked and printed) and the results document
written to benchmarks/results/sched-<machine class>.json (same keys as ever: max_mean_ratio per policy,
decision_p99_us, details, the machine)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks.sched.config import SimConfig
from benchmarks.sched.sim import SimResult


def targets(sim: list[SimResult], dec: dict[str, float]) -> dict[str, bool]:
    """The targets, printed with whether each was met."""
    by = {r.policy: r for r in sim}
    rr, mt = by["round_robin"], by["min_tokens"]
    checks = {
        "min_tokens max/mean <= 1.10": mt.max_mean_ratio <= 1.10,
        "round_robin max/mean >= 1.3": rr.max_mean_ratio >= 1.3,
        "min_tokens p50 TTFT >= 15% lower than round_robin": mt.p50_ttft_s <= 0.85 * rr.p50_ttft_s,
        "decision p99 <= 100 us": dec["wall_p99_us"] <= 100.0,
    }
    print("\ntargets (simulation, 85% load; decision latency wall clock):")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'MISSED'}] {name}")
    return checks


def write(
    out: Path,
    cfg: SimConfig,
    sim: list[SimResult],
    dec: dict[str, float],
    seeds: dict[str, float],
    sweep: list[dict[str, float]],
    grpc_lat: dict[str, float] | None,
    e2e: dict[str, dict[str, float]] | None,
    checks: dict[str, bool],
) -> None:
    result: dict[str, Any] = {
        "max_mean_ratio": {r.policy: round(r.max_mean_ratio, 4) for r in sim},
        "max_mean_ratio_prefill": {r.policy: round(r.max_mean_ratio_prefill, 4) for r in sim},
        "decision_p99_us": round(dec["wall_p99_us"], 2),
        "decision_p50_us": round(dec["wall_p50_us"], 2),
        "decision_cpu_p99_us": round(dec["cpu_p99_us"], 2),
        "decision_cpu_p50_us": round(dec["cpu_p50_us"], 2),
        "ttft_ms": {
            r.policy: {
                "mean": round(r.mean_ttft_s * 1000, 1),
                "p50": round(r.p50_ttft_s * 1000, 1),
                "p99": round(r.p99_ttft_s * 1000, 1),
            }
            for r in sim
        },
        "tpot_ms": {r.policy: round(r.mean_tpot_s * 1000, 2) for r in sim},
        "seed_sweep": seeds,
        "load_sweep": sweep,
        "grpc_decision_us": grpc_lat,
        "e2e": e2e,
        "simulation": dict(cfg.__dict__),
        "targets_met": checks,
    }
    from benchmarks.engine_floor import cpu_features

    result["machine"] = cpu_features() | {"load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
