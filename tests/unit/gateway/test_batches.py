"""The Batch API's domain without HTTP: input files checked line by line, the batch life's
transitions, and the runner over a fake answer (the real HTTP app answers in the integration
tests): results split into output and error files, 429/503 tried again, a cancel and the window's
end stop a batch in flight, a batch resumed from its files runs only what they lack, and two
runners on one folder never run the same batch."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from services.gateway.batch_files import FileRecord, FileStore, expires_after, new_file_id
from services.gateway.batch_input import parse_input
from services.gateway.batch_retention import Expired, expired
from services.gateway.batch_runner import BatchRunner, RunnerSettings
from services.gateway.batches import ALLOWED, BatchRecord, BatchStatus, BatchStore, new_batch_id
from services.gateway.validation import InvalidField
from shared.errors import FailedPrecondition
from tests.support.prom import sample_total

CHAT = "/v1/chat/completions"
FAST = RunnerSettings(concurrency=4, priority=10, max_lines=100, poll_s=0.05, retry_max_s=0.01)


def line(custom_id: str, url: str = CHAT, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"messages": [], **body}}


def jsonl(*lines: dict[str, Any] | str) -> bytes:
    return "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines).encode() + b"\n"


# --- the input file ---
def test_an_input_file_is_checked_line_by_line() -> None:
    data = jsonl(
        line("a"),
        "",
        "not json",
        line("a"),
        line("b", url="/v1/completions"),
        {**line("c"), "method": "GET"},
        line("d", stream=True),
        {"custom_id": "", "method": "POST", "url": CHAT, "body": {}},
        {"custom_id": "e", "method": "POST", "url": CHAT, "body": []},
    )
    _, errors = parse_input(data, CHAT, max_lines=100)
    assert [(e.line, e.code, e.param) for e in errors] == [
        (3, "invalid_json_line", None),
        (4, "duplicate_custom_id", "custom_id"),
        (5, "mismatched_endpoint", "url"),
        (6, "invalid_method", "method"),
        (7, "invalid_body", "body.stream"),
        (8, "invalid_custom_id", "custom_id"),
        (9, "invalid_body", "body"),
    ]
    good, none = parse_input(jsonl(line("a"), line("b", max_tokens=3)), CHAT, max_lines=100)
    assert none == [] and [(x.line, x.custom_id, x.body.get("max_tokens")) for x in good] == [
        (1, "a", None),
        (2, "b", 3),
    ]
    assert [e.code for e in parse_input(b"\n \n", CHAT, 100)[1]] == ["empty_file"]
    assert [e.code for e in parse_input(jsonl(line("a"), line("b")), CHAT, 1)[1]] == ["too_many_requests"]
    assert [e.code for e in parse_input(b"\xff\xfe\n", CHAT, 1)[1]] == ["invalid_json_line"]


def test_the_batch_life_allows_only_openais_transitions() -> None:
    record = _record("x")
    for status in BatchStatus:
        for to in BatchStatus:
            at = BatchRecord(**{**record.__dict__, "status": status})
            if to in ALLOWED[status]:
                assert at.moved(to, now=7).status == to and at.moved(to, now=7).times[to.value] == 7
            else:
                with pytest.raises(FailedPrecondition):
                    at.moved(to)
    final = {s for s in BatchStatus if not ALLOWED[s]}
    assert final == {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}


def _record(input_file_id: str, expires_at: int = 2**40) -> BatchRecord:
    return BatchRecord(
        id=new_batch_id(),
        owner="",
        endpoint=CHAT,
        input_file_id=input_file_id,
        completion_window="24h",
        created_at=1,
        expires_at=expires_at,
        output_file_id=new_file_id(),
        error_file_id=new_file_id(),
    )


# --- the runner ---
class FakeAnswer:
    """Answers each request by its body's `answer` (a list of statuses, one per try), else 200;
    once `hold()` is called, a request finishes only when `release()` lets it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.tries: dict[str, int] = {}
        self.gate: asyncio.Semaphore | None = None
        self.aborted = 0

    def hold(self) -> None:
        self.gate = asyncio.Semaphore(0)

    def release(self, n: int = 1_000_000) -> None:
        assert self.gate is not None
        for _ in range(n):
            self.gate.release()

    async def __call__(
        self, endpoint: str, body: dict[str, Any], request_id: str
    ) -> tuple[int, dict[str, Any]]:
        self.calls.append((request_id, body))
        key = json.dumps(body, sort_keys=True)
        tries = self.tries[key] = self.tries.get(key, 0) + 1
        try:
            if self.gate is not None:
                await self.gate.acquire()
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        statuses = body.get("answer", [200])
        status = statuses[min(tries, len(statuses)) - 1]
        return status, {"echo": body.get("n"), "error": None if status == 200 else {"message": "no"}}


