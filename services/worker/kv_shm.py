"""Same-host KV handoff through a shared-memory folder (a tmpfs such as /dev/shm).

A prefill worker and a decode worker on one host can skip serializing KV bytes into gRPC
messages: the sender writes each chunk's bytes to a file in the folder and sends only its name
(KvChunk.shm_file); the receiver reads the file into its KV pool and deletes it. The PushKv
stream, its checks and its ordering stay exactly as they are, so the gRPC path is the fallback
for everything else.

Who may use it: each worker creates a marker file "pdserve-domain-<id>" in its folder at start
and names <id> in every PushKvResponse. A sender that sees the receiver's marker in its own
folder shares the folder (same host, same tmpfs); in Kubernetes, pods have private /dev/shm
folders, so prefill and decode pods never see each other's markers and keep sending bytes.
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path

import structlog

from shared import errors

log = structlog.get_logger(__name__)

_MARKER_PREFIX = "pdserve-domain-"
_CHUNK_PREFIX = "pdserve-kv-"
_CHUNK_NAME = re.compile(r"pdserve-kv-[0-9a-f]{32}")


class ShmKvFolder:
    """One worker's use of the folder: its marker, the chunk files it writes and reads."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder) if folder else None  # None: disabled
        self.domain = uuid.uuid4().hex
        self._marker: Path | None = None

    @property
    def enabled(self) -> bool:
        return self._marker is not None

    def open(self) -> None:
        """Create the marker; a missing or read-only folder disables the handoff (logged)."""
        if self.folder is None:
            return
        marker = self.folder / f"{_MARKER_PREFIX}{self.domain}"
        try:
            marker.touch(exist_ok=False)
        except OSError as exc:
            log.warning("kv_shm_disabled", folder=str(self.folder), error=str(exc))
            return
        self._marker = marker

    def close(self) -> None:
        if self._marker is not None:
            self._marker.unlink(missing_ok=True)
            self._marker = None

    def shares_with(self, domain: str) -> bool:
        """True when the worker that announced `domain` uses this very folder."""
        if not self.enabled or not re.fullmatch(r"[0-9a-f]{32}", domain):
            return False
        assert self.folder is not None
        return (self.folder / f"{_MARKER_PREFIX}{domain}").exists()

    # ---- sending side ----------------------------------------------------------------------
    def write(self, data: bytes) -> str:
        """A new chunk file holding `data`; returns its name (for KvChunk.shm_file)."""
        assert self.folder is not None
        name = f"{_CHUNK_PREFIX}{uuid.uuid4().hex}"
        # O_EXCL: never write through a file (or link) someone else put there
        fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return name

    def discard(self, names: Iterable[str]) -> None:
        """Delete chunk files the receiver did not take (a push that failed part way)."""
        if self.folder is None:
            return
        for name in names:
            (self.folder / name).unlink(missing_ok=True)

    # ---- receiving side --------------------------------------------------------------------
    def take(self, name: str) -> bytes:
        """Read and delete one chunk file named by a sender."""
        if not self.enabled:
            raise errors.FailedPrecondition(
                "KvChunk.shm_file was sent, but this worker has no shared-memory folder; "
                "send the KV bytes in KvChunk.data")
        if not _CHUNK_NAME.fullmatch(name):
            raise errors.InvalidArgument(
                f"KvChunk.shm_file must be a file name like {_CHUNK_PREFIX}<32 hex digits>")
        assert self.folder is not None
        path = self.folder / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP):
                raise errors.FailedPrecondition(
                    f"KV chunk file {name} is not in this worker's shared-memory folder "
                    f"{self.folder}; sender and receiver must share it") from exc
            raise
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read()
        finally:
            path.unlink(missing_ok=True)
