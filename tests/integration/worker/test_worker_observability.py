"""Worker traces and metrics over real servers: one trace across the caller, prefill, KV push
and decode; KV transfer bytes and per-rank gauges that add up."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from shared.channels import make_channel
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.tracing import configure_tracing, tracer

from .harness import RunningWorker, collect, running_worker, sampling, worker_settings
from .test_worker_grpc import ADMITTED, disaggregated, prompt_ids


def _attr(span: Any, key: str) -> Any:
    """One attribute of a finished span (the SDK types them as a union of every attribute type)."""
    return dict(span.attributes or {})[key]


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    configure_tracing("worker-tests", {}, exporter=exporter)
    return exporter


@pytest.fixture
async def pair(tiny_model: Path) -> AsyncIterator[tuple[RunningWorker, RunningWorker]]:
    async with (
        running_worker(worker_settings(tiny_model, "prefill")) as p,
        running_worker(worker_settings(tiny_model, "decode")) as d,
    ):
        yield p, d


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_one_trace_across_prefill_push_and_decode(
    spans: InMemorySpanExporter, pair: tuple[RunningWorker, RunningWorker], tiny_model: Path
) -> None:
    prefill, decode = pair
    ids = prompt_ids(tiny_model)
    spans.clear()
    # Channels that propagate the trace context, as the gateway's do.
    p_channel, d_channel = make_channel(prefill.address), make_channel(decode.address)
    try:
        p_stub, d_stub = worker_pb2_grpc.WorkerStub(p_channel), worker_pb2_grpc.WorkerStub(d_channel)
        with tracer().start_as_current_span("gateway-request") as root:
            stream = d_stub.Decode(
                worker_pb2.DecodeRequest(request_id="t1", prompt_token_ids=ids, sampling=sampling(6))
            )
            admitted = await stream.read()
            assert admitted.kind == ADMITTED
            await p_stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="t1",
                    prompt_token_ids=ids,
                    sampling=sampling(6),
                    kv_target=worker_pb2.KvTarget(
                        address=decode.address, transfer_ticket=admitted.transfer_ticket
                    ),
                )
            )
            await collect(stream)
        trace_id = root.get_span_context().trace_id
    finally:
        await p_channel.close()
        await d_channel.close()
    finished = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    by_name = {s.name: s for s in finished}
    for name in ("prefill", "kv_transfer", "decode"):
        assert name in by_name, sorted(by_name)
    prefill_span, push_span, decode_span = (by_name["prefill"], by_name["kv_transfer"], by_name["decode"])
    assert push_span.parent is not None
    assert push_span.parent.span_id == prefill_span.context.span_id
    assert _attr(prefill_span, "pdserve.num_chunks") >= 1
    assert _attr(push_span, "pdserve.bytes") > 0
    assert _attr(decode_span, "pdserve.tokens") == 5
    # The decode worker's PushKv server span continues the same trace under kv_transfer.
    push_server = [s for s in finished if s.name.endswith("/PushKv") and s.kind.name == "SERVER"]
    assert push_server


async def test_kv_transfer_and_load_metrics_add_up(
    pair: tuple[RunningWorker, RunningWorker], tiny_model: Path
) -> None:
    prefill, decode = pair
    ids = prompt_ids(tiny_model)
    sent0 = sample("pdserve_kv_transfer_bytes_total", direction="sent")
    received0 = sample("pdserve_kv_transfer_bytes_total", direction="received")
    pushes0 = sample("pdserve_kv_transfer_seconds_count")
    queries0 = sample("pdserve_prefix_cache_queries_tokens_total")
    reply, _frames = await disaggregated(prefill, decode, "m1", ids, 4)
    assert sample("pdserve_kv_transfer_bytes_total", direction="sent") - sent0 == (reply.kv_bytes_sent)
    assert sample("pdserve_kv_transfer_bytes_total", direction="received") - received0 == (
        reply.kv_bytes_sent
    )
    assert sample("pdserve_kv_transfer_seconds_count") - pushes0 == 1
    # Both workers looked the prompt up once each.
    assert sample("pdserve_prefix_cache_queries_tokens_total") - queries0 == 2 * len(ids)
    await prefill.stub.GetLoad(worker_pb2.GetLoadRequest())  # refreshes the gauges
    usage = sample("pdserve_kv_cache_usage_ratio", dp_rank="0")
    assert 0.0 <= usage <= 1.0
    assert sample("pdserve_rank_running_requests", dp_rank="0") >= 0
    # The prefill backlog an autoscaler scales on: published, and empty once the request is done.
    assert REGISTRY.get_sample_value("pdserve_rank_waiting_prompt_tokens", {"dp_rank": "0"}) == 0.0
    # No READ timed out: nothing held back from the pool.
    assert REGISTRY.get_sample_value("pdserve_kv_quarantined_blocks", {"dp_rank": "0"}) == 0.0
