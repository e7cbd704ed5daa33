"""HTTP errors of the OpenAI face: the status, OpenAI error body and headers for every failure.
Domain errors go through the gRPC face's own status mapping (`shared.grpc_errors.status_for`), and
field errors name their field the same way on both faces (`validation.InvalidField`: gRPC details,
OpenAI's error.param), so a failure is one decision answered in each face's terms. `Refusal` ends
a request before it reaches the domain (auth, body checks)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from fastapi.responses import JSONResponse

from services.gateway import http_models as m
from shared.auth import UNAUTHENTICATED_MESSAGE
from shared.grpc_errors import GENERIC_INTERNAL_MESSAGE, status_for

REQUEST_ID_HEADER = "X-Request-Id"

# gRPC status (what the domain error maps to, shared.grpc_errors) -> HTTP status, OpenAI error type
HTTP_BY_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
RETRY_AFTER_S = 1  # Retry-After on 429 and 503 (s): capacity frees as requests finish


@dataclass(frozen=True)
class HttpError:
    status: int
    body: m.ErrorResponse
    headers: dict[str, str]
    grpc_code: grpc.StatusCode

    @property
    def is_internal(self) -> bool:
        return self.status >= 500 and self.grpc_code not in HTTP_BY_STATUS


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> m.ErrorResponse:
    return m.ErrorResponse(error=m.ErrorDetail(message=message, type=type_, param=param, code=code))


def http_error(
    exc: BaseException, statuses: Mapping[grpc.StatusCode, tuple[int, str]] | None = None
) -> HttpError:
    """The HTTP status, OpenAI error body and headers for an exception (unknown ones: 500 with a
    generic message; the caller logs the details). `statuses`: a route's own HTTP status and
    error type for some codes, besides HTTP_BY_STATUS."""
    code, message = status_for(exc)
    status, type_ = (statuses or {}).get(code) or HTTP_BY_STATUS.get(code, (500, "internal_error"))
    if status == 500:
        message = GENERIC_INTERNAL_MESSAGE
    # An error that knows when to come back (admission's Overloaded) says so; whole seconds, >= 1.
    retry_after_s = getattr(exc, "retry_after_s", None) or RETRY_AFTER_S
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if status in (429, 503) else {}
    param = getattr(exc, "param", None)
    error_code = code.name.lower()
    if param is None and code == grpc.StatusCode.NOT_FOUND and "model" in message:
        param = "model"
        error_code = "model_not_found"  # OpenAI's code for a model (or adapter) not served
    return HttpError(status, error_body(message, type_, param, error_code), headers, code)


class Refusal(Exception):
    """Ends a request early with an HTTP error (auth, body checks)."""

    def __init__(self, error: HttpError) -> None:
        super().__init__(error.body.error.message)
        self.error = error


def unauthenticated() -> Refusal:
    """401 for a call without an accepted API key (the message never echoes what was sent)."""
    body = error_body(UNAUTHENTICATED_MESSAGE, "authentication_error", code="invalid_api_key")
    return Refusal(HttpError(401, body, {"WWW-Authenticate": "Bearer"}, grpc.StatusCode.UNAUTHENTICATED))


def refusal(status: int, message: str, type_: str, param: str | None = None) -> Refusal:
    return Refusal(HttpError(status, error_body(message, type_, param), {}, grpc.StatusCode.UNKNOWN))


def error_response(error: HttpError, request_id: str | None = None) -> JSONResponse:
    headers = dict(error.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=headers)
