"""OpenAI's conversations (the Conversations API, and the Responses API's `conversation`): one
record per conversation (its owner, metadata and items: Responses input and output items, each
with an id) and their store on disk under --response-dir as `conversations/<id>.json`.

A record changes only through `ConversationStore.update` (shared_folder.RecordFolder), a
read-modify-write under `conversations/<id>.lock`, so two gateways appending a turn each to the
same conversation never lose one.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from services.gateway.shared_folder import RecordFolder
from shared.errors import NotFound

ID_PREFIX = "conv_"
_ID = r"conv_[0-9a-f]{32}"
MAX_ITEMS_PER_ADD = 20  # OpenAI's limit on the items one create or add call takes (count)


@dataclass(frozen=True)
class Conversation:
    id: str
    owner: str  # hash of the API key that created it; "" with keys off
    created_at: int  # unix time (s)
    metadata: dict[str, str]
    items: tuple[dict[str, Any], ...] = ()  # oldest first, each with its id

    def body(self) -> dict[str, Any]:
        """OpenAI's Conversation object."""
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def added(self, items: Sequence[dict[str, Any]]) -> Conversation:
        return replace(self, items=self.items + tuple(items))

    def without(self, item_id: str) -> Conversation:
        if not any(item.get("id") == item_id for item in self.items):
            raise NotFound(f"conversation {self.id} has no item {item_id!r}")
        return replace(self, items=tuple(item for item in self.items if item.get("id") != item_id))

    def item(self, item_id: str) -> dict[str, Any]:
        for item in self.items:
            if item.get("id") == item_id:
                return item
        raise NotFound(f"conversation {self.id} has no item {item_id!r}")


def new_conversation_id() -> str:
    return ID_PREFIX + uuid.uuid4().hex


def _conversation(value: dict[str, Any]) -> Conversation:
    return Conversation(**(value | {"items": tuple(value.get("items", ()))}))


class ConversationStore(RecordFolder[Conversation]):
    """The records under `root/conversations`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root / "conversations", "conversation", _ID, _conversation, asdict)
