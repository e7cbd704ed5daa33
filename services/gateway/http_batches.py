"""OpenAI's Files and Batch APIs on the gateway's HTTP face (`client.files.*`, `client.batches.*`):
POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content, POST/GET /v1/batches,
GET /v1/batches/{id}, POST /v1/batches/{id}/cancel. Routes convert and call the stores
(batch_files, batches) and the runner (batch_runner), which answers each request of a batch through
this same HTTP app in process (`InProcessAnswer`).

Files and batches belong to the API key that made them (a hash of it; one owner with keys off):
another key sees none of them. Without --batch-dir every route answers 404 saying how to turn
the API on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

from services.gateway import http_models as m
from services.gateway.batch_files import FileStore, expires_after, new_file_id, too_large
from services.gateway.batch_runner import BatchRunner, RunnerSettings
from services.gateway.batches import (
    COMPLETION_WINDOW_S,
    BatchRecord,
    BatchStatus,
    BatchStore,
    new_batch_id,
)
from services.gateway.http_body import read_json
from services.gateway.http_errors import (
    REQUEST_ID_HEADER,
)
from services.gateway.http_routes import Answered, answered, metadata, owner, page
from services.gateway.validation import InvalidField
from shared.auth import AUTH_HEADER, ApiKeys
from shared.errors import FailedPrecondition, NotFound

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # what a batch may run
_FORM_SLACK = 64 * 1024  # multipart framing around an upload (bytes)
# a cancel of a batch already over, a delete of a file a running batch uses: the caller's mistake
_STATE_STATUSES = {grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error")}


class CreateBatchRequest(m._Request):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    # {"anchor": "created_at", "seconds": N}: the output and error files' lifetime
    output_expires_after: dict[str, Any] | None = None


class InProcessAnswer:
    """A batch request answered by the gateway's own HTTP app (no socket): the same checks,
    conversion, admission, metrics and errors as the request sent over HTTP."""

    def __init__(self, app: FastAPI, authorization: str) -> None:
        transport = httpx.ASGITransport(app=app)
        self._client = httpx.AsyncClient(transport=transport, base_url="http://batch.gateway", timeout=None)
        self._authorization = authorization

    async def __call__(
        self, endpoint: str, body: dict[str, Any], request_id: str
    ) -> tuple[int, dict[str, Any]]:
        headers = {AUTH_HEADER: self._authorization, REQUEST_ID_HEADER: request_id}
        answer = await self._client.post(endpoint, json=body, headers=headers)
        try:
            payload = answer.json()
        except ValueError:
            payload = {"error": {"message": answer.text[:200], "type": "internal_error"}}
        return answer.status_code, payload

    async def close(self) -> None:
        await self._client.aclose()


class BatchApi:
    """The routes, the stores under `folder` ('' = off) and the runner."""

    def __init__(
        self,
        app: FastAPI,
        keys: ApiKeys,
        inner_authorization: str,
        folder: str,
        runner_settings: RunnerSettings,
        max_file_bytes: int,
        max_body_bytes: int,
    ) -> None:
        self._keys = keys
        self._max_file_bytes = max_file_bytes
        self._max_body_bytes = max_body_bytes
        self._answer = InProcessAnswer(app, inner_authorization)
        self._files: FileStore | None = None
        self._batches: BatchStore | None = None
        self._runner: BatchRunner | None = None
        if folder:
            root = Path(folder).expanduser()
            self._files, self._batches = FileStore(root), BatchStore(root)
            self._runner = BatchRunner(self._files, self._batches, self._answer, runner_settings)
        for path, route, method in (
            ("/v1/files", self.upload, "POST"),
            ("/v1/files", self.list_files, "GET"),
            ("/v1/files/{file_id}", self.file, "GET"),
            ("/v1/files/{file_id}", self.delete_file, "DELETE"),
            ("/v1/files/{file_id}/content", self.content, "GET"),
            ("/v1/batches", self.create, "POST"),
            ("/v1/batches", self.list_batches, "GET"),
            ("/v1/batches/{batch_id}", self.batch, "GET"),
            ("/v1/batches/{batch_id}/cancel", self.cancel, "POST"),
        ):
            app.add_api_route(path, route, methods=[method], response_model=None)

    def start(self) -> None:
        if self._runner is not None:
            self._runner.start()

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: no new batch request; those in flight get `grace_s` to finish."""
        if self._runner is not None:
            await self._runner.drain(grace_s)
        await self._answer.close()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.close()
        await self._answer.close()

    # --- files ---
    @answered()
    async def upload(self, request: Request) -> Answered:
        c = self._open(request)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_file_bytes + _FORM_SLACK:
            raise InvalidField(too_large(self._max_file_bytes), "file")
        async with _form(request) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise InvalidField("send the file as the multipart/form-data field 'file'", "file")
            if not isinstance(purpose, str):
                raise InvalidField("purpose is required: 'batch'", "purpose")
            name = upload.filename or "upload.jsonl"
            anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
            lifetime_s = expires_after(anchor, seconds, "expires_after")
            record = await asyncio.to_thread(
                c.files.add, upload.file, name, purpose, c.owner, self._max_file_bytes, lifetime_s
            )
        return record.body()

    @answered()
    async def list_files(self, request: Request) -> Answered:
        c = self._open(request)
        records = [r.body() for r in c.files.list(c.owner, request.query_params.get("purpose") or None)]
        if request.query_params.get("order") == "asc":
            records.reverse()
        return page(records, request, default_limit=10000)

    @answered()
    async def file(self, request: Request, file_id: str) -> Answered:
        c = self._open(request)
        return c.files.get(file_id, c.owner).body()

    @answered()
    async def content(self, request: Request, file_id: str) -> Answered:
        c = self._open(request)
        name = c.files.get(file_id, c.owner).filename
        return FileResponse(c.files.data_path(file_id), media_type="application/octet-stream", filename=name)

    @answered(_STATE_STATUSES)
    async def delete_file(self, request: Request, file_id: str) -> Answered:
        c = self._open(request)
        c.files.get(file_id, c.owner)
        for record in c.batches.all():
            if not record.final and file_id in record.file_ids:
                raise FailedPrecondition(
                    f"file {file_id} is used by {record.id}, which is {record.status.value}; "
                    "cancel the batch or wait for it to end"
                )
        c.files.delete(file_id, c.owner)
        return {"id": file_id, "object": "file", "deleted": True}

    # --- batches ---
    @answered()
    async def create(self, request: Request) -> Answered:
        c = self._open(request)
        body = await read_json(request, CreateBatchRequest, self._max_body_bytes)
        record = _new_batch(body, c.owner, c.files)
        c.batches.create(record)
        c.runner.wake()
        return record.body()

    @answered()
    async def list_batches(self, request: Request) -> Answered:
        c = self._open(request)
        records = [r.body() for r in reversed(c.batches.all()) if r.owner == c.owner]
        return page(records, request, default_limit=20)

    @answered()
    async def batch(self, request: Request, batch_id: str) -> Answered:
        c = self._open(request)
        return c.batches.get(batch_id, c.owner).body()

    @answered(_STATE_STATUSES)
    async def cancel(self, request: Request, batch_id: str) -> Answered:
        c = self._open(request)
        c.batches.get(batch_id, c.owner)
        record = c.batches.update(batch_id, _cancelling)
        c.runner.cancelled(batch_id)
        return record.body()

    # --- helpers ---
    def _open(self, request: Request) -> _Caller:
        """What a route works with, after the API key check (NOT_FOUND when the APIs are off)."""
        caller = owner(self._keys, request)
        if self._files is None or self._batches is None or self._runner is None:
            raise NotFound(
                "the Files and Batch APIs are off on this gateway: start it with --batch-dir DIR "
                "(pdserve up gives it one)"
            )
        return _Caller(self._files, self._batches, self._runner, caller)