class Folder:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = FileStore(root)
        self.batches = BatchStore(root)

    def submit(self, data: bytes, expires_at: int = 2**40) -> str:
        path = self.root / "input.jsonl"
        path.write_bytes(data)
        with path.open("rb") as f:
            source = self.files.add(f, "input.jsonl", "batch", "", 1 << 20)
        record = _record(source.id, expires_at)
        self.batches.create(record)
        return record.id

    def results(self, batch_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        record = self.batches.read(batch_id)
        out: dict[str, Any] = {}
        err: dict[str, Any] = {}
        for file_id, into in ((record.output_file_id, out), (record.error_file_id, err)):
            path = self.files.data_path(file_id)
            for raw in path.read_text().splitlines() if path.exists() else ():
                value = json.loads(raw)
                assert value["custom_id"] not in into, "a request written twice"
                into[value["custom_id"]] = value
        return out, err


@pytest.fixture
def folder(tmp_path: Path) -> Folder:
    return Folder(tmp_path)


@pytest_asyncio.fixture
async def runner(folder: Folder) -> AsyncIterator[tuple[BatchRunner, FakeAnswer]]:
    answer = FakeAnswer()
    running = BatchRunner(folder.files, folder.batches, answer, FAST)
    running.start()
    yield running, answer
    await running.close()


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.01)


def status_of(folder: Folder, batch_id: str) -> BatchStatus:
    return folder.batches.read(batch_id).status


async def run_to_completion(folder: Folder, answer: FakeAnswer, batch_id: str) -> None:
    """A runner on `folder` (a gateway started after another), closed once the batch completed."""
    running = BatchRunner(folder.files, folder.batches, answer, FAST)
    running.start()
    try:
        await until(lambda: status_of(folder, batch_id) == BatchStatus.COMPLETED)
    finally:
        await running.close()
    await asyncio.sleep(0)  # what close cancelled ends
    # nothing of the run is left waiting (a task left pending is destroyed pending, and logged)
    assert [t for t in asyncio.all_tasks() if "Event.wait" in repr(t.get_coro()) and not t.done()] == []


