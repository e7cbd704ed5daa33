"""OpenAI's conversations (the Conversations API, and the Responses API's `conversation`): one
record per conversation (its owner, metadata and items: Responses input and output items, each
with an id) and their store on disk under --response-dir as `conversations/<id>.json`.

A record changes only through `ConversationStore.update`, a read-modify-write under
`conversations/<id>.lock`, so two gateways appending a turn each to the same conversation never
lose one.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from services.gateway.shared_folder import locked, write_json_atomically
from shared.errors import NotFound

ID_PREFIX = "conv_"
_ID = re.compile(r"conv_[0-9a-f]{32}")
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


class ConversationStore:
    """The records under `root/conversations`."""

    def __init__(self, root: Path) -> None:
        self._dir = root / "conversations"
        self._dir.mkdir(parents=True, exist_ok=True)

    def _path(self, conversation_id: str, suffix: str) -> Path:
        if not _ID.fullmatch(conversation_id):
            raise NotFound(f"no conversation {conversation_id!r}")
        return self._dir / (conversation_id + suffix)

    def create(self, conversation: Conversation) -> None:
        write_json_atomically(self._path(conversation.id, ".json"), asdict(conversation))

    def read(self, conversation_id: str) -> Conversation:
        try:
            value = json.loads(self._path(conversation_id, ".json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise NotFound(f"no conversation {conversation_id!r}") from None
        return Conversation(**(value | {"items": tuple(value.get("items", ()))}))

    def get(self, conversation_id: str, owner: str) -> Conversation:
        """The record; another owner's, or a missing one: NotFound."""
        conversation = self.read(conversation_id)
        if conversation.owner != owner:
            raise NotFound(f"no conversation {conversation_id!r}")
        return conversation

    def update(
        self, conversation_id: str, owner: str, change: Callable[[Conversation], Conversation]
    ) -> Conversation:
        """Applies `change` to the owner's record as it is on disk now, under its lock."""
        with locked(self._path(conversation_id, ".lock"), blocking=True):
            conversation = change(self.get(conversation_id, owner))
            write_json_atomically(self._path(conversation_id, ".json"), asdict(conversation))
            return conversation

    def remove(self, conversation_id: str) -> None:
        for suffix in (".json", ".lock"):
            self._path(conversation_id, suffix).unlink(missing_ok=True)
