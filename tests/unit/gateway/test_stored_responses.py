"""The stored responses' records and their folder (services/gateway/stored_responses.py): the
status transitions, a finished run's output appended to the conversation, owners, a record left
unfinished by a gateway that died (its run lock free) marked failed when it had written output
and left to be run again when it had not, one still running left alone, and retention; and the
take-over of such a response by exactly one of two gateways' polls
(http_stored_responses.StoredResponses), its events numbered on in the same log."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from services.gateway import http_responses_api as responses_api
from services.gateway.http_stored_responses import Emit, Keeping, Produce, StoredResponses
from services.gateway.stored_responses import (
    ABANDONED,
    ALLOWED,
    MAX_RUNS,
    ResponseStatus,
    ResponseStore,
    RunRequest,
    StoredResponse,
    new_response_id,
)
from shared.auth import ApiKeys
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


REQUEST = RunRequest({"model": "", "input": "hi", "background": True}, "req0", 1_000)
CREATED = {"type": "response.created", "sequence_number": 0}
DELTA = {"type": "response.output_text.delta", "sequence_number": 2, "delta": "x"}


def _left(store: ResponseStore, logged: tuple[str, ...] = (), kept: bool = True) -> StoredResponse:
    """A background response in progress whose log holds events of the types `logged`, with its
    request kept (unless not `kept`: made by an earlier version of the gateway)."""
    record = _record(ResponseStatus.IN_PROGRESS, background=True)
    store.create(record)
    if kept:
        store.keep_request(record.id, REQUEST)
    log = store.event_log(record.id)
    for i, kind in enumerate(logged):
        log.write({"type": kind, "sequence_number": i})
    log.close()
    return record


def test_a_response_left_before_its_output_is_kept_to_run_again_once_nobody_runs_it(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    quiet = _left(store, ("response.created", "response.in_progress"))
    spoke = _left(store, ("response.created", "response.in_progress", "response.output_text.delta"))
    older = _left(store)
    older_kept_nothing = _left(store, kept=False)
    (tmp_path / "resp_x.request").write_text("{}")  # not a response id: never listed
    assert set(store.unfinished()) == {quiet.id, spoke.id, older.id}
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_run_lock, args=(str(tmp_path), quiet.id, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        assert store.get(quiet.id, "o1").status == ResponseStatus.IN_PROGRESS  # it runs elsewhere
        with store.claim(quiet.id) as got:
            assert not got
    finally:
        release.set()
        holder.join(30)
    # its gateway is gone: a read leaves it for a poll to take over, with what it needs
    assert store.get(quiet.id, "o1").status == ResponseStatus.IN_PROGRESS
    assert store.get(older.id, "o1").status == ResponseStatus.IN_PROGRESS  # nothing logged yet
    with store.claim(quiet.id) as mine:
        assert mine and store.resumable(quiet.id) == REQUEST
        log = store.event_log(quiet.id, 2)  # its numbering goes on
        log.write({**DELTA, "sequence_number": log.next_sequence})
        log.close()
    # once it has written output it cannot be run again: failed, its request dropped
    for record in (quiet, spoke, older_kept_nothing):
        failed = store.get(record.id, "o1")
        assert failed.status == ResponseStatus.FAILED and failed.body["error"]["message"] == ABANDONED
    assert store.unfinished() == [older.id]
    logged, _ = store.events_from(quiet.id, 0)
    assert [e["sequence_number"] for e in logged] == [0, 1, 2]
    store.remove(older.id)
    assert not list(tmp_path.glob(f"{older.id}*"))  # its request too


def _never(*args: Any) -> Any:
    raise AssertionError("nothing is taken over here")


def _gateway(tmp_path: Path, rerun: Any = _never, poll_s: float = 1.0) -> StoredResponses:
    return StoredResponses(FastAPI(), ApiKeys(), str(tmp_path), 0.0, 1 << 20, rerun, poll_s=poll_s)


async def test_of_two_gateways_polling_one_takes_a_left_response_over_and_numbers_its_events_on(
    tmp_path: Path,
) -> None:
    store = ResponseStore(tmp_path)
    record = _left(store, ("response.created",))  # its gateway died after its first event
    reruns: list[tuple[str, Any, str, str, int]] = []

    def rerun_on(name: str) -> Any:
        async def rerun(
            asked: responses_api.ResponsesRequest, keeping: Keeping, request_id: str, created: int
        ) -> Produce:
            assert keeping.record is not None
            reruns.append((name, asked.input, keeping.record.id, request_id, created))

            async def produce(emit: Emit) -> dict[str, Any]:
                emit(CREATED)
                emit({"type": "response.in_progress", "sequence_number": 1})
                await asyncio.sleep(0.2)  # the other gateway polls meanwhile: the run lock is held
                emit(DELTA)
                done = {"status": "completed", "output": []}
                emit({"type": "response.completed", "sequence_number": 3, "response": done})
                return done

            return produce

        return rerun

    gateways = [_gateway(tmp_path, rerun_on(name), poll_s=0.01) for name in ("a", "b")]
    for gateway in gateways:
        gateway.start()
    try:
        async with asyncio.timeout(10):
            while store.read(record.id).status != ResponseStatus.COMPLETED:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # more polls: nobody runs it again
    finally:
        for gateway in gateways:
            await gateway.close()
    assert [r[1:] for r in reruns] == [("hi", record.id, "req0", 1_000)]
    logged, _ = store.events_from(record.id, 0)
    assert [(e["type"], e["sequence_number"]) for e in logged] == [
        ("response.created", 0),  # the first gateway's; not written again
        ("response.in_progress", 1),
        ("response.output_text.delta", 2),
        ("response.completed", 3),
    ]
    assert store.unfinished() == []  # ended: its request dropped


async def test_each_take_over_counts_and_a_response_run_max_runs_times_is_not_run_again(
    tmp_path: Path,
) -> None:
    """A request that takes down (or loses) every gateway that runs it before it writes output
    is tried MAX_RUNS times in all, not for ever: each take-over counts in its kept request."""
    store = ResponseStore(tmp_path)
    record = _left(store, ("response.created",))
    started = asyncio.Event()

    async def rerun(*args: Any) -> Produce:
        async def produce(emit: Emit) -> dict[str, Any]:
            started.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        return produce

    gateway = _gateway(tmp_path, rerun, poll_s=0.01)
    gateway.start()
    try:
        async with asyncio.timeout(10):
            await started.wait()
        kept = store.run_request(record.id)
        assert kept is not None and kept.runs == 2  # the first run and this take-over
    finally:
        await gateway.close()
    worn = _left(store, ("response.created",))
    store.keep_request(worn.id, dataclasses.replace(REQUEST, runs=MAX_RUNS))
    assert store.resumable(worn.id) is None
    failed = store.get(worn.id, "o1")
    assert failed.status == ResponseStatus.FAILED and failed.body["error"]["message"] == ABANDONED
    assert store.run_request(worn.id) is None


async def test_a_stopping_gateway_lets_go_of_runs_without_output_and_fails_the_others(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    gateway = _gateway(tmp_path)
    spoke = asyncio.Event()

    async def waits(emit: Emit) -> dict[str, Any]:  # no first token yet
        emit(CREATED)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def speaks(emit: Emit) -> dict[str, Any]:
        emit(CREATED)
        emit({**DELTA, "sequence_number": 1})
        spoke.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def start(produce: Produce) -> str:
        record = _record(ResponseStatus.QUEUED, background=True)
        gateway.start_background(Keeping(record), {"status": "queued"}, produce, REQUEST)
        return record.id

    quiet, talking = start(waits), start(speaks)
    await spoke.wait()
    loop = asyncio.get_running_loop()
    began = loop.time()
    late = start(waits)  # its task has not started when the drain begins
    await gateway.drain(0.3)
    assert 0.3 <= loop.time() - began < 5  # the one with output had its grace, no more
    assert store.read(quiet).status == ResponseStatus.IN_PROGRESS  # let go, for another gateway
    assert store.read(late).status == ResponseStatus.QUEUED
    for left in (quiet, late):
        with store.claim(left) as free:
            assert free and store.resumable(left) == REQUEST
    failed = store.read(talking)
    assert failed.status == ResponseStatus.FAILED and "stopped" in failed.body["error"]["message"]
    assert set(store.unfinished()) == {quiet, late}
    assert json.loads((tmp_path / f"{quiet}.request").read_text())["request_id"] == "req0"
