"""Stored responses on the gateway's HTTP face: what `POST /v1/responses` keeps (`store`, on by
default as in OpenAI's API, when the gateway has --response-dir), a follow-up's conversation
(`previous_response_id`), background responses (`background: true`: answered `queued` at once,
or streamed, run here, their events logged; polled with GET, or streamed again from any event
with `GET ...?stream=true&starting_after=N`, from any gateway on the folder), and the routes that
read them: GET /v1/responses/{id}, DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items,
POST /v1/responses/{id}/cancel.

Responses belong to the API key that made them (a hash of it; one owner with keys off). A
request the gateway sends itself (a Batch API line) stores nothing. Without --response-dir a
response is not stored (`"store": false`), and `previous_response_id`, `background` and these
routes answer 400 / 404 saying how to turn the store on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
    TERMINAL_EVENTS,
    ResponseStatus,
    ResponseStore,
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


class StoredResponses:
    """The store under `folder` ('' = off), the background runs of this process, and the routes."""

    def __init__(
        self,
        app: FastAPI,
        keys: ApiKeys,
        folder: str,
        retention_s: float,
        max_body_bytes: int,
        poll_s: float = 1.0,
    ) -> None:
        self._keys = keys
        self._store = ResponseStore(Path(folder).expanduser()) if folder else None
        self._conversations = ConversationStore(Path(folder).expanduser()) if folder else None
        ConversationsApi(app, keys, self._conversations, max_body_bytes)
        self._retention_s = retention_s
        self._poll_s = poll_s  # how often a cancel made through another gateway is looked for (s)
        self._running: dict[str, asyncio.Task[None]] = {}  # background runs here, by response id
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
        """SIGTERM: background responses running here get `grace_s` to finish; the rest fail."""
        running = set(self._running.values())
        if running:
            await asyncio.wait(running, timeout=max(grace_s, 0.0))
        await self.close()

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        store = self._store
        for response_id, task in list(self._running.items()):
            task.cancel()
            if store is not None:
                with contextlib.suppress(Exception):
                    store.update(response_id, lambda r: _ended(r, ResponseStatus.FAILED, _STOPPED))
        if self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)

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

    def start_background(self, keeping: Keeping, queued: dict[str, Any], produce: Produce) -> dict[str, Any]:
        """Stores the queued response and runs `produce` (its events to the response's log, the
        finished Response to its record) in a task of this process, holding the response's run
        lock; returns the queued Response."""
        assert keeping.record is not None and self._store is not None
        record = dataclasses.replace(keeping.record, body=queued)
        held = contextlib.ExitStack()
        if not held.enter_context(self._store.claim(record.id)):  # a fresh id: nobody holds it
            held.close()
            raise RuntimeError(f"the run lock of {record.id} is held")
        try:
            self._store.create(record)
        except BaseException:
            held.close()
            with contextlib.suppress(OSError):
                self._store.remove(record.id)  # its run lock file
            raise
        task = asyncio.get_running_loop().create_task(self._run(keeping, produce, held))
        self._running[record.id] = task
        return queued

    async def _run(self, keeping: Keeping, produce: Produce, held: contextlib.ExitStack) -> None:
        store = self._store
        assert store is not None and keeping.record is not None
        response_id = keeping.record.id
        events = store.event_log(response_id)
        metrics.BACKGROUND_RESPONSES_RUNNING.inc()
        try:
            store.update(response_id, _started)
            body = await produce(events.write)
            done = store.update(response_id, lambda r: r if r.final else r.finished(body))
            if done.status.value == body["status"]:  # it ended as run (not cancelled first)
                self._add_turn(keeping, body)
        except asyncio.CancelledError:
            pass  # a cancel (its record says so) or the gateway stopping (close says so)
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
            with contextlib.suppress(Exception):  # however it ended: completed, failed, cancelled
                metrics.RESPONSES_STORED.labels(status=store.read(response_id).status.value).inc()
            metrics.BACKGROUND_RESPONSES_RUNNING.dec()
            held.close()
            self._running.pop(response_id, None)

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
        removes the records past their retention."""
        store = self._store
        assert store is not None
        pruned_at = 0.0
        while True:
            for response_id, task in list(self._running.items()):
                try:
                    stopped = store.read(response_id).status == ResponseStatus.CANCELLED
                except NotFound:
                    stopped = True  # deleted
                except Exception:
                    continue  # being written: the next poll
                if stopped:
                    task.cancel()
            if time.monotonic() - pruned_at >= _PRUNE_EVERY_S:
                pruned_at = time.monotonic()
                with contextlib.suppress(Exception):
                    gone = await asyncio.to_thread(store.prune, time.time(), self._retention_s)
                    if gone:
                        log.info("responses_pruned", count=len(gone))
            await asyncio.sleep(self._poll_s)

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
        task = self._running.get(record.id)
        if task is not None:
            task.cancel()
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
