"""Records in a folder that several gateway processes share (the Batch API's batches and files,
stored responses, conversations): JSON written so that readers never see half of it, `flock`
locks that go with the process holding them (a gateway that dies releases its locks, so another
one can take over), and `RecordFolder`, the store of one kind of record built on both."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from shared.errors import NotFound


def write_json_atomically(path: Path, value: dict[str, Any]) -> None:
    """Readers never see half a record: written beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(value), encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(path: Path, blocking: bool) -> Iterator[bool]:
    """Holds an exclusive lock on `path` (created if missing) while the block runs: True when
    this process got it, False (only when not `blocking`) when another holder has it. Two opens
    of the same file in one process also exclude each other (flock locks an open file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


class Record(Protocol):
    """What a folder's records have: an id (the file name) and an owner (a hash of the API key
    that made it; "" with keys off)."""

    @property
    def id(self) -> str: ...

    @property
    def owner(self) -> str: ...


R = TypeVar("R", bound=Record)


class RecordFolder(Generic[R]):
    """Records of one kind in one folder that several gateways share: `<id>.json` each (written
    atomically), changed only by `update` under `<id>.lock`; `<id>.run` is the run lock of
    whatever runs the record (`claim`). Ids are checked against their shape before any path is
    built from them (a bad id is simply not found)."""

    # the files of a record that `remove` deletes, the record first (gone for readers first)
    SUFFIXES: tuple[str, ...] = (".json", ".lock")

    def __init__(
        self,
        folder: Path,
        kind: str,
        id_pattern: str,
        load: Callable[[dict[str, Any]], R],
        dump: Callable[[R], dict[str, Any]],
    ) -> None:
        self.dir = folder
        self.dir.mkdir(parents=True, exist_ok=True)
        self._kind = kind  # what a NotFound message calls a record ("batch", "response", ...)
        self._id = re.compile(id_pattern)
        self._load = load
        self._dump = dump

    def not_found(self, record_id: str) -> NotFound:
        return NotFound(f"no {self._kind} {record_id!r}")

    def path(self, record_id: str, suffix: str = ".json") -> Path:
        if not self._id.fullmatch(record_id):
            raise self.not_found(record_id)
        return self.dir / (record_id + suffix)

    def create(self, record: R) -> None:
        write_json_atomically(self.path(record.id), self._dump(record))

    def load(self, path: Path) -> R:
        """The record in a file (FileNotFoundError, or ValueError/TypeError/KeyError for one that
        is not a record of this kind)."""
        return self._load(json.loads(path.read_text(encoding="utf-8")))

    def read(self, record_id: str) -> R:
        try:
            return self.load(self.path(record_id))
        except FileNotFoundError:
            raise self.not_found(record_id) from None

    def get(self, record_id: str, owner: str) -> R:
        """The owner's record; another owner's, or a missing one: NotFound."""
        record = self.read(record_id)
        if record.owner != owner:
            raise self.not_found(record_id)
        return record

    def update(self, record_id: str, change: Callable[[R], R], owner: str | None = None) -> R:
        """Applies `change` to the record as it is on disk now, under the record's lock (with
        `owner`: only to that owner's record, else NotFound)."""
        with locked(self.path(record_id, ".lock"), blocking=True):
            record = change(self.read(record_id) if owner is None else self.get(record_id, owner))
            write_json_atomically(self.path(record_id), self._dump(record))
            return record

    def remove(self, record_id: str) -> None:
        """Deletes a record and its other files (gone is no error)."""
        for suffix in self.SUFFIXES:
            self.path(record_id, suffix).unlink(missing_ok=True)

    @contextlib.contextmanager
    def claim(self, record_id: str) -> Iterator[bool]:
        """Holds the record's run lock while the block runs: True when this process got it,
        False when another run (in this process or another) holds it."""
        with locked(self.path(record_id, ".run"), blocking=False) as got:
            yield got

    def record_files(self) -> list[Path]:
        """The record files in the folder (unordered)."""
        return [p for p in self.dir.glob("*.json") if self._id.fullmatch(p.name[: -len(".json")])]

    def records(self) -> list[R]:
        """Every record that can be read now, unordered (one being written or removed is
        skipped)."""
        out = []
        for path in self.record_files():
            with contextlib.suppress(FileNotFoundError, ValueError, TypeError, KeyError):
                out.append(self.load(path))
        return out

    def ids(self) -> list[str]:
        return sorted(p.name[: -len(".json")] for p in self.record_files())
