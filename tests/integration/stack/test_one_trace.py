"""One trace per request across every hop, over real in-process servers of all five services:
gateway -> scheduler -> prefill worker -> KV push -> decode worker, with an in-memory exporter."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.proto import gateway_pb2, gateway_pb2_grpc
from shared.tracing import configure_tracing
from tests.support.inproc import five_services
from tests.support.tiny_models import build_tiny_model


def _attr(span: Any, key: str) -> Any:
    """One attribute of a finished span (the SDK types them as a union of every attribute type)."""
    return dict(span.attributes or {})[key]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("stack-tests", {}, exporter=exp)  # before any server is built
    return exp


def _ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    parent = span.parent
    while parent is not None and parent.span_id in by_id:
        names.append(by_id[parent.span_id].name)
        parent = by_id[parent.span_id].parent
    return names


async def test_one_trace_with_every_hop_in_parent_order(
    exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    async with five_services(model) as stack:
        gateway = stack.gateway
        exporter.clear()
        async with grpc.aio.insecure_channel(gateway.server.address) as ch:
            req = gateway_pb2.GenerateRequest(
                prompt="Tracing every hop " * 3, max_tokens=6, temperature=0, ignore_eos=True
            )
            frames = [f async for f in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)]
    assert frames[-1].usage.completion_tokens == 6
    for _ in range(100):  # client spans of streams end when the call is closed, just after the reply
        spans = exporter.get_finished_spans()
        (root,) = [s for s in spans if s.name == "generate"]
        trace_id = root.context.trace_id
        mine = [s for s in spans if s.context.trace_id == trace_id]
        by_id = {s.context.span_id: s for s in mine}
        if all(s.parent is None or s.parent.span_id in by_id for s in mine if s is not by_id.get(0)):
            break
        await asyncio.sleep(0.05)
    assert [s.name for s in mine if s.parent is None] == ["/pdserve.v1.Gateway/Generate"], (
        "one root per request"
    )

    names = {s.name for s in mine}
    for expected in (
        "schedule",
        "prefill",
        "kv_transfer",
        "decode",
        "/pdserve.v1.Scheduler/Schedule",
        "/pdserve.v1.Worker/Prefill",
        "/pdserve.v1.Worker/PushKv",
        "/pdserve.v1.Worker/Decode",
    ):
        assert expected in names, f"{expected} missing from the request's trace: {sorted(names)}"
    span = {n: next(s for s in mine if s.name == n) for n in names}
    assert _ancestors(span["schedule"], by_id)[:1] == ["generate"]
    assert _ancestors(root, by_id) == ["/pdserve.v1.Gateway/Generate"]  # the server span of the call
    assert "schedule" in _ancestors(span["/pdserve.v1.Scheduler/Schedule"], by_id)
    assert "prefill" in _ancestors(span["kv_transfer"], by_id)
    assert "kv_transfer" in _ancestors(span["/pdserve.v1.Worker/PushKv"], by_id)
    for name in ("prefill", "decode"):
        assert "generate" in _ancestors(span[name], by_id)
    assert _attr(span["prefill"], "pdserve.num_chunks") >= 1
    assert _attr(span["kv_transfer"], "pdserve.bytes") > 0
    assert _attr(span["decode"], "pdserve.tokens") == 5  # 6 generated, the first one by prefill
