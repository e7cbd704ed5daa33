"""(c) Schedule decision latency: the real `Router.schedule` (default policies) over a large
snapshot with the simulation's prompt mix, and the same call through gRPC on loopback."""

from __future__ import annotations

import random
import statistics
import time

from benchmarks.sched.config import BLOCK_SIZE, LAYOUT
from benchmarks.sched.sim import pct
from services.scheduler.router import Policies, Router
from services.scheduler.types import RequestFeatures
from shared.cluster import LoadSnapshot, RankLoad, Role, WorkerInfo, WorkerLoad


def big_snapshot(num_workers: int, dp_size: int, rng: random.Random) -> LoadSnapshot:
    workers = []
    for i in range(num_workers):
        role = Role.PREFILL if i % 2 == 0 else Role.DECODE
        info = WorkerInfo(
            worker_id=f"w{i:04d}",
            address=f"10.0.{i // 250}.{i % 250}:50061",
            role=role,
            model_id="m",
            dp_size=dp_size,
            kv_layout=LAYOUT,
            capabilities=("generated_tokens",),
            max_model_len=8192,
        )
        ranks = tuple(RankLoad(r, num_used_tokens=rng.randint(0, 60_000)) for r in range(dp_size))
        workers.append(WorkerLoad(info=info, ranks=ranks, age_ms=rng.randint(0, 500), stale=False))
    return LoadSnapshot(workers=tuple(workers), version=1, timestamp_ms=0)


def make_features(n: int, rng: random.Random) -> list[RequestFeatures]:
    """Prompt mix of the simulation; 1 in 2 requests shares one of 20 system prompts (~1k tokens)."""
    shared = [[rng.getrandbits(64) for _ in range(64)] for _ in range(20)]
    out = []
    for i in range(n):
        tokens = rng.randint(100, 4000)
        blocks = tokens // BLOCK_SIZE
        prefix = shared[rng.randrange(20)][: min(64, blocks)] if rng.random() < 0.5 else []
        hashes = prefix + [rng.getrandbits(64) for _ in range(blocks - len(prefix))]
        out.append(
            RequestFeatures(
                request_id=f"bench-{i}",
                prompt_tokens=tokens,
                prefix_block_hashes=tuple(hashes),
                max_tokens=256,
            )
        )
    return out


def bench_decisions(num_workers: int, dp_size: int, num_decisions: int, rounds: int = 5) -> dict[str, float]:
    """p50/p99 of `Router.schedule`, per round of `num_decisions // rounds` decisions; the
    median round is reported (this machine is shared: single rounds catch other people's
    processes). Wall time and this thread's CPU time are both measured."""
    rng = random.Random(3)
    router = Router(Policies(), seed=5)
    snap = big_snapshot(num_workers, dp_size, rng)
    features = make_features(num_decisions, rng)
    router.apply_snapshot(snap)
    for f in features[:500]:  # warm the prefix index
        router.schedule(f)
    per_round = max(1, num_decisions // rounds)
    stats: dict[str, list[float]] = {"wall_p50": [], "wall_p99": [], "cpu_p50": [], "cpu_p99": []}
    for r in range(rounds):
        wall_us, cpu_us = [], []
        for i, f in enumerate(features[r * per_round : (r + 1) * per_round]):
            if i % 1000 == 0:
                router.apply_snapshot(snap)  # a load report arrives (not timed)
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            router.schedule(f)
            t1 = time.perf_counter_ns()
            c1 = time.thread_time_ns()
            wall_us.append((t1 - t0) / 1000)
            cpu_us.append((c1 - c0) / 1000)
        stats["wall_p50"].append(pct(wall_us, 0.5))
        stats["wall_p99"].append(pct(wall_us, 0.99))
        stats["cpu_p50"].append(pct(cpu_us, 0.5))
        stats["cpu_p99"].append(pct(cpu_us, 0.99))
    out = {f"{k}_us": statistics.median(v) for k, v in stats.items()}
    out["wall_p99_worst_round_us"] = max(stats["wall_p99"])
    out["wall_p99_best_round_us"] = min(stats["wall_p99"])
    return out


async def bench_grpc(num_workers: int, dp_size: int, num_calls: int) -> dict[str, float]:
    import grpc

    from services.scheduler.servicer import SchedulerServicer
    from shared.proto import scheduler_pb2, scheduler_pb2_grpc
    from shared.server import Server

    rng = random.Random(4)
    router = Router(Policies(), seed=6)
    router.apply_snapshot(big_snapshot(num_workers, dp_size, rng))
    server = Server("127.0.0.1:0", ["pdserve.v1.Scheduler"])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(router), server.grpc)
    await server.start()
    requests = [
        scheduler_pb2.ScheduleRequest(
            request_id=f.request_id,
            prompt_tokens=f.prompt_tokens,
            prefix_block_hashes=f.prefix_block_hashes,
            max_tokens=f.max_tokens,
        )
        for f in make_features(num_calls, rng)
    ]
    times_us = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for req in requests[:100]:
            await stub.Schedule(req)
        for req in requests:
            t0 = time.perf_counter_ns()
            await stub.Schedule(req)
            times_us.append((time.perf_counter_ns() - t0) / 1000)
    await server.stop(0)
    return {"p50_us": pct(times_us, 0.5), "p99_us": pct(times_us, 0.99)}


# --------------------------------------------------------------------------------------------
# (b) end to end on real workers
# --------------------------------------------------------------------------------------------
