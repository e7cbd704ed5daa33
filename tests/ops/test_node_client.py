"""The Node example client (@grpc/grpc-js + @grpc/proto-loader, protos loaded at run time) against
a real gRPC server on 127.0.0.1:0 that implements pdserve.v1.Gateway with scripted frames."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.ops.node_client import node_client_missing, run_node_client

pytestmark = pytest.mark.skipif(node_client_missing() is not None, reason=str(node_client_missing()))

# The scripted stream: first token from prefill, continuations from decode, then the final frame.
PIECES = ["Hello", ", wor", "ld \u2713", " \U0001f680"]
FINAL_TEXT = "!"
STREAM_TEXT = "".join(PIECES) + FINAL_TEXT


def _usage(completion: int) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=11,
        completion_tokens=completion,
        cached_tokens=4,
        local_cached_tokens=1,
        transferred_cached_tokens=3,
        total_tokens=11 + completion,
    )


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(self) -> None:
        self.requests: list[tuple[str, gateway_pb2.GenerateRequest]] = []
        self.authorization: list[str | None] = []  # the metadata each call carried
        self.lock = threading.Lock()

    def _record(self, rpc: str, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.requests.append((rpc, request))
            self.authorization.append(dict(context.invocation_metadata()).get("authorization"))
        if request.prompt == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is bad")

    def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        self._record("Generate", request, context)
        common: dict[str, Any] = {
            "request_id": "req-1",
            "prompt_tokens": 11,
            "cached_tokens": 4,
            "model": "fake-model",
        }
        for i, piece in enumerate(PIECES):
            kind = gateway_pb2.FRAME_KIND_FIRST if i == 0 else gateway_pb2.FRAME_KIND_CONTINUATION
            yield gateway_pb2.GenerateResponse(text=piece, kind=kind, **common)
        yield gateway_pb2.GenerateResponse(
            text=FINAL_TEXT,
            kind=gateway_pb2.FRAME_KIND_FINAL,
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=_usage(request.max_tokens),
            **common,
        )

    def Complete(
        self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.CompleteResponse:
        self._record("Complete", request, context)
        return gateway_pb2.CompleteResponse(
            request_id="req-2",
            text="Hi there.",
            finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=_usage(3),
            model="fake-model",
        )


@pytest.fixture(scope="module")
def fake_gateway() -> Iterator[tuple[str, FakeGateway]]:
    servicer = FakeGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


def test_generate_streams_text_and_complete_returns_usage(fake_gateway: tuple[str, FakeGateway]) -> None:
    address, servicer = fake_gateway
    servicer.requests.clear()
    run = run_node_client(
        address, "--message", "Why is the sky blue?", "--max-tokens", "5", "--temperature", "0", "--seed", "7"
    )
    assert run.returncode == 0, run.stderr
    assert STREAM_TEXT in run.stdout
    assert "Hi there." in run.stdout

    gen = run.summary("Generate")
    assert gen["text"] == STREAM_TEXT
    assert gen["frames"] == len(PIECES) + 1
    assert gen["finish_reason"] == "FINISH_REASON_LENGTH"
    assert gen["request_id"] == "req-1"
    assert gen["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 5,
        "cached_tokens": 4,
        "local_cached_tokens": 1,
        "transferred_cached_tokens": 3,
        "total_tokens": 16,
    }
    comp = run.summary("Complete")
    assert comp["text"] == "Hi there."
    assert comp["finish_reason"] == "FINISH_REASON_STOP"
    assert comp["usage"]["completion_tokens"] == 3
    assert comp["usage"]["total_tokens"] == 14

    # What the client sent: one user chat message, the sampling fields set (optional presence).
    assert [rpc for rpc, _ in servicer.requests] == ["Generate", "Complete"]
    for _, req in servicer.requests:
        assert [(m.role, m.content) for m in req.messages] == [("user", "Why is the sky blue?")]
        assert req.prompt == ""
        assert req.HasField("max_tokens") and req.max_tokens == 5
        assert req.HasField("temperature") and req.temperature == 0.0
        assert req.HasField("seed") and req.seed == 7
        assert not req.HasField("top_p")


def test_raw_prompt_and_single_rpc(fake_gateway: tuple[str, FakeGateway]) -> None:
    address, servicer = fake_gateway
    servicer.requests.clear()
    run = run_node_client(address, "--prompt", "Once upon a time", "--rpc", "generate")
    assert run.returncode == 0, run.stderr
    assert [s["rpc"] for s in run.summaries] == ["Generate"]
    ((rpc, req),) = servicer.requests
    assert rpc == "Generate"
    assert req.prompt == "Once upon a time"
    assert len(req.messages) == 0
    assert not req.HasField("temperature")


def test_server_error_is_reported_with_status(fake_gateway: tuple[str, FakeGateway]) -> None:
    address, _ = fake_gateway
    run = run_node_client(address, "--prompt", "bad", "--rpc", "complete")
    assert run.returncode == 1
    assert "INVALID_ARGUMENT" in run.stderr
    assert "prompt is bad" in run.stderr
    assert run.summaries == []


def test_unreachable_gateway_fails_cleanly() -> None:
    run = run_node_client("127.0.0.1:1", "--rpc", "complete", "--timeout-s", "5")
    assert run.returncode == 1
    assert "UNAVAILABLE" in run.stderr or "DEADLINE_EXCEEDED" in run.stderr


def test_bad_arguments_exit_2() -> None:
    run = run_node_client("127.0.0.1:1", "--rpc", "nope")
    assert run.returncode == 2
    assert "--rpc must be" in run.stderr


def test_api_key_goes_in_the_authorization_metadata(fake_gateway: tuple[str, FakeGateway]) -> None:
    address, servicer = fake_gateway
    servicer.authorization.clear()
    run = run_node_client(address, "--prompt", "hi", "--api-key", "k-123")
    assert run.returncode == 0, run.stderr
    assert servicer.authorization == ["Bearer k-123", "Bearer k-123"]
    servicer.authorization.clear()
    assert run_node_client(address, "--prompt", "hi", "--rpc", "complete").returncode == 0
    assert servicer.authorization == [None]
