"""The Files API's store: the files the Batch API reads (uploaded with purpose "batch") and writes
(a batch's output and error files, purpose "batch_output"), on disk under the gateway's
--batch-dir as `files/<id>` (the bytes) and `files/<id>.json` (the record, written atomically).

Every call reads the disk, so gateway processes sharing the folder (`pdserve up --gateways N`,
pods on one volume) see the same files. A file belongs to the API key that made it (`owner`: a
hash of the key, "" with keys off): another owner's file is not found. Ids are checked against
their shape before any path is built from them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from services.gateway.shared_folder import RecordFolder
from services.gateway.validation import InvalidField

ID_PREFIX = "file-"
_ID = r"file-[0-9a-f]{32}"
UPLOAD_PURPOSES = ("batch",)  # what a client may upload
OUTPUT_PURPOSE = "batch_output"  # what a batch writes
_COPY_CHUNK = 1 << 20  # bytes per read while storing an upload


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int  # size (bytes)
    created_at: int  # unix time (s)
    filename: str
    purpose: str
    owner: str  # hash of the API key that made it; "" with keys off
    expires_at: int | None = None  # unix time (s) after which it is deleted (OpenAI's expires_after)

    def body(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": self.expires_at,
            "status_details": None,
        }


# OpenAI's bounds of expires_after / output_expires_after seconds (anchor created_at)
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 24 * 3600


def expires_after(anchor: object, seconds: object, param: str) -> int | None:
    """OpenAI's `{"anchor": "created_at", "seconds": N}` as N (None when neither is given)."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidField(f"{param}.anchor must be 'created_at'", param)
    try:
        value = int(str(seconds))
    except ValueError:
        value = -1
    if not MIN_EXPIRES_AFTER_S <= value <= MAX_EXPIRES_AFTER_S:
        raise InvalidField(
            f"{param}.seconds must be an integer from {MIN_EXPIRES_AFTER_S} to {MAX_EXPIRES_AFTER_S}",
            param,
        )
    return value


def too_large(max_bytes: int) -> str:
    return (
        f"the file is larger than {max_bytes} bytes, this server's limit (--max-batch-file-bytes); "
        "split the batch"
    )


def _file_record(value: dict[str, Any]) -> FileRecord:
    return FileRecord(**value)


def new_file_id() -> str:
    return ID_PREFIX + uuid.uuid4().hex


class FileStore(RecordFolder[FileRecord]):
    """The files under `root/files`."""

    SUFFIXES = (".json", "")  # the record first: gone for readers before the bytes

    def __init__(self, root: Path) -> None:
        super().__init__(root / "files", "file", _ID, _file_record, asdict)

    def data_path(self, file_id: str) -> Path:
        """Where a file's bytes are (the batch runner appends its output there)."""
        return self.path(file_id, "")

    def add(
        self,
        source: BinaryIO,
        filename: str,
        purpose: str,
        owner: str,
        max_bytes: int,
        expires_after_s: int | None = None,
    ) -> FileRecord:
        """Stores an upload; INVALID_ARGUMENT past `max_bytes` (nothing is kept then)."""
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidField(
                f"purpose {purpose!r} is not served: this server stores files for the Batch API "
                f"(purpose {' or '.join(repr(p) for p in UPLOAD_PURPOSES)})",
                "purpose",
            )
        file_id = new_file_id()
        path = self.data_path(file_id)
        size = 0
        try:
            with path.open("wb") as out:
                while chunk := source.read(_COPY_CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise InvalidField(too_large(max_bytes), "file")
                    out.write(chunk)
            return self.seal(file_id, filename, purpose, owner, expires_after_s)
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise

    def seal(
        self, file_id: str, filename: str, purpose: str, owner: str, expires_after_s: int | None = None
    ) -> FileRecord:
        """Writes the record of a file whose bytes are in place (an upload, a batch's output);
        `expires_after_s`: deleted that long after now (s), else as --batch-retention-s says."""
        path = self.data_path(file_id)
        now = int(time.time())
        expires_at = None if expires_after_s is None else now + expires_after_s
        record = FileRecord(file_id, path.stat().st_size, now, filename, purpose, owner, expires_at)
        self.create(record)
        return record

    def list(self, owner: str | None, purpose: str | None = None) -> list[FileRecord]:
        """The owner's files (None: everyone's), newest first."""
        records = [r for r in self.records() if owner in (None, r.owner) and purpose in (None, r.purpose)]
        return sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)

    def delete(self, file_id: str, owner: str) -> None:
        self.get(file_id, owner)
        self.remove(file_id)
