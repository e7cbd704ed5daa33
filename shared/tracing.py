"""OpenTelemetry setup: one tracer provider per process, exporter chosen by the standard OTEL_*
variables, and gRPC interceptors that propagate the trace context in metadata.

OTEL_TRACES_EXPORTER: "none" (default), "console" or "otlp" (OTLP/gRPC, OTEL_EXPORTER_OTLP_ENDPOINT).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)

_configured = False


def configure_tracing(
    service: str, otel: Mapping[str, str], exporter: SpanExporter | None = None
) -> TracerProvider:
    """Install the global tracer provider (once per process). `exporter` overrides OTEL_* (tests)."""
    global _configured
    current = trace.get_tracer_provider()
    if _configured and isinstance(current, TracerProvider):
        if exporter is not None:
            current.add_span_processor(SimpleSpanProcessor(exporter))
        return current
    name = otel.get("OTEL_SERVICE_NAME", f"pdserve-{service}")
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        kind = otel.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
        if kind == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif kind == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True
    return provider


def tracer() -> trace.Tracer:
    return trace.get_tracer("pdserve")


def server_interceptors() -> list[Any]:
    """grpc.aio server interceptors that continue the caller's trace."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


def client_interceptors() -> list[Any]:
    """grpc.aio client interceptors that inject the current trace context into metadata."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())
