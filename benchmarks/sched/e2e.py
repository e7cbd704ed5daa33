"""(b) The DP-rank policies end to end: load-monitor, scheduler, two unified CPU workers with two
ranks each and the gateway in this process, a Poisson trace through Generate, rank loads sampled
from the load-monitor (skipped when the worker or gateway services are not installed)."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
from pathlib import Path

from benchmarks.sched.config import BLOCK_SIZE, E2E_POLICIES, E2EConfig
from benchmarks.sched.sim import pct
from shared.cluster import Role


async def _e2e_policy(policy: str, model: Path, cfg: E2EConfig) -> dict[str, float]:
    """load-monitor + scheduler(dp_rank_policy=policy) + 2 unified workers --dp-size 2 +
    gateway, all in this process; a Poisson trace through the gateway's Generate."""
    import grpc

    from services.gateway.server import build_app as build_gateway
    from services.gateway.settings import GatewaySettings
    from services.load_monitor.server import build as build_load_monitor
    from services.load_monitor.settings import Settings as LoadMonitorSettings
    from services.scheduler.server import build as build_scheduler
    from services.scheduler.settings import Settings as SchedulerSettings
    from services.worker.server import WorkerApp
    from services.worker.settings import WorkerSettings
    from shared.proto import gateway_pb2, gateway_pb2_grpc, load_monitor_pb2, load_monitor_pb2_grpc

    lm = build_load_monitor(
        LoadMonitorSettings(listen="127.0.0.1:0", metrics_port=-1, load_interval_s=0.1, drain_grace_s=0)
    )
    await lm.start()
    sched = build_scheduler(
        SchedulerSettings(
            listen="127.0.0.1:0",
            metrics_port=-1,
            load_monitor_address=lm.server.address,
            prefill_policy="round_robin",
            dp_rank_policy=policy,
            seed=1,
            drain_grace_s=0,
        )
    )
    await sched.start()
    workers = [
        WorkerApp(
            WorkerSettings(
                role=Role.UNIFIED,
                listen="127.0.0.1:0",
                metrics_port=-1,
                model=str(model),
                device="cpu",
                dtype="float32",
                dp_size=2,
                block_size=BLOCK_SIZE,
                kv_cache_tokens=16384,
                max_model_len=2048,
                torch_threads=1,
                drain_grace_s=0,
                load_monitor_address=lm.server.address,
                heartbeat_interval_s=0.5,
            )
        )
        for _ in range(2)
    ]
    for w in workers:
        await w.start()
    gateway = build_gateway(
        GatewaySettings(
            listen="127.0.0.1:0",
            metrics_port=-1,
            scheduler_address=sched.server.address,
            model=str(model),
            block_size=BLOCK_SIZE,
            drain_grace_s=0,
        )
    )
    await gateway.start()
    while len(sched.router.state().workers) < 2:
        await asyncio.sleep(0.02)

    rng = random.Random(cfg.seed)
    loop = asyncio.get_running_loop()
    ttfts: list[float] = []
    samples: list[tuple[int, float]] = []
    done = asyncio.Event()

    async def sample(stub: load_monitor_pb2_grpc.LoadMonitorStub) -> None:
        while not done.is_set():
            snap = await stub.GetLoads(load_monitor_pb2.GetLoadsRequest())
            loads = [r.num_used_tokens for w in snap.workers for r in w.ranks]
            if loads and sum(loads) > 0:
                samples.append((max(loads), sum(loads) / len(loads)))
            await asyncio.sleep(0.05)

    async def one(stub: gateway_pb2_grpc.GatewayStub, delay_s: float, prompt: list[int], out: int) -> None:
        await asyncio.sleep(delay_s)
        t0 = loop.time()
        first = True
        async for _ in stub.Generate(
            gateway_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=out, temperature=0, ignore_eos=True
            ),
            timeout=120,
        ):
            if first:
                ttfts.append(loop.time() - t0)
                first = False

    t = 0.0
    jobs = []
    for _ in range(cfg.num_requests):
        t += rng.expovariate(cfg.arrival_rate_per_s)
        n = rng.randint(cfg.prompt_min_tokens, cfg.prompt_max_tokens)
        prompt = [rng.randrange(3, 400) for _ in range(n)]
        jobs.append((t, prompt, rng.randint(cfg.output_min_tokens, cfg.output_max_tokens)))
    try:
        async with (
            grpc.aio.insecure_channel(gateway.server.address) as gch,
            grpc.aio.insecure_channel(lm.server.address) as lch,
        ):
            sampler = asyncio.create_task(sample(load_monitor_pb2_grpc.LoadMonitorStub(lch)))
            gstub = gateway_pb2_grpc.GatewayStub(gch)
            await asyncio.gather(*(one(gstub, d, p, o) for d, p, o in jobs))
            done.set()
            await sampler
    finally:
        await gateway.stop(0)
        for w in workers:
            await w.stop()
        await sched.stop()
        await lm.stop()
    return {
        "max_mean_ratio": sum(m for m, _ in samples) / max(sum(a for _, a in samples), 1e-9),
        "mean_ttft_ms": statistics.fmean(ttfts) * 1000,
        "p50_ttft_ms": pct(ttfts, 0.5) * 1000,
        "samples": len(samples),
    }


def run_e2e(cfg: E2EConfig | None = None) -> dict[str, dict[str, float]] | None:
    cfg = cfg or E2EConfig()
    try:
        import services.gateway.server
        import services.worker.server  # noqa: F401
        from tests.support.tiny_models import build_tiny_model
    except ImportError as exc:
        print(f"skipped: {exc} (needs the worker and gateway services)")
        return None
    import logging
    import tempfile

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(
        f"2 unified workers x 2 ranks (tiny model, CPU), {cfg.num_requests} requests through the "
        f"gateway, Poisson {cfg.arrival_rate_per_s} req/s, prompts {cfg.prompt_min_tokens}.."
        f"{cfg.prompt_max_tokens} tokens, outputs {cfg.output_min_tokens}..{cfg.output_max_tokens}; "
        "workers picked round robin, DP rank by the policy; loads sampled from the load-monitor"
    )
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", "bpe")
        for policy in E2E_POLICIES:
            out[policy] = asyncio.run(_e2e_policy(policy, model, cfg))
    print(f"{'policy':<12} {'max/mean':>9} {'mean TTFT':>10} {'p50 TTFT':>9}")
    load1, _, _ = os.getloadavg()
    print(
        f"(all ranks share this machine's {os.cpu_count()} cores, load average {load1:.1f}: "
        "TTFT here reflects CPU contention more than routing)"
    )
    for policy, r in out.items():
        print(
            f"{policy:<12} {r['max_mean_ratio']:>9.3f} {r['mean_ttft_ms']:>8.1f}ms {r['p50_ttft_ms']:>7.1f}ms"
        )
    return out
