"""The gateway's reading of a peer's failure: the shared status mapping, made Retryable where
another worker may succeed."""

from __future__ import annotations

import grpc
import pytest

from services.gateway.clients import map_rpc_error
from services.gateway.ports import Retryable, WorkerLacksFeature, WorkerOutOfCapacity, WorkerUnavailable
from shared import errors


def rpc_error(code: grpc.StatusCode, details: str = "why") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "worker_id", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "d1", WorkerUnavailable),
        (grpc.StatusCode.UNAVAILABLE, "", WorkerUnavailable),  # the scheduler: retried too
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "d1", WorkerOutOfCapacity),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "", errors.ResourceExhausted),
        (grpc.StatusCode.NOT_FOUND, "d1", errors.FailedPrecondition),  # the worker lost the request
        (grpc.StatusCode.NOT_FOUND, "", errors.NotFound),
        (grpc.StatusCode.INVALID_ARGUMENT, "d1", errors.InvalidArgument),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "d1", errors.DeadlineExceeded),
        (grpc.StatusCode.INTERNAL, "d1", errors.PdserveError),
    ],
)
def test_peer_failures(code: grpc.StatusCode, worker_id: str, expected: type[Exception]) -> None:
    error = map_rpc_error(rpc_error(code), "decode worker d1 (h:1)", worker_id)
    assert type(error) is expected
    assert "decode worker d1 (h:1)" in str(error)
    if isinstance(error, Retryable):
        assert error.worker_id == worker_id  # the retry excludes this worker


def test_an_adapter_a_worker_just_dropped_is_retried_elsewhere() -> None:
    """During an unload a request of the adapter may reach a worker that has dropped it: the
    engine's NOT_FOUND for the request's adapter is a worker lacking a feature (retried on
    another worker), any other NOT_FOUND stays the worker having lost the request."""
    dropped = rpc_error(grpc.StatusCode.NOT_FOUND, "LoRA adapter 'sql' is not loaded on this worker")
    error = map_rpc_error(dropped, "prefill worker p1 (h:1)", "p1", "sql")
    assert type(error) is WorkerLacksFeature and error.worker_id == "p1"
    assert type(map_rpc_error(dropped, "prefill worker p1 (h:1)", "p1", "chat")) is errors.FailedPrecondition
    assert type(map_rpc_error(dropped, "prefill worker p1 (h:1)", "p1")) is errors.FailedPrecondition
