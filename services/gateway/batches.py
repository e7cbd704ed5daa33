"""The Batch API's batches: one record per batch (its status, with the transitions allowed,
request counts, times and files) and their store on disk under --batch-dir as
`batches/<id>.json`.

Several gateway processes may share the folder: a record is changed only by `BatchStore.update`
(shared_folder.RecordFolder), a read-modify-write under an exclusive lock on
`batches/<id>.lock`, so a cancel from one process and the counts of the process running the
batch never overwrite each other. The process that runs a batch holds `batches/<id>.run`
locked (`claim`); the lock goes with its process, so when a gateway dies another one (or the
same, restarted) claims and resumes the batch.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TextIO

from services.gateway.shared_folder import RecordFolder
from shared.errors import FailedPrecondition

ID_PREFIX = "batch_"
_ID = r"batch_[0-9a-f]{32}"
COMPLETION_WINDOW_S = {"24h": 24 * 3600}  # the windows OpenAI accepts (s)


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"  # the input did not validate
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# OpenAI's batch life; the four without successors are final
ALLOWED: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset({BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLING}),
    BatchStatus.IN_PROGRESS: frozenset({BatchStatus.FINALIZING, BatchStatus.CANCELLING}),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED, BatchStatus.EXPIRED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}


@dataclass(frozen=True)
class LineError:
    """Why the input file did not validate (OpenAI's batch `errors.data` entry)."""

    code: str
    message: str
    line: int | None = None  # 1-based line of the input file
    param: str | None = None


@dataclass(frozen=True)
class BatchRecord:
    id: str
    owner: str  # hash of the API key that created it; "" with keys off
    endpoint: str  # e.g. /v1/chat/completions
    input_file_id: str
    completion_window: str
    created_at: int  # unix time (s), as every *_at
    expires_at: int
    output_file_id: str  # chosen at creation; shown once the batch is over
    error_file_id: str
    metadata: dict[str, str] = field(default_factory=dict)
    output_expires_after_s: int | None = None  # the output and error files' lifetime (s)
    status: BatchStatus = BatchStatus.VALIDATING
    times: dict[str, int] = field(default_factory=dict)  # status -> when it was entered
    total: int = 0  # requests (lines) in the input
    completed: int = 0  # requests answered 2xx
    failed: int = 0  # requests answered otherwise (or not run before the window ended)
    expired: int = 0  # of the failed: not run before the window ended (the batch ends expired)
    errors: tuple[LineError, ...] = ()

    @property
    def final(self) -> bool:
        return not ALLOWED[self.status]

    @property
    def file_ids(self) -> tuple[str, str, str]:
        """The files it reads or writes: input, output, error."""
        return self.input_file_id, self.output_file_id, self.error_file_id

    @property
    def ended_at(self) -> int | None:
        """When the batch became final (unix s); None while it is not."""
        return self.times.get(self.status.value) if self.final else None

    def moved(self, to: BatchStatus, now: int | None = None) -> BatchRecord:
        if to not in ALLOWED[self.status]:
            raise FailedPrecondition(f"batch {self.id} is {self.status.value}; it cannot become {to.value}")
        when = int(time.time()) if now is None else now
        return replace(self, status=to, times=self.times | {to.value: when})

    def body(self) -> dict[str, Any]:
        """OpenAI's Batch object. The output file is shown once the batch is over and answered
        some requests, the error file once it is over and some failed."""
        over = self.final and self.status != BatchStatus.FAILED
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": ({"object": "list", "data": [asdict(e) for e in self.errors]} if self.errors else None),
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.value,
            "output_file_id": self.output_file_id if over and self.completed else None,
            "error_file_id": self.error_file_id if over and self.failed else None,
            "created_at": self.created_at,
            "in_progress_at": self.times.get(BatchStatus.IN_PROGRESS.value),
            "expires_at": self.expires_at,
            "finalizing_at": self.times.get(BatchStatus.FINALIZING.value),
            "completed_at": self.times.get(BatchStatus.COMPLETED.value),
            "failed_at": self.times.get(BatchStatus.FAILED.value),
            "expired_at": self.times.get(BatchStatus.EXPIRED.value),
            "cancelling_at": self.times.get(BatchStatus.CANCELLING.value),
            "cancelled_at": self.times.get(BatchStatus.CANCELLED.value),
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata or None,
        }


def _record(value: dict[str, Any]) -> BatchRecord:
    value = dict(value)
    value["status"] = BatchStatus(value["status"])
    value["errors"] = tuple(LineError(**e) for e in value.get("errors", ()))
    return BatchRecord(**value)


def new_batch_id() -> str:
    return ID_PREFIX + uuid.uuid4().hex


class BatchStore(RecordFolder[BatchRecord]):
    """The records under `root/batches`."""

    SUFFIXES = (".json", ".lock", ".run")

    def __init__(self, root: Path) -> None:
        super().__init__(root / "batches", "batch", _ID, _record, asdict)
        self._final_seen: dict[str, int] = {}  # record file -> its mtime (ns) when seen final

    def all(self) -> list[BatchRecord]:
        """Every batch, oldest first (records being written are skipped)."""
        return sorted(self.records(), key=lambda r: (r.created_at, r.id))

    def unfinished(self) -> list[str]:
        """Ids of the batches not yet over, oldest first: what a runner looks for every poll. A
        record seen final is not read again while its file is unchanged (a folder of many old
        batches costs a stat each)."""
        ids = []
        for path in self.record_files():
            try:
                mtime = path.stat().st_mtime_ns
                if self._final_seen.get(path.name) == mtime:
                    continue
                record = self.load(path)
            except (FileNotFoundError, ValueError, TypeError, KeyError):
                continue  # being written, or gone
            if record.final:
                self._final_seen[path.name] = mtime
            else:
                ids.append((record.created_at, record.id))
        return [batch_id for _, batch_id in sorted(ids)]

    def remove(self, batch_id: str) -> None:
        super().remove(batch_id)
        self._final_seen.pop(batch_id + ".json", None)


def append_line(out: TextIO, value: dict[str, Any]) -> None:
    """One JSON line of an output or error file, flushed (a crash loses at most the line being
    written, which resume cuts off)."""
    out.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")
    out.flush()
