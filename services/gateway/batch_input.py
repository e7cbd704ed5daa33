"""A batch's input file, checked as OpenAI checks it before any request runs: each non-blank line a
JSON object with a `custom_id` (a string, unique in the file), `method` POST, the batch's
endpoint as `url` and an object `body` that does not ask to stream. Any error fails the batch
(status failed, the first MAX_ERRORS reported with their lines); the bodies themselves are
checked when each request runs, as the same HTTP request would be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.gateway.batches import LineError

MAX_ERRORS = 100  # line errors reported for one input file


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based line of the input file
    custom_id: str
    body: dict[str, Any]


def parse_input(data: bytes, endpoint: str, max_lines: int) -> tuple[list[BatchLine], list[LineError]]:
    """The requests of an input file, or the errors that fail it."""
    lines: list[BatchLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(lines) + len(errors) >= max_lines:
            errors.append(
                LineError(
                    "too_many_requests",
                    f"the input has more than {max_lines} requests, this server's limit "
                    "(--max-batch-lines); split the batch",
                    n,
                )
            )
            break
        try:
            parsed = _line(raw, n, endpoint)
        except _Bad as bad:
            errors.append(bad.error)
            if len(errors) >= MAX_ERRORS:
                break
            continue
        if parsed.custom_id in seen:
            errors.append(
                LineError(
                    "duplicate_custom_id",
                    f"custom_id {parsed.custom_id!r} is used by an earlier line; each must be unique",
                    n,
                    "custom_id",
                )
            )
        seen.add(parsed.custom_id)
        lines.append(parsed)
    if not lines and not errors:
        errors.append(LineError("empty_file", "the input file has no requests"))
    return lines, errors[:MAX_ERRORS]


class _Bad(Exception):
    def __init__(self, error: LineError) -> None:
        super().__init__(error.message)
        self.error = error


def _line(raw: bytes, n: int, endpoint: str) -> BatchLine:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _Bad(LineError("invalid_json_line", "this line is not JSON (UTF-8)", n)) from None
    if not isinstance(value, dict):
        raise _Bad(LineError("invalid_json_line", "this line is not a JSON object", n))
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _Bad(LineError("invalid_custom_id", "custom_id must be a non-empty string", n, "custom_id"))
    if value.get("method") != "POST":
        got = value.get("method")
        raise _Bad(LineError("invalid_method", f"method must be POST, got {got!r}", n, "method"))
    if value.get("url") != endpoint:
        raise _Bad(
            LineError(
                "mismatched_endpoint",
                f"url {value.get('url')!r} is not the batch's endpoint {endpoint!r}",
                n,
                "url",
            )
        )
    body = value.get("body")
    if not isinstance(body, dict):
        raise _Bad(LineError("invalid_body", "body must be a JSON object (the request)", n, "body"))
    if body.get("stream") not in (None, False):
        message = "a batch request cannot stream; remove stream"
        raise _Bad(LineError("invalid_body", message, n, "body.stream"))
    return BatchLine(n, custom_id, body)
