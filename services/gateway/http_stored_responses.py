"""Stored responses on the gateway's HTTP face: what `POST /v1/responses` keeps (`store`, on by
default as in OpenAI's API, when the gateway has --response-dir), a follow-up's conversation
(`previous_response_id`), background responses (`background: true`: answered `queued` at once,
or streamed, run here, their events logged; polled with GET, or streamed again from any event
with `GET ...?stream=true&starting_after=N`, from any gateway on the folder), and the routes that
read them: GET /v1/responses/{id}, DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items,
POST /v1/responses/{id}/cancel.

A background response outlives its gateway when it can be reproduced exactly: every gateway on
the folder polls for ones whose run lock is free (their gateway died, or stopped and let them go)
and takes over those that have written no output yet, running them again from the start with
the same id and request, their events appended to the same log (numbered on, no second
`response.created`); one that had written output is marked failed. A gateway that stops lets go
at once of the runs that have written no output, and gives the others the drain grace.

Responses belong to the API key that made them (a hash of it; one owner with keys off). A
request the gateway sends itself (a Batch API line) stores nothing. Without --response-dir a
response is not stored (`"store": false`), and `previous_response_id`, `background` and these
routes answer 400 / 404 saying how to turn the store on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI, Request

from services.gateway import http_responses_api as responses_api
from services.gateway.conversations import ConversationStore
from services.gateway.http_conversations import ConversationsApi
from services.gateway.http_errors import http_error
from services.gateway.http_routes import Answered, answered, items_page, owner
from services.gateway.http_stream import EventStream
from services.gateway.stored_responses import (
    PREAMBLE_EVENTS,
    TERMINAL_EVENTS,
    ResponseStatus,
    ResponseStore,
    RunRequest,
    StoredResponse,
    as_input_item,
    new_response_id,
)
from services.gateway.validation import InvalidField
from shared import metrics
from shared.auth import ApiKeys
from shared.errors import NotFound

log = structlog.get_logger(__name__)

_OFF = "stored responses are off on this gateway: start it with --response-dir DIR (pdserve up gives it one)"
_PRUNE_EVERY_S = 600.0  # how often records past their retention are removed (s)
_STOPPED = "the gateway stopped before this response finished; create it again"
_TAIL_WAIT_S = 0.02  # a streaming reader's wait for the next event (s)
_TAIL_CHECK_S = 0.25  # how often it looks whether the response ended without a last event (s)

Emit = Callable[[dict[str, Any]], None]
# a background run: writes each Responses event through its argument, returns the final Response
Produce = Callable[[Emit], Awaitable[dict[str, Any]]]


class ResponseFailed(Exception):
    """A background run's stream ended with an error event (written already): the response
    fails with its message."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.message, self.code = message, code or "server_error"


class PreviousResponseNotFound(NotFound):
    param = "previous_response_id"


class ConversationNotFound(NotFound):
    param = "conversation"


@dataclasses.dataclass(frozen=True)
class Keeping:
    """How one Responses request is kept: its record (None: not stored), the conversation it
    continues (`previous_response_id`'s, or a `conversation`'s items), and, with `conversation`,
    that conversation's id, its owner and this request's input items (what the conversation gets,
    with the output, once the response finishes)."""

    record: StoredResponse | None
    context: tuple[dict[str, Any], ...] = ()
    conversation: str | None = None
    owner: str = ""
    items: tuple[dict[str, Any], ...] = ()

    @property
    def kept(self) -> responses_api.Kept | None:
        if self.record is None:
            return None
        return responses_api.Kept(self.record.id, self.record.background)


# builds the run of a background response taken over from another gateway: (its request, how it
# is kept, its request id, its created_at) -> what `Produce`s it (as POST /v1/responses would)
Rerun = Callable[[responses_api.ResponsesRequest, Keeping, str, int], Awaitable[Produce]]


@dataclasses.dataclass
class _Run:
    """A background run in this process: whether it has written output (until it has, it can
    be let go for another gateway to run again), and whether it was let go."""

    task: asyncio.Task[None] | None = None
    output: bool = False
    released: bool = False


