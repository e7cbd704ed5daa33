"""Traces (a "generate" root span with a "schedule" child) and prompt privacy in the logs."""

from __future__ import annotations

from pathlib import Path

import grpc
import structlog
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.gateway.server import build_app
from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from shared.tracing import configure_tracing

from .conftest import Cluster, gateway_settings
from .fakes import admitted, disaggregated, final, prefill_reply, tokens

STOP = common_pb2.FINISH_REASON_STOP


def script(c: Cluster, secret: str) -> None:
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), tokens(secret), final("", 1, STOP)])
    c.prefill.prefill_scripts.append(prefill_reply(secret, 1))


async def test_generate_span_with_schedule_child(cluster: Cluster) -> None:
    exporter = InMemorySpanExporter()
    configure_tracing("gateway", {}, exporter=exporter)
    script(cluster, "x")
    frames = [f async for f in cluster.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=30)]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    exporter.shutdown()  # the global provider keeps the processor; stop collecting
    generate, schedule = spans["generate"], spans["schedule"]
    assert schedule.parent is not None and schedule.parent.span_id == generate.context.span_id
    assert schedule.context.trace_id == generate.context.trace_id
    assert generate.attributes is not None
    assert generate.attributes["pdserve.request_id"] == frames[0].request_id
    assert generate.attributes["pdserve.completion_tokens"] == 2
    assert schedule.attributes is not None and schedule.attributes["pdserve.mode"] == "disaggregated"


async def test_prompt_and_completion_are_not_logged_by_default(cluster: Cluster) -> None:
    script(cluster, "SECRET-COMPLETION")
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await cluster.stub.Complete(gateway_pb2.GenerateRequest(prompt="SECRET-PROMPT"), timeout=30)
    dumped = repr(logs)
    assert "request_start" in dumped and "request_end" in dumped
    assert "SECRET" not in dumped
    ends = [e for e in logs if e["event"] == "request_end"]
    assert ends and ends[0]["request_id"] and ends[0]["completion_tokens"] == 2


async def test_log_prompts_opt_in(cluster: Cluster, tiny_model: Path) -> None:
    app = build_app(gateway_settings(tiny_model, cluster.scheduler.address, log_prompts=True))
    await app.start()
    try:
        script(cluster, "SECRET-COMPLETION")
        async with grpc.aio.insecure_channel(app.server.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with structlog.testing.capture_logs() as logs:
                await stub.Complete(gateway_pb2.GenerateRequest(prompt="SECRET-PROMPT"), timeout=30)
    finally:
        await app.stop(0)
    dumped = repr(logs)
    assert "SECRET-PROMPT" in dumped and "SECRET-COMPLETION" in dumped