@dataclass(frozen=True)
class _Caller:
    """A route's stores and runner, and the caller's owner id (a hash of its API key)."""

    files: FileStore
    batches: BatchStore
    runner: BatchRunner
    owner: str


@contextlib.asynccontextmanager
async def _form(request: Request) -> AsyncIterator[FormData]:
    """The multipart body (one file, a few fields); a malformed one is a 400 naming `file`."""
    try:
        form = await request.form(max_files=1, max_fields=8)
    except (MultiPartException, StarletteHTTPException) as exc:
        detail = getattr(exc, "detail", None) or getattr(exc, "message", "")
        raise InvalidField(f"the body must be multipart/form-data with one file: {detail}", "file") from None
    try:
        yield form
    finally:
        await form.close()


def _new_batch(body: CreateBatchRequest, owner: str, files: FileStore) -> BatchRecord:
    given = body.output_expires_after or {}
    if body.endpoint not in ENDPOINTS:
        raise InvalidField(
            f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}", "endpoint"
        )
    window_s = COMPLETION_WINDOW_S.get(body.completion_window)
    if window_s is None:
        windows = ", ".join(repr(w) for w in COMPLETION_WINDOW_S)
        raise InvalidField(f"completion_window must be {windows}", "completion_window")
    pairs = metadata(body.metadata)
    try:
        source = files.get(body.input_file_id, owner)
    except NotFound:
        raise InvalidField(f"no file {body.input_file_id!r}; upload it first", "input_file_id") from None
    if source.purpose != "batch":
        raise InvalidField(f"file {source.id} has purpose {source.purpose!r}, not 'batch'", "input_file_id")
    now = int(time.time())
    return BatchRecord(
        id=new_batch_id(),
        owner=owner,
        endpoint=body.endpoint,
        input_file_id=source.id,
        completion_window=body.completion_window,
        created_at=now,
        expires_at=now + window_s,
        output_file_id=new_file_id(),
        error_file_id=new_file_id(),
        metadata=pairs,
        output_expires_after_s=expires_after(
            given.get("anchor"), given.get("seconds"), "output_expires_after"
        ),
    )


def _cancelling(record: BatchRecord) -> BatchRecord:
    if record.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return record  # cancelling twice is no error
    if record.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        raise FailedPrecondition(
            f"batch {record.id} is {record.status.value}; only a validating or in-progress batch can "
            "be cancelled"
        )
    return record.moved(BatchStatus.CANCELLING)
