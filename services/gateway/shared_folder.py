"""Records in a folder that several gateway processes share (the Batch API's and the stored
Responses'): JSON written so that readers never see half of it, and `flock` locks that go with
the process holding them (a gateway that dies releases its locks, so another one can take over)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
