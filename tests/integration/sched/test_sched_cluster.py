"""Load-monitor + scheduler over real gRPC with fake workers (dp_size 2) registering."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc
import pytest

from services.load_monitor.server import build as build_load_monitor
from shared.proto import common_pb2, load_monitor_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.sched.conftest import LOAD_INTERVAL_S, Cluster, load_monitor_settings
from tests.integration.sched.fakes import layout


async def schedule(
    c: Cluster, request_id: str, prompt_tokens: int, **kw: Any
) -> scheduler_pb2.ScheduleResponse:
    request = scheduler_pb2.ScheduleRequest(
        request_id=request_id, prompt_tokens=prompt_tokens, max_tokens=16, **kw
    )
    return await c.scheduler_stub.Schedule(request, timeout=5)


async def send_decode(address: str, request_id: str, dp_rank: int, prompt_tokens: int) -> None:
    """What the gateway does with an AGGREGATED decision: Decode on the chosen worker and rank."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(
                request_id=request_id,
                prompt_token_ids=[1] * prompt_tokens,
                dp_rank=dp_rank,
                local_prefill=True,
            ),
            timeout=5,
        )
        async for _ in call:
            pass


def used(state: scheduler_pb2.GetStateResponse) -> dict[tuple[str, int], int]:
    return {(w.info.worker_id, r.dp_rank): r.num_used_tokens for w in state.workers for r in w.ranks}


async def test_requests_land_on_the_ranks_the_policy_chose(cluster: Cluster) -> None:
    w1 = await cluster.add_worker()
    w2 = await cluster.add_worker()
    await cluster.wait_workers(2)
    by_address = {w1.address: w1, w2.address: w2}
    chosen: Counter[tuple[str, int]] = Counter()
    sizes = [1000, 200, 300, 400, 900, 100, 600, 500]
    for i, size in enumerate(sizes):
        d = await schedule(cluster, f"r{i}", size)
        assert d.mode == scheduler_pb2.SERVING_MODE_AGGREGATED
        assert d.model == "tiny" and d.max_model_len == 4096
        assert not d.HasField("prefill")
        await send_decode(d.decode.address, f"r{i}", d.decode.dp_rank, size)
        chosen[(d.decode.worker_id, d.decode.dp_rank)] += size
    # The workers hold the tokens exactly where the scheduler sent them...
    for w in (w1, w2):
        for rank in range(2):
            assert w.used_tokens[rank] == chosen[(w.worker_id, rank)]
    assert set(by_address) == {w1.address, w2.address}
    # ...all four ranks got work, and min_tokens kept them close (greedy: within one request).
    assert len(chosen) == 4
    assert max(chosen.values()) - min(chosen.values()) <= max(sizes)
    # The next load reports show the same per-rank tokens, and replace the reservations.
    state = await cluster.wait_state(
        lambda s: used(s) == dict(chosen) and all(sum(w.reserved_tokens) == 0 for w in s.workers)
    )
    assert not state.stale
    assert state.dp_rank_policy == "min_tokens"


async def test_burst_between_reports_spreads_across_ranks(cluster: Cluster) -> None:
    await cluster.add_worker()
    await cluster.add_worker()
    await cluster.wait_workers(2)
    replies = await asyncio.gather(*(schedule(cluster, f"b{i}", 256) for i in range(40)))
    spread = Counter((d.decode.worker_id, d.decode.dp_rank) for d in replies)
    assert len(spread) == 4 and set(spread.values()) == {10}


async def test_removed_worker_vanishes_from_routing_within_one_interval(cluster: Cluster) -> None:
    w1 = await cluster.add_worker()
    w2 = await cluster.add_worker()
    await cluster.wait_workers(2)
    loop = asyncio.get_running_loop()
    await w2.deregister()
    removed_at = loop.time()
    await cluster.wait_state(lambda s: [w.info.worker_id for w in s.workers] == [w1.worker_id])
    assert loop.time() - removed_at < LOAD_INTERVAL_S * 5  # generous: 2 shared cores
    for i in range(10):
        assert (await schedule(cluster, f"after{i}", 10)).decode.worker_id == w1.worker_id


