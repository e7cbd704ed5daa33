"""What the gateway's stored-object routes share (the Files, Batch and stored Responses APIs):
failures as OpenAI error responses, dict answers as JSON, OpenAI's cursor pages, and the owner
of what a caller stores (a hash of its API key)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from services.gateway import observe
from services.gateway.http_errors import Refusal, error_response, http_error, unauthenticated
from services.gateway.validation import InvalidField
from shared.auth import AUTH_HEADER, ApiKeys, bearer_token

log = structlog.get_logger(__name__)

Answered = dict[str, Any] | Response  # a route's JSON body, or its whole response
Route = Callable[..., Awaitable[Answered]]
Statuses = dict[grpc.StatusCode, tuple[int, str]]


def answered(statuses: Statuses | None = None) -> Callable[[Route], Route]:
    """A route's failures as OpenAI error responses (`statuses`: its own HTTP status for some
    codes), its dict answers as JSON."""

    def wrap(route: Route) -> Route:
        @functools.wraps(route)
        async def answer(*args: Any, **kwargs: Any) -> Response:
            try:
                result = await route(*args, **kwargs)
            except Exception as exc:
                return fail(exc, statuses)
            return result if isinstance(result, Response) else JSONResponse(result)

        return answer

    return wrap


def page(data: list[dict[str, Any]], request: Request, default_limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the items after `after` (an id), at most `limit`."""
    after = request.query_params.get("after")
    if after:
        ids = [d["id"] for d in data]
        data = data[ids.index(after) + 1 :] if after in ids else []
    limit_text = request.query_params.get("limit", "")
    limit = int(limit_text) if limit_text.isdigit() and int(limit_text) > 0 else default_limit
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }


def items_page(items: Sequence[dict[str, Any]], request: Request) -> dict[str, Any]:
    """A page of items (a response's input, a conversation's) in `order`: desc (OpenAI's
    default: the newest first) or asc; 20 by default."""
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidField(f"order must be asc or desc, got {order!r}", "order")
    ordered = list(items)
    if order == "desc":
        ordered.reverse()
    return page(ordered, request, default_limit=20)


def fail(exc: BaseException, statuses: Statuses | None = None) -> Response:
    error = exc.error if isinstance(exc, Refusal) else http_error(exc, statuses)
    observe.record_error(error.grpc_code.name)
    if error.is_internal:
        log.error("unhandled_error", exc_info=exc)
    return error_response(error)


def owner(keys: ApiKeys, request: Request) -> str:
    """Who owns what this caller stores: a hash of its API key ("" with keys off: one owner).
    UNAUTHENTICATED without a key the gateway accepts."""
    authorization = request.headers.get(AUTH_HEADER)
    if not keys.accepts(authorization):
        raise unauthenticated()
    token = bearer_token(authorization) if keys.enabled else None
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


MAX_METADATA = 16  # OpenAI's limits on an object's metadata: pairs, key and value characters
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def metadata(given: dict[str, str] | None) -> dict[str, str]:
    """An object's metadata (a batch's, a conversation's) within OpenAI's limits, else a 400."""
    pairs = given or {}
    if len(pairs) > MAX_METADATA or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in pairs.items()
    ):
        raise InvalidField(
            f"metadata holds at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} and "
            f"values of at most {MAX_METADATA_VALUE} characters",
            "metadata",
        )
    return pairs
