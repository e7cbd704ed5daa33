"""Scheduling benchmark (`make bench-sched`): DP-rank balance and TTFT per routing policy in a
simulated disaggregated cluster, Schedule decision latency at 1,000 workers x 8 ranks, and the
rank policies end to end on real CPU workers (when the worker service is there).

(a) Simulation. One Poisson trace (prompt lengths uniform in [100, 4000] tokens, outputs in
    [50, 400]) is replayed for each policy against N prefill workers x D ranks and N decode
    workers x D ranks. Each request gets a prefill rank and a decode rank at arrival (one Schedule
    call); the decode rank reserves the prompt's KV at once. Prefill ranks run their queue FIFO
    in chunks (step = overhead + prompt tokens x cost); decode ranks decode every running request
    once per step (step = overhead + KV tokens x cost); each rank has its own step loop, as in
    pdserve's engine. A rank's load is its tokens in use, the quantity workers report. The
    router sees load reports every `report_interval_s` (the load-monitor interval) plus its own
    reservations since, using the real `Reservations` and the real pure policy functions over
    the pool's N x D ranks. max/mean = time average of the largest rank load / time average of
    the mean rank load (decode ranks, where tokens stay for the whole generation; prefill ranks
    are printed too), sampled every 100 ms after warm-up. TTFT = arrival to end of prefill.
    The main table runs the prefill pool at 85 % utilization (a loaded cluster, where routing
    matters); a sweep below it shows how the gain depends on load.
(b) End to end on real workers (tiny model, CPU, --dp-size 2): `bench_e2e`.
(c) The real `Router.schedule` (domain call, default policies: cache_aware prefill,
    power_of_two decode, min_tokens ranks) over 500 prefill + 500 decode workers x 8 ranks with
    prefix hashes of the same prompt mix, plus the same through gRPC on loopback.

Writes benchmarks/results/sched-<machine class>.json, e.g. sched-cpu-avx512.json (max_mean_ratio per
policy, decision_p99_us, details).
This module is the command; the parts are in `benchmarks/sched/` (config, sim, decisions, e2e,
report).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from benchmarks.result_names import result_path
from benchmarks.sched import report
from benchmarks.sched.config import SimConfig
from benchmarks.sched.decisions import bench_decisions, bench_grpc
from benchmarks.sched.e2e import run_e2e
from benchmarks.sched.sim import run_load_sweep, run_seed_sweep, run_simulation


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--requests", type=int, default=SimConfig.num_requests, help="simulated trace length")
    p.add_argument("--decisions", type=int, default=20_000, help="timed Router.schedule calls")
    p.add_argument("--grpc-calls", type=int, default=2_000, help="timed Schedule RPCs; 0 skips")
    p.add_argument("--e2e", choices=("auto", "skip"), default="auto", help="real-worker run")
    p.add_argument("--out", type=Path, help="default benchmarks/results/sched-<machine class>.json")
    a = p.parse_args(argv)

    cfg = SimConfig(num_requests=a.requests)
    sim = run_simulation(cfg)
    seeds = run_seed_sweep(cfg, (1, 2, 3, 4, 5))
    sweep = run_load_sweep(cfg, (0.6, 0.7, 0.8))

    print("\n(b) end to end on real workers")
    e2e = run_e2e() if a.e2e == "auto" else None
    if e2e is None and a.e2e == "skip":
        print("skipped (--e2e skip)")

    print("\n(c) Schedule decision latency, 1000 workers x 8 ranks (500 prefill + 500 decode), defaults")
    dec = bench_decisions(1000, 8, a.decisions)
    print(
        f"domain Router.schedule, {a.decisions} decisions in 5 rounds (median round): "
        f"p50 {dec['wall_p50_us']:.1f} us, p99 {dec['wall_p99_us']:.1f} us wall "
        f"(rounds' p99 {dec['wall_p99_best_round_us']:.0f}..{dec['wall_p99_worst_round_us']:.0f} us); "
        f"thread CPU time p50 {dec['cpu_p50_us']:.1f} us, p99 {dec['cpu_p99_us']:.1f} us"
    )
    grpc_lat = None
    if a.grpc_calls > 0:
        grpc_lat = asyncio.run(bench_grpc(1000, 8, a.grpc_calls))
        print(
            f"through gRPC (loopback, one client, sequential): p50 {grpc_lat['p50_us']:.0f} us, "
            f"p99 {grpc_lat['p99_us']:.0f} us"
        )

    checks = report.targets(sim, dec)
    report.write(a.out or result_path("sched"), cfg, sim, dec, seeds, sweep, grpc_lat, e2e, checks)


if __name__ == "__main__":
    main(sys.argv[1:])