class StoredResponses:
    """The store under `folder` ('' = off), the background runs of this process, and the routes."""

    def __init__(
        self,
        app: FastAPI,
        keys: ApiKeys,
        folder: str,
        retention_s: float,
        max_body_bytes: int,
        rerun: Rerun,
        poll_s: float = 1.0,
    ) -> None:
        self._keys = keys
        self._rerun = rerun
        self._store = ResponseStore(Path(folder).expanduser()) if folder else None
        self._conversations = ConversationStore(Path(folder).expanduser()) if folder else None
        ConversationsApi(app, keys, self._conversations, max_body_bytes)
        self._retention_s = retention_s
        # how often a cancel made through another gateway, and runs left by one, are looked for (s)
        self._poll_s = poll_s
        self._running: dict[str, _Run] = {}  # background runs here, by response id
        self._watcher: asyncio.Task[None] | None = None
        for path, route, method in (
            ("/v1/responses/{response_id}", self.retrieve, "GET"),
            ("/v1/responses/{response_id}", self.delete, "DELETE"),
            ("/v1/responses/{response_id}/input_items", self.list_input_items, "GET"),
            ("/v1/responses/{response_id}/cancel", self.cancel, "POST"),
        ):
            app.add_api_route(path, route, methods=[method], response_model=None)

    def start(self) -> None:
        if self._store is not None and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: nothing more is taken over; the background responses running here that have
        written no output are let go at once (another gateway runs them again), the others get
        `grace_s` to finish; then close()."""
        self._stop_watching()
        self._let_go()
        tasks = {run.task for run in self._running.values() if run.task is not None}
        if tasks:
            await asyncio.wait(tasks, timeout=max(grace_s, 0.0))
        await self.close()

    async def close(self) -> None:
        """Stops the runs here: those without output are let go (their records stay queued or in
        progress, their run locks free, for another gateway), the rest fail."""
        self._stop_watching()
        self._let_go()
        store = self._store
        for response_id, run in list(self._running.items()):
            if run.task is not None:
                run.task.cancel()
            if store is not None and not run.released:
                with contextlib.suppress(Exception):
                    store.update(response_id, lambda r: _ended(r, ResponseStatus.FAILED, _STOPPED))
        tasks = [run.task for run in self._running.values() if run.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def _let_go(self) -> None:
        """Stops the runs here that have written no output, leaving them for another gateway
        (their tasks end with their run locks released; nothing more reaches their logs)."""
        for response_id, run in self._running.items():
            if not run.output and not run.released and run.task is not None:
                run.released = True
                run.task.cancel()
                log.info("background_response_let_go", response_id=response_id)

    # --- what POST /v1/responses keeps ---
    def prepare(self, req: responses_api.ResponsesRequest, request: Request, inner: bool) -> Keeping:
        """How `req` is kept; the previous response's conversation. `inner`: the gateway's own
        call (a Batch API line), which stores nothing."""
        stores = self._store is not None and req.store is not False and not inner
        if req.background and not stores:
            if req.store is False:
                raise InvalidField("a background response is stored: send store true, or no store", "store")
            raise InvalidField(f"background needs stored responses; {_OFF}", "background")
        context: tuple[dict[str, Any], ...] = ()
        who = "" if inner else owner(self._keys, request)
        if req.previous_response_id is not None:
            context = self._previous(req.previous_response_id, who, inner)
        conversation = responses_api.conversation_id(req)
        if conversation is not None:
            context = self._conversation(conversation, who, inner, req)
        response_id = new_response_id()
        items = responses_api.input_items(req, response_id)
        if not stores:
            return Keeping(None, context, conversation, who, items)
        record = StoredResponse(
            id=response_id,
            owner=who,
            created_at=int(time.time()),
            body={"status": ResponseStatus.IN_PROGRESS.value},
            input_items=items,
            context=context + items,
            background=bool(req.background),
        )
        return Keeping(record, context, conversation, who, items)

    def _conversation(
        self, conversation: str, who: str, inner: bool, req: responses_api.ResponsesRequest
    ) -> tuple[dict[str, Any], ...]:
        if req.previous_response_id is not None:
            raise InvalidField("send previous_response_id or conversation, not both", "conversation")
        if inner:
            raise InvalidField("conversation is not served in a batch", "conversation")
        if self._conversations is None:
            raise InvalidField(f"conversation needs stored responses; {_OFF}", "conversation")
        try:
            return self._conversations.get(conversation, who).items
        except NotFound:
            raise ConversationNotFound(
                f"conversation: no conversation {conversation!r} (deleted, or made with another API key)"
            ) from None

    def _add_turn(self, keeping: Keeping, body: dict[str, Any]) -> None:
        """A finished response's input and output items join its conversation (if it has one)."""
        if keeping.conversation is None or self._conversations is None:
            return
        turn = keeping.items + tuple(as_input_item(item) for item in body["output"])
        try:
            self._conversations.update(keeping.conversation, lambda c: c.added(turn), keeping.owner)
        except Exception as exc:  # deleted meanwhile, a full disk: the answer still goes out
            log.warning("conversation_not_updated", conversation=keeping.conversation, error=str(exc))

    def _previous(self, response_id: str, who: str, inner: bool) -> tuple[dict[str, Any], ...]:
        if inner:
            raise InvalidField(
                "previous_response_id is not served in a batch: send the whole conversation in input",
                "previous_response_id",
            )
        if self._store is None:
            raise InvalidField(f"previous_response_id needs stored responses; {_OFF}", "previous_response_id")
        try:
            record = self._store.get(response_id, who)
        except NotFound:
            raise PreviousResponseNotFound(
                f"previous_response_id: no response {response_id!r} (deleted, expired, or made with "
                "another API key)"
            ) from None
        if not record.final:
            raise InvalidField(
                f"previous_response_id: response {response_id} is {record.status.value}; wait until it "
                "is completed",
                "previous_response_id",
            )
        return record.context

    def keep(self, keeping: Keeping, body: dict[str, Any]) -> None:
        """Stores a finished response (a no-op when it is not kept). A store that cannot be
        written (a full disk) loses no answer: the Response goes out saying `"store": false`
        (its body is changed in place), and the log says why."""
        self._add_turn(keeping, body)
        if keeping.record is None or self._store is None:
            return
        done = keeping.record.finished(body)
        try:
            self._store.create(done)
        except OSError as exc:
            log.error("response_not_stored", response_id=done.id, error=str(exc))
            body["store"] = False
            return
        metrics.RESPONSES_STORED.labels(status=done.status.value).inc()

    def start_background(
        self, keeping: Keeping, queued: dict[str, Any], produce: Produce, request: RunRequest
    ) -> dict[str, Any]:
        """Stores the queued response, and `request` (to run it again if this gateway goes away
        before it writes output), and runs `produce` (its events to the response's log, the
        finished Response to its record) in a task of this process, holding the response's run
        lock; returns the queued Response."""
        assert keeping.record is not None and self._store is not None
        record = dataclasses.replace(keeping.record, body=queued)
        held = contextlib.ExitStack()
        if not held.enter_context(self._store.claim(record.id)):  # a fresh id: nobody holds it
            held.close()
            raise RuntimeError(f"the run lock of {record.id} is held")
        try:
            self._store.keep_request(record.id, request)
            self._store.create(record)
        except BaseException:
            held.close()
            with contextlib.suppress(OSError):
                self._store.remove(record.id)  # its run lock and request files
            raise
        self._start_run(keeping, produce, held, [])
        return queued

    def _start_run(
        self, keeping: Keeping, produce: Produce, held: contextlib.ExitStack, logged: list[dict[str, Any]]
    ) -> None:
        """Runs `produce` in a task here; `held`: the run lock (the task releases it);
        `logged`: the events its log holds already (a run taken over)."""
        assert keeping.record is not None
        response_id = keeping.record.id
        run = _Run()
        run.task = asyncio.get_running_loop().create_task(self._run(keeping, produce, run, logged))
        # the run lock goes once the task is done, also when it is cancelled before it started
        run.task.add_done_callback(functools.partial(self._run_over, response_id, run, held))
        self._running[response_id] = run

    def _run_over(self, response_id: str, run: _Run, held: contextlib.ExitStack, _: object) -> None:
        held.close()
        if self._running.get(response_id) is run:
            del self._running[response_id]

    async def _run(self, keeping: Keeping, produce: Produce, run: _Run, logged: list[dict[str, Any]]) -> None:
        store = self._store
        assert store is not None and keeping.record is not None
        response_id = keeping.record.id
        after = max((int(e.get("sequence_number", -1)) for e in logged), default=-1)
        events = store.event_log(response_id, after + 1)
        again = {str(e.get("type")) for e in logged}  # what a run taken over does not log twice

        def emit(event: dict[str, Any]) -> None:
            if run.released:  # let go: another gateway may be running it already
                raise asyncio.CancelledError
            kind = event["type"]
            if kind in again and kind in PREAMBLE_EVENTS:
                again.discard(kind)
                return
            if kind not in PREAMBLE_EVENTS:
                run.output = True
            events.write({**event, "sequence_number": events.next_sequence})

        metrics.BACKGROUND_RESPONSES_RUNNING.inc()
        try:
            store.update(response_id, _started)
            body = await produce(emit)
            done = store.update(response_id, lambda r: r if r.final else r.finished(body))
            if done.status.value == body["status"]:  # it ended as run (not cancelled first)
                self._add_turn(keeping, body)
        except asyncio.CancelledError:
            pass  # a cancel (its record says so), the gateway stopping (close says so), or let go
        except ResponseFailed as failure:  # its error event is in the log
            reason, code = failure.message, failure.code
            with contextlib.suppress(Exception):
                store.update(response_id, lambda r: _ended(r, ResponseStatus.FAILED, reason, code))
        except Exception as exc:
            error = http_error(exc)
            if error.is_internal:
                log.error("background_response_failed", response_id=response_id, exc_info=exc)
            code = "rate_limit_exceeded" if error.status == 429 else "server_error"
            message = error.body.error.message
            with contextlib.suppress(Exception):
                failed = store.update(response_id, lambda r: _ended(r, ResponseStatus.FAILED, message, code))
                events.write(_failed_event(failed, events.next_sequence))
        finally:
            events.close()
            self._ended(store, response_id)
            metrics.BACKGROUND_RESPONSES_RUNNING.dec()

    def _ended(self, store: ResponseStore, response_id: str) -> None:
        """After a run here (its run lock still held): an ended response is counted and its kept
        request dropped; a deleted one loses what the run may have written since."""
        try:
            record = store.read(response_id)
        except NotFound:
            with contextlib.suppress(OSError):
                store.remove(response_id)
            return
        except Exception:
            return  # being written: the next gateway's poll sees it
        if record.final:  # completed, failed, cancelled (not one let go)
            metrics.RESPONSES_STORED.labels(status=record.status.value).inc()
            with contextlib.suppress(OSError):
                store.drop_request(response_id)

    async def tail(self, response_id: str, who: str, after: int) -> AsyncIterator[str]:
        """A background response's events after sequence number `after`, as server-sent events,
        as its run writes them (in any gateway on the folder), until its last event; one that
        ended without one (cancelled; failed as abandoned) ends there, a failed one with
        `response.failed`."""
        store = self._store
        assert store is not None
        offset, last, checked = 0, -1, 0.0
        while True:
            written, offset = store.events_from(response_id, offset)
            for event in written:
                last = event.get("sequence_number", last)
                if last > after:
                    yield responses_api.sse(event)
                if event.get("type") in TERMINAL_EVENTS:
                    return
            if written:
                continue
            if time.monotonic() - checked >= _TAIL_CHECK_S:
                checked = time.monotonic()
                try:
                    record = store.get(response_id, who)  # one its gateway left is failed here
                except NotFound:
                    return  # deleted
                if record.final:
                    written, offset = store.events_from(response_id, offset)
                    if written:
                        continue  # what it wrote before it ended first
                    if record.status == ResponseStatus.FAILED:
                        yield responses_api.sse(_failed_event(record, last + 1))
                    return
            await asyncio.sleep(_TAIL_WAIT_S)

    async def _watch(self) -> None:
        """Cancels the runs here whose record was cancelled (or deleted) through another gateway;
        takes over the background responses whose run lock is free; removes the records past
        their retention."""
        store = self._store
        assert store is not None
        pruned_at = 0.0
        while True:
            for response_id, run in list(self._running.items()):
                try:
                    stopped = store.read(response_id).status == ResponseStatus.CANCELLED
                except NotFound:
                    stopped = True  # deleted
                except Exception:
                    continue  # being written: the next poll
                if stopped and run.task is not None:
                    run.task.cancel()
            try:
                left = await asyncio.to_thread(store.unfinished)
            except OSError as exc:  # the folder went away for a moment: the next poll
                log.warning("response_scan_failed", error=str(exc))
                left = []
            for response_id in left:
                if response_id not in self._running:
                    await self._take_over(store, response_id)
            if time.monotonic() - pruned_at >= _PRUNE_EVERY_S:
                pruned_at = time.monotonic()
                with contextlib.suppress(Exception):
                    gone = await asyncio.to_thread(store.prune, time.time(), self._retention_s)
                    if gone:
                        log.info("responses_pruned", count=len(gone))
            await asyncio.sleep(self._poll_s)

    async def _take_over(self, store: ResponseStore, response_id: str) -> None:
        """Claims a background response whose run lock is free and runs it here again from the
        start when it has written no output (one that has is marked failed); the run lock
        decides between gateways, and a GET that finds it free leaves such a response alone."""
        held = contextlib.ExitStack()
        try:
            if not held.enter_context(store.claim(response_id)):
                held.close()
                return  # it runs somewhere
            started = await self._resume(store, response_id, held)
        except BaseException as exc:
            held.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            log.warning("response_take_over_failed", response_id=response_id, error=str(exc))
            return
        if not started:
            held.close()

    async def _resume(self, store: ResponseStore, response_id: str, held: contextlib.ExitStack) -> bool:
        """Under the response's run lock: whether a run of it started here (it then owns `held`)."""
        try:
            record = store.read(response_id)
        except NotFound:  # deleted: what the claim made, and its request, go too
            store.remove(response_id)
            return False
        if record.final:
            store.drop_request(response_id)  # its run ended just before it dropped it
            return False
        request = store.resumable(response_id)
        if request is None:  # it wrote output: it cannot be reproduced exactly
            store.fail_abandoned(response_id)
            metrics.RESPONSES_STORED.labels(status=ResponseStatus.FAILED.value).inc()
            log.info("background_response_abandoned", response_id=response_id)
            return False
        store.keep_request(response_id, dataclasses.replace(request, runs=request.runs + 1))
        logged, _ = store.events_from(response_id, 0)
        context = record.context[: len(record.context) - len(record.input_items)]
        try:
            asked = responses_api.ResponsesRequest.model_validate_json(json.dumps(request.body))
            keeping = Keeping(
                record, context, responses_api.conversation_id(asked), record.owner, record.input_items
            )
            produce = await self._rerun(asked, keeping, request.request_id, request.created)
        except Exception as exc:  # a request this gateway cannot run (a model it does not serve)
            message = http_error(exc).body.error.message
            store.update(response_id, lambda r: _ended(r, ResponseStatus.FAILED, message))
            store.drop_request(response_id)
            metrics.RESPONSES_STORED.labels(status=ResponseStatus.FAILED.value).inc()
            return False
        self._start_run(keeping, produce, held, logged)
        metrics.BACKGROUND_RESPONSES_RESUMED.inc()
        log.info("background_response_resumed", response_id=response_id, events_logged=len(logged))
        return True

    # --- routes ---
    @answered()
    async def retrieve(self, request: Request, response_id: str) -> Answered:
        store, who = self._open(request)
        record = store.get(response_id, who)
        if request.query_params.get("stream") not in ("true", "1"):
            return record.body
        if not record.background:
            raise InvalidField(
                f"response {response_id} was not created with background true; only a background "
                "response's events are kept to stream again",
                "stream",
            )
        after_text = request.query_params.get("starting_after", "-1")
        try:
            after = int(after_text)
        except ValueError:
            raise InvalidField(
                f"starting_after must be an event's sequence_number, got {after_text!r}", "starting_after"
            ) from None
        return self.stream(response_id, who, after)

    def stream(
        self, response_id: str, who: str, after: int, headers: dict[str, str] | None = None
    ) -> EventStream:
        """A background response's events after `after` as a server-sent event response; the
        client going away leaves the response running."""
        return EventStream(self.tail(response_id, who, after), lambda: None, headers or {})

    @answered()
    async def delete(self, request: Request, response_id: str) -> Answered:
        store, who = self._open(request)
        record = store.get(response_id, who)
        if not record.final:
            self._cancel(store, record)
        store.remove(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @answered()
    async def list_input_items(self, request: Request, response_id: str) -> Answered:
        store, who = self._open(request)
        return items_page(store.get(response_id, who).input_items, request)

    @answered()
    async def cancel(self, request: Request, response_id: str) -> Answered:
        store, who = self._open(request)
        record = store.get(response_id, who)
        if not record.background:
            raise InvalidField(
                f"response {response_id} was not created with background true; only a background "
                "response can be cancelled",
                "response_id",
            )
        if record.final:
            return record.body  # cancelling one that has ended changes nothing
        return self._cancel(store, record).body

    def _cancel(self, store: ResponseStore, record: StoredResponse) -> StoredResponse:
        """Marks an unfinished response cancelled and stops its run here (another gateway's run
        sees the record within its poll)."""
        done = store.update(record.id, lambda r: _ended(r, ResponseStatus.CANCELLED))
        run = self._running.get(record.id)
        if run is not None and run.task is not None:
            run.task.cancel()
        return done

    def _open(self, request: Request) -> tuple[ResponseStore, str]:
        who = owner(self._keys, request)
        if self._store is None:
            raise NotFound(_OFF)
        return self._store, who


def _started(record: StoredResponse) -> StoredResponse:
    if record.status != ResponseStatus.QUEUED:
        return record  # cancelled before it started
    return record.moved(ResponseStatus.IN_PROGRESS)


def _ended(
    record: StoredResponse, to: ResponseStatus, message: str = "", code: str = "server_error"
) -> StoredResponse:
    """`record` cancelled or failed (`message`), unless it has ended already."""
    if record.final:
        return record
    if to == ResponseStatus.FAILED:
        return record.moved(to, error={"code": code, "message": message})
    return record.moved(to)


def _failed_event(record: StoredResponse, sequence_number: int) -> dict[str, Any]:
    return {"type": "response.failed", "sequence_number": sequence_number, "response": record.body}
