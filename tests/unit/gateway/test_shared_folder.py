"""RecordFolder: the record store that batches, files, stored responses and conversations share."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from services.gateway.shared_folder import RecordFolder
from shared.errors import NotFound


@dataclass(frozen=True)
class Note:
    id: str
    owner: str
    text: str


def _note(value: dict[str, Any]) -> Note:
    return Note(**value)


def _folder(tmp_path: Path) -> RecordFolder[Note]:
    return RecordFolder(tmp_path / "notes", "note", r"note_[0-9]+", _note, asdict)


def test_ids_are_checked_before_any_path_is_built(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (tmp_path / "secret.json").write_text('{"id": "x", "owner": "", "text": "no"}')
    for bad in ("../secret", "note_1/../../secret", "note_x", ""):
        with pytest.raises(NotFound, match="no note"):
            folder.read(bad)
        with pytest.raises(NotFound):
            folder.update(bad, lambda n: n)


def test_owners_see_only_their_records_and_update_only_them(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    folder.create(Note("note_1", "alice", "hello"))
    assert folder.get("note_1", "alice").text == "hello"
    with pytest.raises(NotFound):
        folder.get("note_1", "bob")
    with pytest.raises(NotFound):
        folder.update("note_1", lambda n: replace(n, text="bob was here"), owner="bob")
    assert folder.read("note_1").text == "hello"  # nothing written
    assert folder.update("note_1", lambda n: replace(n, text="hi"), owner="alice").text == "hi"
    assert folder.read("note_1").text == "hi"


def test_listing_skips_what_is_not_a_whole_record_and_remove_leaves_nothing(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    folder.create(Note("note_2", "", "b"))
    folder.create(Note("note_1", "", "a"))
    (folder.dir / "note_3.json").write_text('{"id": "note_3", "own')  # being written elsewhere
    (folder.dir / "other.json").write_text('{"id": "other", "owner": "", "text": "?"}')
    assert folder.ids() == ["note_1", "note_2", "note_3"]
    assert sorted(n.id for n in folder.records()) == ["note_1", "note_2"]
    folder.update("note_1", lambda n: n)  # leaves its lock file
    folder.remove("note_1")
    folder.remove("note_1")  # gone is no error
    with pytest.raises(NotFound):
        folder.read("note_1")
    assert sorted(p.name for p in folder.dir.iterdir()) == ["note_2.json", "note_3.json", "other.json"]


def test_a_claim_excludes_a_second_claim_until_released(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    folder.create(Note("note_1", "", "a"))
    with folder.claim("note_1") as first, folder.claim("note_1") as second:
        assert (first, second) == (True, False)
    with folder.claim("note_1") as again:
        assert again
