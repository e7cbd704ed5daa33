"""What the Batch API's folder keeps (--batch-retention-s): a finished batch (its record, output
and error files) for that long after it ended, an uploaded file for that long after it was made
unless an unfinished batch reads it; a file whose client set its expiry (OpenAI's expires_after,
output_expires_after) goes at that time instead, if that is sooner. Pure: the runner deletes what
`expired` names, now and then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.batch_files import FileRecord
from services.gateway.batches import BatchRecord


@dataclass(frozen=True)
class Expired:
    batch_ids: tuple[str, ...]
    file_ids: tuple[str, ...]


def expired(
    batches: Sequence[BatchRecord], files: Sequence[FileRecord], now: float, retention_s: float
) -> Expired:
    """The batches and files past `retention_s` at `now` (unix s); nothing when it is 0."""
    if retention_s <= 0:
        return Expired((), tuple(sorted(_asked(files, now, _in_use(batches)))))
    in_use = _in_use(batches)
    old = [b for b in batches if b.final and (b.ended_at or b.created_at) + retention_s <= now]
    written = {f for b in old for f in (b.output_file_id, b.error_file_id)}
    uploaded = {f.id for f in files if f.created_at + retention_s <= now and f.id not in in_use}
    return Expired(tuple(b.id for b in old), tuple(sorted(written | uploaded | _asked(files, now, in_use))))


def _in_use(batches: Sequence[BatchRecord]) -> set[str]:
    return {f for b in batches if not b.final for f in b.file_ids}


def _asked(files: Sequence[FileRecord], now: float, in_use: set[str]) -> set[str]:
    """Files past the expires_at their client asked for (OpenAI's expires_after)."""
    return {f.id for f in files if f.expires_at is not None and f.expires_at <= now and f.id not in in_use}
