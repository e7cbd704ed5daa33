"""Internal RPCs need the cluster token, and a registration is admitted only when the worker at
its address confirms the identity (a real in-process stack started with --cluster-token)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.cluster_auth import TOKEN_HEADER
from shared.cluster_convert import worker_info_to_pb
from shared.proto import (
    gateway_pb2,
    gateway_pb2_grpc,
    load_monitor_pb2,
    load_monitor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.support.inproc import five_services
from tests.support.tiny_models import build_tiny_model

TOKEN = "cluster-secret-0123"
GOOD = ((TOKEN_HEADER, TOKEN),)


async def test_internal_rpcs_need_the_token_and_fabricated_workers_are_refused(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    async with five_services(model, common_overrides={"cluster_token": TOKEN}) as stack:
        lm_ch = grpc.aio.insecure_channel(stack.load_monitor.server.address)
        sched_ch = grpc.aio.insecure_channel(stack.scheduler.server.address)
        worker_ch = grpc.aio.insecure_channel(stack.workers[1].address)
        gw_ch = grpc.aio.insecure_channel(stack.gateway.server.address)
        try:
            lm = load_monitor_pb2_grpc.LoadMonitorStub(lm_ch)
            real = stack.workers[1].core
            assert real is not None
            # 1. Without the token (or with a wrong one), every internal service refuses.
            fake = worker_info_to_pb(dataclasses.replace(real.identity, worker_id="fake", max_model_len=16))
            for metadata in (None, ((TOKEN_HEADER, "wrong"),)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await lm.Register(load_monitor_pb2.RegisterRequest(worker=fake), metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "cluster token" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await scheduler_pb2_grpc.SchedulerStub(sched_ch).Schedule(
                    scheduler_pb2.ScheduleRequest(request_id="x", prompt_tokens=3)
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in worker_pb2_grpc.WorkerStub(worker_ch).Decode(
                    worker_pb2.DecodeRequest(request_id="x", prompt_token_ids=[1, 2])
                ):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Health stays open (probes carry no token).
            health = await health_pb2_grpc.HealthStub(lm_ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING

            # 2. With the token, a fabricated identity is still refused: the worker at that
            # address says who it is (here: another id and max_model_len), or nothing answers.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await lm.Register(load_monitor_pb2.RegisterRequest(worker=fake), metadata=GOOD)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "max_model_len" in (info.value.details() or "")
            ghost = dataclasses.replace(real.identity, worker_id="ghost", address="127.0.0.1:9")
            nowhere = worker_info_to_pb(ghost)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await lm.Register(load_monitor_pb2.RegisterRequest(worker=nowhere), metadata=GOOD)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            state = await scheduler_pb2_grpc.SchedulerStub(sched_ch).GetState(
                scheduler_pb2.GetStateRequest(), metadata=GOOD
            )
            assert sorted(w.info.worker_id for w in state.workers) == sorted(
                w.worker_id for w in stack.workers
            )

            # 3. The cluster itself works with the token on every hop.
            reply = await gateway_pb2_grpc.GatewayStub(gw_ch).Complete(
                gateway_pb2.GenerateRequest(prompt="with a token", max_tokens=4, ignore_eos=True),
                timeout=30,
            )
            assert reply.usage.completion_tokens == 4
        finally:
            for ch in (lm_ch, sched_ch, worker_ch, gw_ch):
                await ch.close()
