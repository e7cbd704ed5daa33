"""Load-monitor + scheduler + REAL workers (--dp-size 2, tiny model, CPU) over gRPC: each request
runs on exactly the worker and rank the scheduler chose (seen in that worker's own per-rank
loads), unified and disaggregated (through the real gateway), and load reports reach the
scheduler."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.gateway.server import GatewayApp, build_app
from services.gateway.settings import GatewaySettings
from services.load_monitor.server import build as build_load_monitor
from services.scheduler.server import build as build_scheduler
from services.scheduler.settings import Settings as SchedulerSettings
from services.worker.server import WorkerApp
from services.worker.settings import WorkerSettings
from shared.cluster import Role
from shared.metrics import PREFILL_MODE
from shared.proto import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.sched.conftest import load_monitor_settings
from tests.support.tiny_models import build_tiny_model

BLOCK_SIZE = 4


@pytest.fixture(scope="session")
def sched_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sched-models") / "tiny-bpe", "bpe")


@dataclass
class RealCluster:
    scheduler_address: str
    scheduler: scheduler_pb2_grpc.SchedulerStub
    workers: list[WorkerApp]

    async def wait_workers(self, n: int) -> None:
        for _ in range(500):
            state = await self.scheduler.GetState(scheduler_pb2.GetStateRequest(), timeout=5)
            if len(state.workers) == n:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("workers never reached the scheduler")


def real_worker(model: Path, role: str, load_monitor: str) -> WorkerApp:
    return WorkerApp(
        WorkerSettings(
            role=Role(role),
            listen="127.0.0.1:0",
            metrics_port=-1,
            model=str(model),
            device="cpu",
            dtype="float32",
            dp_size=2,
            block_size=BLOCK_SIZE,
            kv_cache_tokens=2048,
            max_model_len=512,
            torch_threads=1,
            drain_grace_s=0.0,
            load_monitor_address=load_monitor,
            heartbeat_interval_s=0.2,
            load_refresh_s=0.2,
        )
    )


@contextlib.asynccontextmanager
async def real_cluster(
    model: Path, roles: tuple[str, ...], **scheduler: object
) -> AsyncIterator[RealCluster]:
    lm = build_load_monitor(load_monitor_settings())
    await lm.start()
    sched = build_scheduler(
        SchedulerSettings(
            listen="127.0.0.1:0",
            metrics_port=-1,
            load_monitor_address=lm.server.address,
            prefill_policy="round_robin",
            dp_rank_policy="min_tokens",
            drain_grace_s=0.0,
            **scheduler,  # type: ignore[arg-type]
        )
    )
    await sched.start()
    workers = [real_worker(model, role, lm.server.address) for role in roles]
    channel = grpc.aio.insecure_channel(sched.server.address)
    try:
        for w in workers:
            await w.start()
        cluster = RealCluster(sched.server.address, scheduler_pb2_grpc.SchedulerStub(channel), workers)
        await cluster.wait_workers(len(workers))
        yield cluster
    finally:
        await channel.close()
        for w in workers:
            await w.stop()
        await sched.stop()
        await lm.stop()


def gateway_app(cluster: RealCluster, model: Path) -> GatewayApp:
    """A real gateway (not started) routing through the cluster's scheduler."""
    return build_app(
        GatewaySettings(
            listen="127.0.0.1:0",
            metrics_port=-1,
            scheduler_address=cluster.scheduler_address,
            model=str(model),
            block_size=BLOCK_SIZE,
            drain_grace_s=0.0,
        )
    )


async def busy_ranks(address: str) -> set[int]:
    """Ranks of the worker at `address` that hold or run a request, from its own GetLoad."""
    async with grpc.aio.insecure_channel(address) as ch:
        load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return {r.dp_rank for r in load.ranks if r.num_used_tokens > 0 or r.num_running or r.num_waiting}


def prompt(i: int, size: int) -> list[int]:
    return [5 + (i * 7 + k) % 200 for k in range(size)]


