"""The Responses API's stored responses (`store`, `previous_response_id`, `background`): one
record per response, its status with the transitions allowed, and their store on disk under
--response-dir as `<id>.json`.

A record holds the Response object as the API shows it, the request's own input items (what
`GET /v1/responses/{id}/input_items` lists) and the conversation up to and including this
response (`context`: the input items of every response in its `previous_response_id` chain and
their output items, in order), so a follow-up is served from one record even when earlier ones
were deleted or expired.

Several gateway processes may share the folder (`pdserve up --gateways 2` shares one HTTP port):
a record changes only through `ResponseStore.update` (shared_folder.RecordFolder), under
`<id>.lock`; the process running a background response holds `<id>.run` locked while it runs
(`claim`), and the lock goes with its process. A background response's events (the Responses
stream events, one JSON line each) go to `<id>.events` as it runs (`EventLog`), where a client
that streams it, now or later (`GET /v1/responses/{id}?stream=true&starting_after=N`), reads
them (`events_from`) from any gateway on the folder.

What a background run needs to run again (the request as sent, its request id: `RunRequest`)
is kept in `<id>.request` until the response ends, beside the record rather than in it (a gateway
of an earlier version reads the record unchanged). A background response left queued or in
progress with its run lock free (its gateway died, or stopped and let it go) is taken over by
the next gateway that claims it (`unfinished` lists them), run again from the start, when its
event log holds no output yet (`resumable`: only `response.created` / `.in_progress`); one that
had written output cannot be reproduced exactly and is marked failed (`fail_if_abandoned`).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from services.gateway.shared_folder import RecordFolder, write_json_atomically
from shared.errors import FailedPrecondition, NotFound

ID_PREFIX = "resp_"
_ID = r"resp_[0-9a-f]{32}"


class ResponseStatus(StrEnum):
    QUEUED = "queued"  # background: accepted, not yet started
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # stopped at max_output_tokens
    FAILED = "failed"
    CANCELLED = "cancelled"  # background only


# OpenAI's response life; the four without successors are final
ALLOWED: dict[ResponseStatus, frozenset[ResponseStatus]] = {
    ResponseStatus.QUEUED: frozenset(
        {ResponseStatus.IN_PROGRESS, ResponseStatus.FAILED, ResponseStatus.CANCELLED}
    ),
    ResponseStatus.IN_PROGRESS: frozenset(
        {
            ResponseStatus.COMPLETED,
            ResponseStatus.INCOMPLETE,
            ResponseStatus.FAILED,
            ResponseStatus.CANCELLED,
        }
    ),
    ResponseStatus.COMPLETED: frozenset(),
    ResponseStatus.INCOMPLETE: frozenset(),
    ResponseStatus.FAILED: frozenset(),
    ResponseStatus.CANCELLED: frozenset(),
}

ABANDONED = "the gateway running this response stopped before it finished; create it again"
# the events after which a response's stream has nothing more
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
# the events a run writes before any output: a response whose log holds only these can run again
PREAMBLE_EVENTS = frozenset({"response.created", "response.queued", "response.in_progress"})
# runs of one background response at most: one that every gateway running it took down (or lost)
# before it wrote output is not tried for ever
MAX_RUNS = 3


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str  # hash of the API key that created it; "" with keys off
    created_at: int  # unix time (s)
    body: dict[str, Any]  # the Response object as the API shows it (its status is `status`)
    input_items: tuple[dict[str, Any], ...]  # this request's input, as items with ids
    context: tuple[dict[str, Any], ...] = ()  # the conversation through this response's output
    background: bool = False

    @property
    def status(self) -> ResponseStatus:
        return ResponseStatus(self.body["status"])

    @property
    def final(self) -> bool:
        return not ALLOWED[self.status]

    def _may_become(self, to: ResponseStatus) -> None:
        if to not in ALLOWED[self.status]:
            raise FailedPrecondition(f"response {self.id} is {self.status.value}; it cannot be {to.value}")

    def moved(self, to: ResponseStatus, **changes: Any) -> StoredResponse:
        """The record in status `to`, with `changes` to its Response object (FailedPrecondition
        when the transition is not allowed)."""
        self._may_become(to)
        return replace(self, body={**self.body, **changes, "status": to.value})

    def finished(self, body: dict[str, Any]) -> StoredResponse:
        """The record with the Response `body` of its finished run, and its output appended to
        the conversation."""
        done = replace(self, body={**body, "id": self.id, "background": self.background, "store": True})
        self._may_become(ResponseStatus(body["status"]))
        return replace(done, context=self.context + tuple(as_input_item(item) for item in body["output"]))


def as_input_item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as a later request's input item (the same shape, without its status)."""
    return {k: v for k, v in item.items() if k != "status"}


def new_response_id() -> str:
    return ID_PREFIX + uuid.uuid4().hex


@dataclass(frozen=True)
class RunRequest:
    """What a background response's run needs to run again on any gateway: the Responses request
    as sent (JSON), the request id its output items are named by, and its Response's created_at
    (unix s)."""

    body: dict[str, Any]
    request_id: str
    created: int
    runs: int = 1  # runs started so far (the first, and one per take-over)


