"""Load-monitor + scheduler + two REAL unified workers (--dp-size 2, tiny model, CPU) over gRPC:
each request runs on exactly the worker and rank the scheduler chose (seen in that worker's own
per-rank loads), and the load reports reach the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.load_monitor.server import build as build_load_monitor
from services.scheduler.server import build as build_scheduler
from services.scheduler.settings import Settings as SchedulerSettings
from services.worker.server import WorkerApp
from services.worker.settings import WorkerSettings
from shared.proto import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.sched.conftest import load_monitor_settings
from tests.support.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def sched_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sched-models") / "tiny-bpe", "bpe")


Cluster = tuple[scheduler_pb2_grpc.SchedulerStub, list[WorkerApp]]


@contextlib.asynccontextmanager
async def real_cluster(model: Path) -> AsyncIterator[Cluster]:
    lm = build_load_monitor(load_monitor_settings())
    await lm.start()
    sched = build_scheduler(
        SchedulerSettings(
            listen="127.0.0.1:0", metrics_port=-1, load_monitor_address=lm.server.address,
            prefill_policy="round_robin", dp_rank_policy="min_tokens", drain_grace_s=0.0,
        )
    )
    await sched.start()
    workers = [
        WorkerApp(
            WorkerSettings(
                role="unified", listen="127.0.0.1:0", metrics_port=-1, model=str(model),
                device="cpu", dtype="float32", dp_size=2, block_size=4, kv_cache_tokens=2048,
                max_model_len=512, torch_threads=1, drain_grace_s=0.0,
                load_monitor_address=lm.server.address, heartbeat_interval_s=0.2,
                load_refresh_s=0.2,
            )
        )
        for _ in range(2)
    ]
    channel = grpc.aio.insecure_channel(sched.server.address)
    try:
        for w in workers:
            await w.start()
        yield scheduler_pb2_grpc.SchedulerStub(channel), workers
    finally:
        await channel.close()
        for w in workers:
            await w.stop()
        await sched.stop()
        await lm.stop()


async def wait_workers(stub: scheduler_pb2_grpc.SchedulerStub, n: int) -> None:
    for _ in range(500):
        state = await stub.GetState(scheduler_pb2.GetStateRequest(), timeout=5)
        if len(state.workers) == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("workers never reached the scheduler")


@pytest.mark.timeout(300)
async def test_real_workers_run_requests_on_the_chosen_ranks(sched_tiny_model: Path) -> None:
    async with real_cluster(sched_tiny_model) as (stub, workers):
        await wait_workers(stub, 2)
        by_id = {w.worker_id: w for w in workers}
        sizes = [120, 40, 40, 40]  # min_tokens: 120 alone on one rank, the 40s spread elsewhere
        calls = []
        chosen = []
        channels = []
        for i, size in enumerate(sizes):
            d = await stub.Schedule(
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
                    prompt_token_ids=[5 + (i * 7 + k) % 200 for k in range(size)],
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
            async with grpc.aio.insecure_channel(w.address) as ch:
                load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            busy = {r.dp_rank for r in load.ranks if r.num_used_tokens > 0 or r.num_running or r.num_waiting}
            assert busy == {rank for (cw, rank) in chosen if cw == wid}
        # The load reports reach the scheduler: it sees tokens only on the chosen ranks.
        state = await stub.GetState(scheduler_pb2.GetStateRequest(), timeout=5)
        for _ in range(100):
            seen = {
                (w.info.worker_id, r.dp_rank) for w in state.workers for r in w.ranks if r.num_used_tokens
            }
            if seen:
                break
            await asyncio.sleep(0.05)
            state = await stub.GetState(scheduler_pb2.GetStateRequest(), timeout=5)
        assert seen and seen <= set(chosen)
        for call in calls:
            while await call.read() is not grpc.aio.EOF:
                pass
            assert await call.code() == grpc.StatusCode.OK
        for ch in channels:
            await ch.close()