@pytest.mark.timeout(300)
async def test_unified_workers_run_requests_on_the_chosen_ranks(sched_tiny_model: Path) -> None:
    # every request aggregated (the unified split off), so each one runs on the rank chosen for it
    async with real_cluster(sched_tiny_model, ("unified", "unified"), unified_disaggregate_threshold=0) as c:
        by_id = {w.worker_id: w for w in c.workers}
        sizes = [120, 40, 40, 40]
        calls = []
        chosen = []
        channels = []
        for i, size in enumerate(sizes):
            d = await c.scheduler.Schedule(
                scheduler_pb2.ScheduleRequest(request_id=f"real-{i}", prompt_tokens=size, max_tokens=300),
                timeout=5,
            )
            assert d.mode == scheduler_pb2.SERVING_MODE_AGGREGATED
            assert d.decode.worker_id in by_id and d.decode.address == by_id[d.decode.worker_id].address
            chosen.append((d.decode.worker_id, d.decode.dp_rank))
            ch = grpc.aio.insecure_channel(d.decode.address)
            channels.append(ch)
            call = worker_pb2_grpc.WorkerStub(ch).Decode(
                worker_pb2.DecodeRequest(
                    request_id=f"real-{i}",
                    prompt_token_ids=prompt(i, size),
                    sampling=common_pb2.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True),
                    dp_rank=d.decode.dp_rank,
                    local_prefill=True,
                ),
                timeout=120,
            )
            await call.read()  # ADMITTED: the request holds KV blocks on its rank
            calls.append(call)
        # Four ranks, four requests: min_tokens put one on each.
        assert len(set(chosen)) == 4
        # While they run, each worker's own per-rank load shows exactly the chosen ranks busy.
        for wid, w in by_id.items():
            assert await busy_ranks(w.address) == {rank for (cw, rank) in chosen if cw == wid}
        # The load reports reach the scheduler: it sees tokens only on the chosen ranks.
        seen: set[tuple[str, int]] = set()
        for _ in range(100):
            state = await c.scheduler.GetState(scheduler_pb2.GetStateRequest(), timeout=5)
            seen = {
                (w.info.worker_id, r.dp_rank) for w in state.workers for r in w.ranks if r.num_used_tokens
            }
            if seen:
                break
            await asyncio.sleep(0.05)
        assert seen and seen <= set(chosen)
        for call in calls:
            while await call.read() is not grpc.aio.EOF:
                pass
            assert await call.code() == grpc.StatusCode.OK
        for ch in channels:
            await ch.close()


@pytest.mark.timeout(300)
async def test_disaggregated_through_the_gateway_uses_both_decode_ranks(sched_tiny_model: Path) -> None:
    """Gateway -> scheduler (min_tokens) -> prefill worker -> KV push -> decode worker, dp 2 each:
    two concurrent long generations occupy both decode ranks (a gateway or worker ignoring the
    chosen dp_rank would put both on rank 0)."""
    from shared.proto import gateway_pb2, gateway_pb2_grpc

    async with real_cluster(sched_tiny_model, ("prefill", "decode")) as c:
        decode = next(w for w in c.workers if w.settings.role is Role.DECODE)
        gateway = gateway_app(c, sched_tiny_model)
        await gateway.start()
        try:
            async with grpc.aio.insecure_channel(gateway.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                calls = [
                    stub.Generate(
                        gateway_pb2.GenerateRequest(
                            prompt_token_ids=prompt(i, 60), max_tokens=300, temperature=0, ignore_eos=True
                        ),
                        timeout=120,
                    )
                    for i in range(2)
                ]
                for call in calls:
                    await call.read()  # the first token: prefill done, decoding on its rank
                assert await busy_ranks(decode.address) == {0, 1}
                for call in calls:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                    assert await call.code() == grpc.StatusCode.OK
        finally:
            await gateway.stop(0)


@pytest.mark.timeout(300)
async def test_unified_workers_disaggregate_long_prompts_through_the_gateway(sched_tiny_model: Path) -> None:
    """Two unified workers, --unified-disaggregate-threshold 32: a 60-token prompt is prefilled on
    one unified worker and decoded on the other (its KV pushed between them), a 10-token prompt
    runs aggregated; both give transformers' greedy tokens."""
    from shared.proto import gateway_pb2, gateway_pb2_grpc
    from tests.support.reference import hf_greedy

    async with real_cluster(sched_tiny_model, ("unified", "unified"), unified_disaggregate_threshold=32) as c:
        long_d = await c.scheduler.Schedule(
            scheduler_pb2.ScheduleRequest(request_id="probe-long", prompt_tokens=60, max_tokens=1), timeout=5
        )
        assert long_d.mode == scheduler_pb2.SERVING_MODE_DISAGGREGATED
        assert long_d.prefill.worker_id != long_d.decode.worker_id
        assert {long_d.prefill.worker_id, long_d.decode.worker_id} == {w.worker_id for w in c.workers}
        short_d = await c.scheduler.Schedule(
            scheduler_pb2.ScheduleRequest(request_id="probe-short", prompt_tokens=10, max_tokens=1), timeout=5
        )
        assert short_d.mode == scheduler_pb2.SERVING_MODE_AGGREGATED
        gateway = gateway_app(c, sched_tiny_model)
        await gateway.start()
        modes_before = {m: PREFILL_MODE.labels(mode=m)._value.get() for m in ("disaggregated", "aggregated")}
        try:
            async with grpc.aio.insecure_channel(gateway.server.address) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                for size in (60, 10):
                    ids = prompt(size, size)
                    reply = await stub.Complete(
                        gateway_pb2.GenerateRequest(
                            prompt_token_ids=ids,
                            max_tokens=12,
                            temperature=0,
                            ignore_eos=True,
                            return_token_ids=True,
                        ),
                        timeout=120,
                    )
                    assert list(reply.token_ids) == hf_greedy(sched_tiny_model, ids, 12)[:12]
                    # the scheduler (in this process) chose each mode once more for the real request
                    mode = "disaggregated" if size == 60 else "aggregated"
                    assert PREFILL_MODE.labels(mode=mode)._value.get() == modes_before[mode] + 1
                    modes_before[mode] += 1
        finally:
            await gateway.stop(0)