def _record(value: dict[str, Any]) -> StoredResponse:
    value = dict(value)
    value["input_items"] = tuple(value.get("input_items", ()))
    value["context"] = tuple(value.get("context", ()))
    return StoredResponse(**value)


class ResponseStore(RecordFolder[StoredResponse]):
    """The records under `root`."""

    SUFFIXES = (".json", ".events", ".lock", ".run", ".request")

    def __init__(self, root: Path) -> None:
        super().__init__(root, "response", _ID, _record, asdict)

    def get(self, response_id: str, owner: str) -> StoredResponse:
        """The record, as another owner's or a missing one: NotFound. A record that a dead
        gateway left unfinished, and that cannot run again, is marked failed first."""
        record = super().get(response_id, owner)
        return record if record.final else self.fail_if_abandoned(response_id)

    def fail_if_abandoned(self, response_id: str) -> StoredResponse:
        """The record; when it is unfinished, nobody holds its run lock (its gateway died or let
        it go) and it cannot run again (`resumable`), it becomes failed first. One that can is
        left as it is, for a gateway's poll to take over."""
        with self.claim(response_id) as got:
            if not got:
                return self.read(response_id)  # it runs somewhere
            record = self.read(response_id)
            if record.final or self.resumable(response_id) is not None:
                return record
            return self.fail_abandoned(response_id)

    def fail_abandoned(self, response_id: str) -> StoredResponse:
        """Marks an unfinished record failed as abandoned (the caller holds its run lock)."""
        record = self.update(response_id, _abandoned)
        self.drop_request(response_id)
        return record

    # --- background runs that a gateway left ---
    def keep_request(self, response_id: str, request: RunRequest) -> None:
        write_json_atomically(self.path(response_id, ".request"), asdict(request))

    def run_request(self, response_id: str) -> RunRequest | None:
        """The response's kept request; None when there is none (it ended, or an earlier
        version of the gateway made it)."""
        try:
            value = json.loads(self.path(response_id, ".request").read_text(encoding="utf-8"))
            return RunRequest(**value)
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def drop_request(self, response_id: str) -> None:
        """The response ended: nothing runs it again."""
        self.path(response_id, ".request").unlink(missing_ok=True)

    def resumable(self, response_id: str) -> RunRequest | None:
        """The request to run the response again from the start, when that reproduces what a
        client may have seen: its event log holds no output yet (only PREAMBLE_EVENTS); None
        when it does, when no request is kept, or when it ran MAX_RUNS times already. The caller
        holds the run lock (the log does not grow meanwhile)."""
        logged, _ = self.events_from(response_id, 0)
        if any(event.get("type") not in PREAMBLE_EVENTS for event in logged):
            return None
        request = self.run_request(response_id)
        return None if request is None or request.runs >= MAX_RUNS else request

    def unfinished(self) -> list[str]:
        """Ids of the background responses with a kept request (not ended, or ended a moment
        ago), oldest first: what a gateway's poll tries to claim. Costs a directory listing, not
        a read per stored response (most have ended)."""
        found = []
        for path in self.dir.glob("*.request"):
            response_id = path.name.removesuffix(".request")
            with contextlib.suppress(FileNotFoundError, NotFound):
                self.path(response_id)  # NotFound: not a response id
                found.append((path.stat().st_mtime_ns, response_id))
        return [response_id for _, response_id in sorted(found)]

    def event_log(self, response_id: str, next_sequence: int = 0) -> EventLog:
        """The response's log to append to; `next_sequence`: the sequence_number after the last
        event logged already (a run taken over continues its numbering)."""
        return EventLog(self.path(response_id, ".events"), next_sequence)

    def events_from(self, response_id: str, offset: int) -> tuple[list[dict[str, Any]], int]:
        """The events written after byte `offset` of the response's event log, and the offset
        after them; a line being written (no newline yet) is left for the next read."""
        try:
            with self.path(response_id, ".events").open("rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1
        return [json.loads(line) for line in data[:end].splitlines() if line], offset + end

    def prune(self, now: float, retention_s: float) -> list[str]:
        """Removes the records created more than `retention_s` ago (an unfinished one once it is
        abandoned); returns their ids. 0 keeps every record."""
        if retention_s <= 0:
            return []
        gone = []
        for response_id in self.ids():
            with contextlib.suppress(FileNotFoundError, ValueError, TypeError, KeyError, NotFound):
                record = self.read(response_id)
                if record.created_at + retention_s > now:
                    continue
                if not record.final and not self.fail_if_abandoned(response_id).final:
                    continue  # still running
                self.remove(response_id)
                gone.append(response_id)
        return gone


def _abandoned(record: StoredResponse) -> StoredResponse:
    if record.final:
        return record
    return record.moved(ResponseStatus.FAILED, error={"code": "server_error", "message": ABANDONED})


class EventLog:
    """Appends a background response's events to its log, a JSON line each, flushed (a reader
    sees whole lines; a crash loses at most the line being written)."""

    def __init__(self, path: Path, next_sequence: int = 0) -> None:
        self._file = path.open("a", encoding="utf-8")
        self.next_sequence = next_sequence  # the sequence_number after the last event written

    def write(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()
        self.next_sequence = int(event.get("sequence_number", self.next_sequence)) + 1

    def close(self) -> None:
        self._file.close()
