"""The stored responses' records and their folder (services/gateway/stored_responses.py): the
status transitions, a finished run's output appended to the conversation, owners, a record left
unfinished by a gateway that died (its run lock free) marked failed, one still running left alone,
and retention."""

from __future__ import annotations

import dataclasses
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from services.gateway.stored_responses import (
    ABANDONED,
    ALLOWED,
    ResponseStatus,
    ResponseStore,
    StoredResponse,
    new_response_id,
)
from shared.errors import FailedPrecondition, NotFound

USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}], "id": "msg_0"}


def _record(status: ResponseStatus = ResponseStatus.IN_PROGRESS, **kw: Any) -> StoredResponse:
    fields: dict[str, Any] = {
        "id": new_response_id(),
        "owner": "o1",
        "created_at": 1_000,
        "body": {"status": status.value},
        "input_items": (USER,),
        "context": (USER,),
    }
    return StoredResponse(**(fields | kw))


def _done(status: str = "completed") -> dict[str, Any]:
    message = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": []}
    return {"id": "resp_other", "status": status, "output": [message], "store": False}


def test_transitions_are_openais_and_final_ones_end() -> None:
    assert {s for s in ResponseStatus if not ALLOWED[s]} == {
        ResponseStatus.COMPLETED,
        ResponseStatus.INCOMPLETE,
        ResponseStatus.FAILED,
        ResponseStatus.CANCELLED,
    }
    queued = _record(ResponseStatus.QUEUED)
    running = queued.moved(ResponseStatus.IN_PROGRESS)
    assert running.status == ResponseStatus.IN_PROGRESS and not running.final
    with pytest.raises(FailedPrecondition):
        queued.finished(_done())  # it never started
    done = running.finished(_done("incomplete"))
    assert done.final and done.body["id"] == done.id and done.body["store"] is True
    # the output item joins the conversation as an input item would (no status)
    assert done.context == (USER, {k: v for k, v in _done()["output"][0].items() if k != "status"})
    with pytest.raises(FailedPrecondition):
        done.moved(ResponseStatus.CANCELLED)
    failed = running.moved(ResponseStatus.FAILED, error={"code": "server_error", "message": "x"})
    assert failed.body["error"]["message"] == "x" and failed.final


def test_the_store_keeps_records_per_owner(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    record = _record().finished(_done())
    store.create(record)
    assert store.get(record.id, "o1") == record
    with pytest.raises(NotFound):
        store.get(record.id, "o2")  # another key's
    for bad in ("resp_../../etc", "resp_" + "0" * 32, "batch_x"):
        with pytest.raises(NotFound):
            store.get(bad, "o1")
    store.remove(record.id)
    with pytest.raises(NotFound):
        store.read(record.id)
    store.remove(record.id)  # gone twice: no error


def _hold_run_lock(root: str, response_id: str, ready: Any, release: Any) -> None:
    store = ResponseStore(Path(root))
    with store.claim(response_id) as got:
        assert got
        ready.set()
        release.wait(10)


def test_an_unfinished_record_is_failed_only_once_nobody_runs_it(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    record = _record(ResponseStatus.QUEUED, background=True)
    store.create(record)
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_run_lock, args=(str(tmp_path), record.id, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        # another process runs it: left alone (read, prune)
        assert store.get(record.id, "o1").status == ResponseStatus.QUEUED
        assert store.prune(now=10**10, retention_s=1) == []
        with store.claim(record.id) as got:
            assert not got
    finally:
        release.set()
        holder.join(30)
    # that process ended (as a gateway killed -9 would): the next read marks it failed
    failed = store.get(record.id, "o1")
    assert failed.status == ResponseStatus.FAILED and failed.body["error"]["message"] == ABANDONED
    # while this process runs it, a second claim here fails too (flock locks an open file)
    other = _record(ResponseStatus.QUEUED, background=True)
    store.create(other)
    with store.claim(other.id) as mine:
        assert mine and store.get(other.id, "o1").status == ResponseStatus.QUEUED


def test_retention_removes_old_records_only(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    old = _record(created_at=1_000).finished(_done())
    new = _record(created_at=5_000).finished(_done())
    stuck = dataclasses.replace(_record(ResponseStatus.QUEUED), created_at=1_000)
    for record in (old, new, stuck):
        store.create(record)
    assert store.prune(now=4_000, retention_s=0) == []  # 0 keeps everything
    assert sorted(store.prune(now=4_000, retention_s=2_000)) == sorted([old.id, stuck.id])
    assert store.ids() == [new.id]
    assert not list(tmp_path.glob(f"{old.id}*"))  # its lock files too


def test_the_event_log_is_read_in_whole_lines_from_where_a_reader_stopped(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    record = _record(ResponseStatus.QUEUED, background=True)
    store.create(record)
    assert store.events_from(record.id, 0) == ([], 0)  # nothing written yet
    log = store.event_log(record.id)
    log.write({"type": "response.created", "sequence_number": 0})
    log.write({"type": "response.in_progress", "sequence_number": 1})
    assert log.next_sequence == 2
    got, offset = store.events_from(record.id, 0)
    assert [e["sequence_number"] for e in got] == [0, 1]
    with (tmp_path / f"{record.id}.events").open("a") as f:
        f.write('{"type": "response.output_text.delta", "seq')  # a line being written
    assert store.events_from(record.id, offset) == ([], offset)
    with (tmp_path / f"{record.id}.events").open("a") as f:
        f.write('uence_number": 2}\n')
    more, _ = store.events_from(record.id, offset)
    assert more == [{"type": "response.output_text.delta", "sequence_number": 2}]
    log.close()
    store.remove(record.id)
    assert not list(tmp_path.glob(f"{record.id}*"))
