"""Runs the Batch API's batches in the gateway: each request of a batch is answered exactly as the
same HTTP request would be (`Answer`: the gateway's own HTTP app, in process), at a lower priority
than interactive traffic (--batch-priority unless the line sets one), with at most
--batch-concurrency requests of all batches in flight.

The runner scans the store every `poll_s` (and at once when this process creates a batch) and
runs every unfinished batch whose run lock it gets (`BatchStore.claim`). A batch's results are
appended, one flushed JSON line each, to its output file (2xx answers) or error file; those files
are the truth of what is done: a batch resumed after its gateway died runs only the requests
neither file holds (a line cut off by the crash is dropped first), and its counts are recounted
from them. Requests answered 429 or 503 (overload, no worker right now) are tried again with
backoff while the completion window lasts; requests not done by its end are written to the error
file as `batch_expired` and the batch ends `expired`. A cancel stops the dispatch, aborts the
requests in flight (as a client that goes away does) and ends the batch `cancelled` with the files
of what was done. A drain (SIGTERM) sends no new request and lets those in flight finish and be
written within the grace, so a rolling update does not run them twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TextIO

import structlog

from services.gateway.batch_files import OUTPUT_PURPOSE, FileStore
from services.gateway.batch_input import BatchLine, parse_input
from services.gateway.batch_retention import expired
from services.gateway.batches import BatchRecord, BatchStatus, BatchStore, LineError, append_line
from shared import metrics
from shared.errors import FailedPrecondition

log = structlog.get_logger(__name__)

# (endpoint, body, request id) -> (HTTP status, JSON body), as the HTTP API answers that request
Answer = Callable[[str, dict[str, Any], str], Awaitable[tuple[int, dict[str, Any]]]]
Stop = Literal["done", "cancelled", "expired", "draining"]

RETRY_STATUSES = frozenset({429, 503})  # overloaded or no worker right now: tried again later
EXPIRED_CODE = "batch_expired"
EXPIRED_ERROR = {
    "code": EXPIRED_CODE,
    "message": "This request could not be executed before the completion window expired.",
}


@dataclass(frozen=True)
class RunnerSettings:
    concurrency: int  # requests of all batches in flight at once (count)
    priority: int  # a request's priority unless its body sets one (lower is served first)
    max_lines: int  # most requests in one input file (count)
    poll_s: float = 2.0  # how often the store is scanned for batches to run, and cancels (s)
    retry_max_s: float = 30.0  # longest wait between tries of a request answered 429/503 (s)
    retention_s: float = 0.0  # how long finished batches and uploads are kept; 0 = forever (s)
    prune_every_s: float = 600.0  # how often what retention_s let go is deleted (s)


class BatchRunner:
    def __init__(
        self,
        files: FileStore,
        batches: BatchStore,
        answer: Answer,
        settings: RunnerSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._files = files
        self._batches = batches
        self._answer = answer
        self._settings = settings
        self._clock = clock
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._cancels: dict[str, asyncio.Event] = {}  # batches running here -> set on a cancel here
        self._wake = asyncio.Event()
        self._draining = asyncio.Event()  # set by drain(): no new request is sent
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.ensure_future(self._loop())

    def wake(self) -> None:
        """A batch was created here: look now, not at the next poll."""
        self._wake.set()

    def cancelled(self, batch_id: str) -> None:
        """A batch was set cancelling here: stop it now if it runs here (else at the next poll)."""
        if batch_id in self._cancels:
            self._cancels[batch_id].set()
        self._wake.set()

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: send no new request and claim no batch; the requests in flight get `grace_s`
        to finish (their answers written, so the next gateway does not run them again), then
        close() aborts what is left."""
        self._draining.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
        running = list(self._running.values())
        if running:
            await asyncio.wait(running, timeout=grace_s)
        await self.close()

    async def close(self) -> None:
        """Stops running (requests in flight are aborted; the batches stay unfinished on disk for
        the next gateway to resume)."""
        tasks = [t for t in (self._loop_task, *self._running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        pruned_at = -math.inf
        while True:
            self._wake.clear()
            try:
                if self._clock() - pruned_at >= self._settings.prune_every_s:
                    pruned_at = self._clock()
                    self._prune()
                for batch_id in self._batches.unfinished():
                    if batch_id not in self._running:
                        task = asyncio.ensure_future(self._claim_and_run(batch_id))
                        self._running[batch_id] = task
                        task.add_done_callback(functools.partial(self._ended, batch_id))
            except OSError as exc:  # the folder went away for a moment: try again at the next poll
                log.warning("batch_scan_failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._settings.poll_s)

    def _prune(self) -> None:
        """Deletes the batches and files --batch-retention-s let go (batch_retention.py)."""
        gone = expired(self._batches.all(), self._files.list(None), self._clock(), self._settings.retention_s)
        for batch_id in gone.batch_ids:
            self._batches.remove(batch_id)
        for file_id in gone.file_ids:
            self._files.remove(file_id)
        if gone.batch_ids or gone.file_ids:
            log.info("batch_retention", batches=len(gone.batch_ids), files=len(gone.file_ids))

    def _ended(self, batch_id: str, _: asyncio.Task[None]) -> None:
        self._running.pop(batch_id, None)

    async def _claim_and_run(self, batch_id: str) -> None:
        with self._batches.claim(batch_id) as mine:
            if not mine:
                return  # another gateway process runs it
            self._cancels[batch_id] = asyncio.Event()
            metrics.BATCHES_RUNNING.inc()
            try:
                await self._run(batch_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or the disk: logged; the batch is tried again at the next poll
                log.exception("batch_run_failed", batch_id=batch_id)
            finally:
                del self._cancels[batch_id]
                metrics.BATCHES_RUNNING.dec()

    async def _run(self, batch_id: str) -> None:
        record = self._batches.read(batch_id)
        if record.status == BatchStatus.VALIDATING:
            record = self._validate(record)
        if record.status == BatchStatus.IN_PROGRESS:
            record = await self._execute(record)
            if record.status == BatchStatus.IN_PROGRESS:  # draining: the next gateway resumes it
                log.info("batch_left", batch_id=batch_id, completed=record.completed, failed=record.failed)
                return
        if record.status == BatchStatus.FINALIZING:
            record = self._finish(record, BatchStatus.EXPIRED if record.expired else BatchStatus.COMPLETED)
        if record.status == BatchStatus.CANCELLING:
            record = self._finish(self._recount(record), BatchStatus.CANCELLED)
        log.info(
            "batch_over",
            batch_id=batch_id,
            status=record.status.value,
            total=record.total,
            completed=record.completed,
            failed=record.failed,
        )

    # --- the steps ---
    def _lines(self, record: BatchRecord) -> tuple[list[BatchLine], list[LineError]]:
        try:
            data = self._files.data_path(record.input_file_id).read_bytes()
        except (FileNotFoundError, LookupError):
            return [], [LineError("input_file_missing", f"the input file {record.input_file_id} is gone")]
        return parse_input(data, record.endpoint, self._settings.max_lines)

    def _validate(self, record: BatchRecord) -> BatchRecord:
        lines, errors = self._lines(record)

        def validated(r: BatchRecord) -> BatchRecord:
            if r.status != BatchStatus.VALIDATING:  # cancelled meanwhile
                return r
            if errors:
                return replace(r.moved(BatchStatus.FAILED), errors=tuple(errors))
            return replace(r.moved(BatchStatus.IN_PROGRESS), total=len(lines))

        record = self._batches.update(record.id, validated)
        if record.status == BatchStatus.FAILED:
            metrics.BATCHES.labels(status=record.status.value).inc()
        return record

    async def _execute(self, record: BatchRecord) -> BatchRecord:
        lines, errors = self._lines(record)
        if errors:  # the input file was deleted under a running batch: what is left is not run
            log.error("batch_input_gone", batch_id=record.id, error=errors[0].message)
        answered, failed = self._tallies(record)
        todo = [line for line in lines if line.custom_id not in answered and line.custom_id not in failed]
        record = self._counted(record, answered, failed)
        with (
            self._path(record.output_file_id).open("a", encoding="utf-8") as out,
            self._path(record.error_file_id).open("a", encoding="utf-8") as err,
        ):
            run = _Run(self, record, out, err, self._cancels[record.id])
            stop = await run.all(todo)
            if stop == "expired":
                for line in todo:
                    if line.custom_id not in run.finished:
                        append_line(err, _result(line.custom_id, None, EXPIRED_ERROR))
                        metrics.BATCH_REQUESTS.labels(outcome="expired").inc()
        if stop in ("cancelled", "draining"):
            return self._batches.read(record.id)
        record = self._recount(record)
        return self._batches.update(
            record.id, lambda r: r.moved(BatchStatus.FINALIZING) if r.status == BatchStatus.IN_PROGRESS else r
        )

    def _path(self, file_id: str) -> Path:
        return self._files.data_path(file_id)

    def _tallies(self, record: BatchRecord) -> tuple[dict[str, str | None], dict[str, str | None]]:
        """What the output and error files hold (_tally of each)."""
        return _tally(self._path(record.output_file_id)), _tally(self._path(record.error_file_id))

    def _recount(self, record: BatchRecord) -> BatchRecord:
        """The counts as the output and error files say (the files are the truth)."""
        return self._counted(record, *self._tallies(record))

    def _counted(
        self, record: BatchRecord, answered: dict[str, str | None], failed: dict[str, str | None]
    ) -> BatchRecord:
        expired = sum(1 for code in failed.values() if code == EXPIRED_CODE)
        return self._batches.update(
            record.id, lambda r: replace(r, completed=len(answered), failed=len(failed), expired=expired)
        )

    def _finish(self, record: BatchRecord, to: BatchStatus) -> BatchRecord:
        for file_id, kind in ((record.output_file_id, "output"), (record.error_file_id, "error")):
            self._path(file_id).touch()
            name = f"{record.id}_{kind}.jsonl"
            self._files.seal(file_id, name, OUTPUT_PURPOSE, record.owner, record.output_expires_after_s)
        try:
            record = self._batches.update(record.id, lambda r: r.moved(to))
        except FailedPrecondition:  # already final (another process got there first)
            return self._batches.read(record.id)
        metrics.BATCHES.labels(status=to.value).inc()
        return record

    # --- one request ---
    async def answer(self, record: BatchRecord, line: BatchLine) -> tuple[int, dict[str, Any], str]:
        """The line's request answered, tried again while it is answered 429/503 and the window
        lasts; (status, body, request id)."""
        body = line.body if "priority" in line.body else {**line.body, "priority": self._settings.priority}
        request_id = f"{record.id}-{line.line}-{uuid.uuid4().hex[:8]}"
        wait_s = 1.0
        while True:
            try:
                status, payload = await self._answer(record.endpoint, body, request_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch_request_failed", batch_id=record.id, line=line.line)
                status, payload = 500, {"error": {"message": "internal error", "type": "internal_error"}}
            if status not in RETRY_STATUSES or record.expires_at - self._clock() <= wait_s:
                return status, payload, request_id
            await asyncio.sleep(wait_s)
            wait_s = min(wait_s * 2, self._settings.retry_max_s)


class _Run:
    """One batch's requests in flight: dispatched as the runner's slots allow, each result written
    as it comes, stopped by a cancel (seen on disk, or made in this process) or the window's end."""

    def __init__(
        self, runner: BatchRunner, record: BatchRecord, out: TextIO, err: TextIO, cancel: asyncio.Event
    ) -> None:
        self._runner = runner
        self._record = record
        self._out = out
        self._err = err
        self._cancel = cancel
        self._tasks: set[asyncio.Task[None]] = set()
        self.finished: set[str] = set()  # custom ids written by this run

    async def all(self, todo: list[BatchLine]) -> Stop:
        watcher = asyncio.ensure_future(self._watch())
        slots = self._runner._slots
        try:
            for line in todo:
                slot = asyncio.ensure_future(slots.acquire())
                await asyncio.wait({watcher, slot}, return_when=asyncio.FIRST_COMPLETED)
                if watcher.done():
                    if slot.done():
                        slots.release()  # got one as the batch stopped: give it back
                    else:
                        slot.cancel()  # a cancelled acquire holds no slot
                    break
                task = asyncio.ensure_future(self._one(line))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            while self._tasks and not watcher.done():
                await asyncio.wait({watcher, *self._tasks}, return_when=asyncio.FIRST_COMPLETED)
            if not watcher.done():
                return "done"
            stop: Stop = watcher.result()
            if stop == "draining":  # what is in flight finishes and is written (drain's grace)
                await asyncio.gather(*self._tasks, return_exceptions=True)
            return stop
        finally:
            watcher.cancel()
            for task in list(self._tasks):
                task.cancel()  # aborted on the workers, as when a client goes away
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _watch(self) -> Stop:
        runner = self._runner
        while True:
            if runner._draining.is_set():
                return "draining"
            left_s = self._record.expires_at - runner._clock()
            if left_s <= 0:
                return "expired"
            if runner._batches.read(self._record.id).status == BatchStatus.CANCELLING:
                return "cancelled"
            events = {
                asyncio.ensure_future(self._cancel.wait()),
                asyncio.ensure_future(runner._draining.wait()),
            }
            try:
                await asyncio.wait(
                    events, timeout=min(runner._settings.poll_s, left_s), return_when=asyncio.FIRST_COMPLETED
                )
            finally:  # also when this watch is cancelled (the batch ended): no waiter left pending
                for waiting in events:
                    waiting.cancel()

    async def _one(self, line: BatchLine) -> None:
        try:
            status, payload, request_id = await self._runner.answer(self._record, line)
        finally:
            self._runner._slots.release()
        ok = 200 <= status < 300
        response = {"status_code": status, "request_id": request_id, "body": payload}
        append_line(self._out if ok else self._err, _result(line.custom_id, response, None))
        metrics.BATCH_REQUESTS.labels(outcome="completed" if ok else "failed").inc()
        self.finished.add(line.custom_id)
        self._runner._batches.update(
            self._record.id, lambda r: replace(r, completed=r.completed + ok, failed=r.failed + (not ok))
        )


def _result(custom_id: str, response: dict[str, Any] | None, error: dict[str, str] | None) -> dict[str, Any]:
    """A line of an output or error file, in OpenAI's shape."""
    line_id = "batch_req_" + uuid.uuid4().hex
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": error}


def _tally(path: Path) -> dict[str, str | None]:
    """custom id -> its error code (None: answered) for each line of an output or error file; a
    last line cut off by a crash is removed from the file first."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    lines: dict[str, str | None] = {}
    for raw in data[:end].splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            value = json.loads(raw)
            lines[value["custom_id"]] = (value.get("error") or {}).get("code")
    return lines