async def test_results_go_to_the_output_and_error_files_and_overload_is_tried_again(
    folder: Folder, runner: tuple[BatchRunner, FakeAnswer]
) -> None:
    running, answer = runner
    before = {o: sample_total("pdserve_batch_requests_total", outcome=o) for o in ("completed", "failed")}
    ended = sample_total("pdserve_batches_total", status="completed")
    batch_id = folder.submit(
        jsonl(line("ok", n=1), line("bad", n=2, answer=[400]), line("busy", n=3, answer=[429, 503, 200]))
    )
    running.wake()
    await until(lambda: status_of(folder, batch_id) == BatchStatus.COMPLETED)
    assert sample_total("pdserve_batch_requests_total", outcome="completed") == before["completed"] + 2
    assert sample_total("pdserve_batch_requests_total", outcome="failed") == before["failed"] + 1
    assert sample_total("pdserve_batches_total", status="completed") == ended + 1
    await until(lambda: sample_total("pdserve_batches_running") == 0)  # it ran, and is no more
    record = folder.batches.read(batch_id)
    assert (record.total, record.completed, record.failed) == (3, 2, 1)
    out, err = folder.results(batch_id)
    assert sorted(out) == ["busy", "ok"] and list(err) == ["bad"]
    assert out["ok"]["response"]["status_code"] == 200 and out["ok"]["response"]["body"]["echo"] == 1
    assert err["bad"]["response"]["status_code"] == 400 and err["bad"]["error"] is None
    assert len([c for c in answer.calls if c[1].get("n") == 3]) == 3  # 429, 503, then 200
    assert all(body["priority"] == FAST.priority for _, body in answer.calls)  # batches yield
    body = record.body()
    assert body["output_file_id"] == record.output_file_id and body["error_file_id"] == record.error_file_id
    assert body["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert folder.files.get(record.output_file_id, "").purpose == "batch_output"
    assert body["completed_at"] and body["in_progress_at"] and body["finalizing_at"]


async def test_a_bad_input_file_fails_the_batch_before_any_request(
    folder: Folder, runner: tuple[BatchRunner, FakeAnswer]
) -> None:
    running, answer = runner
    batch_id = folder.submit(jsonl(line("a"), line("a")))
    running.wake()
    await until(lambda: status_of(folder, batch_id) == BatchStatus.FAILED)
    body = folder.batches.read(batch_id).body()
    assert (
        body["errors"]["data"][0]["code"] == "duplicate_custom_id" and body["errors"]["data"][0]["line"] == 2
    )
    assert answer.calls == [] and body["output_file_id"] is None


async def test_a_cancel_aborts_the_requests_in_flight_and_keeps_what_was_done(
    folder: Folder, runner: tuple[BatchRunner, FakeAnswer]
) -> None:
    running, answer = runner
    batch_id = folder.submit(jsonl(*(line(f"r{i}", n=i) for i in range(10))))
    answer.hold()
    running.wake()
    await until(lambda: len(answer.calls) == FAST.concurrency)  # the slots are full, all held
    answer.release(3)
    await until(lambda: len(answer.calls) == 3 + FAST.concurrency)
    folder.batches.update(batch_id, lambda r: r.moved(BatchStatus.CANCELLING))
    running.cancelled(batch_id)
    await until(lambda: status_of(folder, batch_id) == BatchStatus.CANCELLED)
    record = folder.batches.read(batch_id)
    out, err = folder.results(batch_id)
    assert answer.aborted == FAST.concurrency and len(out) == record.completed == 3 and err == {}
    assert record.completed < 10 and record.body()["cancelled_at"] is not None


async def test_requests_not_done_by_the_end_of_the_window_expire(folder: Folder) -> None:
    now = [1000.0]
    answer = FakeAnswer()
    running = BatchRunner(folder.files, folder.batches, answer, FAST, clock=lambda: now[0])
    batch_id = folder.submit(jsonl(*(line(f"r{i}", n=i) for i in range(8))), expires_at=1010)
    answer.hold()
    running.start()
    try:
        await until(lambda: len(answer.calls) == FAST.concurrency)
        now[0] = 1011.0  # the window ends with 4 in flight and 4 never sent
        await until(lambda: status_of(folder, batch_id) == BatchStatus.EXPIRED)
    finally:
        await running.close()
    record = folder.batches.read(batch_id)
    out, err = folder.results(batch_id)
    assert out == {} and len(err) == 8 and {e["error"]["code"] for e in err.values()} == {"batch_expired"}
    assert (record.failed, record.expired) == (8, 8) and record.body()["expired_at"] is not None


async def test_a_resumed_batch_runs_only_what_its_files_lack(folder: Folder) -> None:
    batch_id = folder.submit(jsonl(*(line(f"r{i}", n=i) for i in range(6))))
    record = folder.batches.update(batch_id, lambda r: r.moved(BatchStatus.IN_PROGRESS))
    # a gateway died after answering r0 (output) and r1 (error), in the middle of writing r2
    done = [{"custom_id": "r0", "response": {"status_code": 200}}, {"custom_id": "r1", "error": None}]
    folder.files.data_path(record.output_file_id).write_text(
        json.dumps(done[0]) + "\n" + '{"custom_id": "r2", "resp'
    )
    folder.files.data_path(record.error_file_id).write_text(json.dumps(done[1]) + "\n")
    answer = FakeAnswer()
    await run_to_completion(folder, answer, batch_id)
    assert sorted(body["n"] for _, body in answer.calls) == [2, 3, 4, 5]
    out, err = folder.results(batch_id)  # each request once
    assert sorted(out) == ["r0", "r2", "r3", "r4", "r5"] and list(err) == ["r1"]
    record = folder.batches.read(batch_id)
    assert (record.completed, record.failed) == (5, 1)


async def test_two_runners_on_one_folder_never_run_the_same_batch(folder: Folder) -> None:
    first, second = FakeAnswer(), FakeAnswer()
    one = BatchRunner(folder.files, folder.batches, first, FAST)
    two = BatchRunner(folder.files, folder.batches, second, FAST)
    batch_id = folder.submit(jsonl(*(line(f"r{i}", n=i) for i in range(6))))
    first.hold()
    one.start()
    await until(lambda: len(first.calls) == FAST.concurrency)
    two.start()
    await asyncio.sleep(FAST.poll_s * 4)
    assert second.calls == []  # the first holds the batch
    await one.close()  # as if its gateway stopped: the second takes over
    try:
        await until(lambda: status_of(folder, batch_id) == BatchStatus.COMPLETED)
    finally:
        await two.close()
    out, _ = folder.results(batch_id)
    assert sorted(out) == [f"r{i}" for i in range(6)] and len(second.calls) == 6


def test_the_scan_lists_unfinished_batches_and_reads_a_final_one_once(folder: Folder) -> None:
    done, running = folder.submit(jsonl(line("a"))), folder.submit(jsonl(line("b")))
    folder.batches.update(done, lambda r: r.moved(BatchStatus.FAILED))
    assert folder.batches.unfinished() == [running]
    path = folder.root / "batches" / f"{done}.json"
    stamp = path.stat()
    path.write_text("not read again")  # the same mtime: the final record is not parsed again
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert folder.batches.unfinished() == [running]
    folder.batches.update(running, lambda r: r.moved(BatchStatus.CANCELLING))
    assert folder.batches.unfinished() == [running]  # cancelling is not over yet


# --- retention ---
def test_retention_lets_finished_batches_and_unused_uploads_go() -> None:
    day = 86_400
    old_done = BatchRecord(
        **{**_record("file-in-old").__dict__, "status": BatchStatus.COMPLETED, "times": {"completed": 10}}
    )
    new_done = BatchRecord(
        **{
            **_record("file-in-new").__dict__,
            "status": BatchStatus.CANCELLED,
            "times": {"cancelled": 5 * day},
        }
    )
    running = BatchRecord(**{**_record("file-in-run").__dict__, "created_at": 0})
    uploads = [
        FileRecord(f, 1, 0, "in.jsonl", "batch", "") for f in ("file-in-old", "file-in-new", "file-in-run")
    ]
    gone = expired([old_done, new_done, running], uploads, now=5 * day, retention_s=2 * day)
    assert gone.batch_ids == (old_done.id,)  # ended long ago; the other ended just now, one runs
    # the old batch's results, and the uploads no unfinished batch reads
    assert set(gone.file_ids) == {
        old_done.output_file_id,
        old_done.error_file_id,
        "file-in-old",
        "file-in-new",
    }
    assert expired([old_done], uploads, now=5 * day, retention_s=0) == Expired((), ())  # 0: forever
    # a file whose client asked for an expiry goes then, retention or not, unless a batch reads it
    asked = [FileRecord(f, 1, 0, "x", "batch", "", expires_at=day) for f in ("file-asked", "file-in-run")]
    for retention_s in (0, 30 * day):
        assert expired([running], asked, now=day, retention_s=retention_s).file_ids == ("file-asked",)
    assert expired([running], asked, now=day - 1, retention_s=0).file_ids == ()


@pytest.mark.parametrize(
    ("anchor", "seconds", "ok"),
    [
        ("created_at", 3600, True),
        ("created_at", "86400", True),
        (None, None, True),
        ("created_at", 59, False),
        ("created_at", 31 * 86_400, False),
        ("last_active_at", 3600, False),
        ("created_at", "soon", False),
    ],
)
def test_expires_after_is_openais(anchor: object, seconds: object, ok: bool) -> None:
    if ok:
        assert expires_after(anchor, seconds, "expires_after") == (
            None if seconds is None else int(str(seconds))
        )
    else:
        with pytest.raises(InvalidField) as err:
            expires_after(anchor, seconds, "expires_after")
        assert err.value.param == "expires_after"


async def test_the_runner_deletes_what_retention_let_go(folder: Folder) -> None:
    now = [1_000.0]
    answer = FakeAnswer()
    settings = dataclasses.replace(FAST, retention_s=100.0, prune_every_s=0.0)
    running = BatchRunner(folder.files, folder.batches, answer, settings, clock=lambda: now[0])
    batch_id = folder.submit(jsonl(line("a")))
    running.start()
    try:
        await until(lambda: status_of(folder, batch_id) == BatchStatus.COMPLETED)
        record = folder.batches.read(batch_id)
        kept = {f.id for f in folder.files.list(None)}
        assert {record.input_file_id, record.output_file_id} <= kept
        now[0] = time.time() + 101  # past the retention of what it wrote (time-stamped now)
        running.wake()
        await until(lambda: not folder.files.list(None) and not folder.batches.all())
    finally:
        await running.close()
    assert not folder.files.data_path(record.output_file_id).exists()
    assert sorted(p.name for p in (folder.root / "batches").iterdir()) == []


async def test_a_drain_lets_the_requests_in_flight_finish_and_leaves_the_rest(folder: Folder) -> None:
    """SIGTERM: no new request is sent, those in flight are answered and written within the
    grace, the batch stays in progress; the next runner sends only what is left."""
    answer = FakeAnswer()
    first = BatchRunner(folder.files, folder.batches, answer, FAST)
    batch_id = folder.submit(jsonl(*(line(f"r{i}", n=i) for i in range(10))))
    answer.hold()
    first.start()
    await until(lambda: len(answer.calls) == FAST.concurrency)
    draining = asyncio.ensure_future(first.drain(grace_s=10.0))
    await asyncio.sleep(FAST.poll_s * 2)
    answer.release()  # the 4 in flight are answered during the grace
    await draining
    assert len(answer.calls) == FAST.concurrency and answer.aborted == 0  # none sent after SIGTERM
    record = folder.batches.read(batch_id)
    assert record.status == BatchStatus.IN_PROGRESS and record.completed == FAST.concurrency
    successor = FakeAnswer()
    await run_to_completion(folder, successor, batch_id)
    assert len(successor.calls) == 10 - FAST.concurrency
    out, _ = folder.results(batch_id)
    assert sorted(out) == sorted(f"r{i}" for i in range(10))
