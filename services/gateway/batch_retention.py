"""What the Batch API's folder keeps (--batch-retention-s): a finished batch (its record, output
and error files) for that long after it ended, an uploaded file for that long after it was made
unless an unfinished batch reads it. Pure: the runner deletes what `expired` names, now and then.
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
        return Expired((), ())
    in_use = {f for b in batches if not b.final for f in (b.input_file_id, b.output_file_id, b.error_file_id)}
    old = [b for b in batches if b.final and (b.ended_at or b.created_at) + retention_s <= now]
    written = {f for b in old for f in (b.output_file_id, b.error_file_id)}
    uploaded = {f.id for f in files if f.created_at + retention_s <= now and f.id not in in_use}
    return Expired(tuple(b.id for b in old), tuple(sorted(written | uploaded)))
