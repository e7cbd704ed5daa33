"""Conversations on disk (services/gateway/conversations.py): items added in order and removed
by id, owners, and turns added by two writers at once all kept (the record's lock)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from services.gateway.conversations import Conversation, ConversationStore, new_conversation_id
from shared.errors import NotFound


def _message(i: int) -> dict[str, str]:
    return {"type": "message", "role": "user", "content": f"m{i}", "id": f"msg_{i}"}


def test_items_are_added_in_order_and_removed_by_id(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    conv = Conversation(new_conversation_id(), "o1", 5, {"k": "v"}, (_message(0),))
    store.create(conv)
    assert store.get(conv.id, "o1") == conv
    assert conv.body() == {"id": conv.id, "object": "conversation", "created_at": 5, "metadata": {"k": "v"}}
    grown = store.update(conv.id, lambda c: c.added([_message(1), _message(2)]), "o1")
    assert [i["id"] for i in grown.items] == ["msg_0", "msg_1", "msg_2"]
    assert grown.item("msg_1")["content"] == "m1"
    shrunk = store.update(conv.id, lambda c: c.without("msg_1"), "o1")
    assert (
        [i["id"] for i in store.read(conv.id).items] == ["msg_0", "msg_2"] == [i["id"] for i in shrunk.items]
    )
    for missing in (lambda: shrunk.item("msg_1"), lambda: shrunk.without("msg_9")):
        with pytest.raises(NotFound):
            missing()
    with pytest.raises(NotFound):
        store.get(conv.id, "o2")  # another key's
    with pytest.raises(NotFound):
        store.update(conv.id, lambda c: c.added([_message(3)]), "o2")
    with pytest.raises(NotFound):
        store.get("conv_../x", "o1")
    store.remove(conv.id)
    assert not list((tmp_path / "conversations").iterdir())


def test_turns_added_at_once_are_all_kept(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    conv = Conversation(new_conversation_id(), "", 1, {})
    store.create(conv)

    def add(first: int) -> None:
        for i in range(first, first + 25):
            item = _message(i)
            store.update(conv.id, lambda c: c.added([item]), "")  # noqa: B023 (called at once)

    writers = [threading.Thread(target=add, args=(k * 100,)) for k in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert len(store.read(conv.id).items) == 100
