"""Reading an OpenAI HTTP request before it is converted: the request id header, and the body as
a pydantic model: JSON only, at most --http-max-body-bytes (413 past it), pydantic's first problem
as one sentence naming the field (400, `validation.InvalidField`)."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from services.gateway.http_errors import REQUEST_ID_HEADER, Refusal, refusal
from services.gateway.inputs import new_request_id
from services.gateway.validation import InvalidField, validate_request_id
from shared.errors import InvalidArgument

M = TypeVar("M", bound=BaseModel)

_JSON_TYPES = ("application/json",)


async def read_json(request: Request, model: type[M], limit: int) -> M:
    """The body as `model`: JSON only, at most max_body_bytes, every problem a 4xx."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type and content_type not in _JSON_TYPES and not content_type.endswith("+json"):
        raise refusal(
            415,
            f"the body must be JSON (Content-Type: application/json), got Content-Type {content_type!r}; "
            "with curl add -H 'Content-Type: application/json'",
            "invalid_request_error",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise InvalidField("the request body is empty; send a JSON object", None)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _too_large(size: int, limit: int) -> Refusal:
    return refusal(
        413,
        f"the request body is {size} bytes or more; the limit is {limit} bytes (--http-max-body-bytes)",
        "invalid_request_error",
    )


def _validation_error(exc: ValidationError) -> InvalidField:
    """The first problem pydantic found, as a sentence naming the field."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return InvalidField(f"the body is not valid JSON: {err['msg']}", None)
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "list[", "str", "int"))]
    where = ".".join(loc) or "the body"
    if err["type"] == "model_type" and not loc:
        return InvalidField("the body must be a JSON object", None)
    message = f"{where}: {err['msg']}"
    if err["type"] == "missing":
        message = f"{where} is required"
    return InvalidField(message, loc[0] if loc else None)


def read_request_id(request: Request) -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if given:
        try:
            validate_request_id(given)
        except InvalidArgument as exc:
            raise InvalidField(f"{REQUEST_ID_HEADER}: {exc}", None) from None
        return given
    return new_request_id()