async def test_expired_lease_vanishes_and_returns_clean(cluster: Cluster) -> None:
    w1 = await cluster.add_worker()
    w2 = await cluster.add_worker()
    await cluster.wait_workers(2)
    await send_decode(w2.address, "held", 0, 700)
    await cluster.wait_state(lambda s: (w2.worker_id, 0) in used(s) and used(s)[(w2.worker_id, 0)] == 700)
    await w2.stop_heartbeats()  # hangs: lease_ttl_s=3 runs out
    await cluster.wait_state(lambda s: [w.info.worker_id for w in s.workers] == [w1.worker_id])
    snap = await cluster.load_monitor_stub.GetLoads(load_monitor_pb2.GetLoadsRequest(), timeout=5)
    assert [w.info.worker_id for w in snap.workers] == [w1.worker_id]


async def test_incompatible_workers_are_unavailable(cluster: Cluster) -> None:
    await cluster.add_worker(role=common_pb2.WORKER_ROLE_PREFILL, kv_layout=layout("bfloat16"))
    await cluster.add_worker(role=common_pb2.WORKER_ROLE_DECODE, kv_layout=layout("float32"))
    await cluster.wait_workers(2)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await schedule(cluster, "x", 100)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no compatible prefill/decode pair" in (err.value.details() or "")
    assert "bfloat16" in (err.value.details() or "")
    # A compatible prefill worker joins: disaggregated from then on, paired by layout.
    ok = await cluster.add_worker(role=common_pb2.WORKER_ROLE_PREFILL, kv_layout=layout("float32"))
    await cluster.wait_workers(3)
    d = await schedule(cluster, "y", 100)
    assert d.mode == scheduler_pb2.SERVING_MODE_DISAGGREGATED
    assert d.prefill.worker_id == ok.worker_id


async def test_no_workers_is_unavailable(cluster: Cluster) -> None:
    await cluster.wait_state(lambda s: True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await schedule(cluster, "x", 100)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no workers" in (err.value.details() or "") or "snapshot" in (err.value.details() or "")


async def test_disaggregated_pairs_and_excludes(cluster: Cluster) -> None:
    p1 = await cluster.add_worker(role=common_pb2.WORKER_ROLE_PREFILL)
    p2 = await cluster.add_worker(role=common_pb2.WORKER_ROLE_PREFILL)
    d1 = await cluster.add_worker(role=common_pb2.WORKER_ROLE_DECODE)
    await cluster.wait_workers(3)
    d = await schedule(cluster, "r", 100, exclude_worker_ids=[p1.worker_id])
    assert d.mode == scheduler_pb2.SERVING_MODE_DISAGGREGATED
    assert (d.prefill.worker_id, d.decode.worker_id) == (p2.worker_id, d1.worker_id)
    assert d.prefill.address == p2.address and list(d.decode.capabilities) == ["generated_tokens"]


async def test_scheduler_survives_load_monitor_restart(cluster: Cluster) -> None:
    w1 = await cluster.add_worker()
    await cluster.wait_workers(1)
    address = cluster.load_monitor.server.address
    await cluster.load_monitor.stop()
    state = await cluster.wait_state(lambda s: s.stale)
    assert [w.info.worker_id for w in state.workers] == [w1.worker_id]
    # Routing continues on the last snapshot.
    d = await schedule(cluster, "during-outage", 100)
    assert d.decode.worker_id == w1.worker_id
    # A new load-monitor on the same address: the worker re-registers, the scheduler reconnects.
    cluster.load_monitor = build_load_monitor(load_monitor_settings(listen=address))
    await cluster.load_monitor.start()
    state = await cluster.wait_state(lambda s: not s.stale and len(s.workers) == 1)
    assert state.workers[0].info.worker_id == w1.worker_id
