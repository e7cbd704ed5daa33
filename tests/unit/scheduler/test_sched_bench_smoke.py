"""The scheduling benchmark's simulation on a short trace: it runs, and min_tokens balances rank
loads better than the load-blind policies (simulated time, no wall-clock assertion)."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.sched.config import SIM_POLICIES, SimConfig, make_trace
from benchmarks.sched.decisions import bench_decisions
from benchmarks.sched.sim import simulate


def test_simulation_min_tokens_balances_best() -> None:
    cfg = replace(SimConfig(), num_requests=2500, num_workers=2)
    trace = make_trace(cfg)
    results = {p: simulate(p, cfg, trace) for p in SIM_POLICIES}
    best = min(results.values(), key=lambda r: r.max_mean_ratio)
    assert best.policy == "min_tokens"
    assert results["min_tokens"].max_mean_ratio < 1.2 < results["round_robin"].max_mean_ratio
    assert all(r.p50_ttft_s > 0 for r in results.values())


def test_decision_benchmark_runs() -> None:
    out = bench_decisions(num_workers=40, dp_size=8, num_decisions=600, rounds=2)
    assert out["wall_p50_us"] > 0 and out["cpu_p99_us"] > 0
