"""OpenAI's Conversations API on the gateway's HTTP face (`client.conversations.*`): POST
/v1/conversations, GET / POST (metadata) / DELETE /v1/conversations/{id}, POST / GET
/v1/conversations/{id}/items, GET / DELETE /v1/conversations/{id}/items/{item_id}. A Responses
request with `conversation` runs after the conversation's items and adds its input and output
items to it (http_stored_responses). Conversations live beside the stored responses
(--response-dir) and belong to the API key that made them (a hash of it).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request

from services.gateway import http_models as m
from services.gateway import http_responses_api as responses_api
from services.gateway.conversations import (
    MAX_ITEMS_PER_ADD,
    Conversation,
    ConversationStore,
    new_conversation_id,
)
from services.gateway.http_body import read_json
from services.gateway.http_routes import Answered, answered, items_page, metadata, owner
from services.gateway.validation import InvalidField
from shared.auth import ApiKeys
from shared.errors import NotFound

_OFF = "conversations are off on this gateway: start it with --response-dir DIR (pdserve up gives it one)"


class CreateConversation(m._Request):
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None


class AddItems(m._Request):
    items: list[dict[str, Any]]


class UpdateConversation(m._Request):
    metadata: dict[str, str]


class ConversationsApi:
    """The routes over `store` (None: off)."""

    def __init__(
        self, app: FastAPI, keys: ApiKeys, store: ConversationStore | None, max_body_bytes: int
    ) -> None:
        self._keys, self._store = keys, store
        self._max_body_bytes = max_body_bytes  # --http-max-body-bytes, as every route
        for path, route, method in (
            ("/v1/conversations", self.create, "POST"),
            ("/v1/conversations/{conversation_id}", self.retrieve, "GET"),
            ("/v1/conversations/{conversation_id}", self.update, "POST"),
            ("/v1/conversations/{conversation_id}", self.delete, "DELETE"),
            ("/v1/conversations/{conversation_id}/items", self.add_items, "POST"),
            ("/v1/conversations/{conversation_id}/items", self.list_items, "GET"),
            ("/v1/conversations/{conversation_id}/items/{item_id}", self.item, "GET"),
            ("/v1/conversations/{conversation_id}/items/{item_id}", self.delete_item, "DELETE"),
        ):
            app.add_api_route(path, route, methods=[method], response_model=None)

    @answered()
    async def create(self, request: Request) -> Answered:
        store, who = self._open(request)
        body = await read_json(request, CreateConversation, self._max_body_bytes)
        conversation = Conversation(
            id=new_conversation_id(),
            owner=who,
            created_at=int(time.time()),
            metadata=metadata(body.metadata),
            items=_items(body.items or []),
        )
        store.create(conversation)
        return conversation.body()

    @answered()
    async def retrieve(self, request: Request, conversation_id: str) -> Answered:
        store, who = self._open(request)
        return store.get(conversation_id, who).body()

    @answered()
    async def update(self, request: Request, conversation_id: str) -> Answered:
        store, who = self._open(request)
        body = await read_json(request, UpdateConversation, self._max_body_bytes)
        pairs = metadata(body.metadata)
        return store.update(conversation_id, lambda c: _with_metadata(c, pairs), who).body()

    @answered()
    async def delete(self, request: Request, conversation_id: str) -> Answered:
        store, who = self._open(request)
        store.get(conversation_id, who)
        store.remove(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @answered()
    async def add_items(self, request: Request, conversation_id: str) -> Answered:
        store, who = self._open(request)
        body = await read_json(request, AddItems, self._max_body_bytes)
        added = _items(body.items)
        store.update(conversation_id, lambda c: c.added(added), who)
        return {
            "object": "list",
            "data": list(added),
            "first_id": added[0]["id"] if added else None,
            "last_id": added[-1]["id"] if added else None,
            "has_more": False,
        }

    @answered()
    async def list_items(self, request: Request, conversation_id: str) -> Answered:
        store, who = self._open(request)
        return items_page(store.get(conversation_id, who).items, request)

    @answered()
    async def item(self, request: Request, conversation_id: str, item_id: str) -> Answered:
        store, who = self._open(request)
        return store.get(conversation_id, who).item(item_id)

    @answered()
    async def delete_item(self, request: Request, conversation_id: str, item_id: str) -> Answered:
        store, who = self._open(request)
        return store.update(conversation_id, lambda c: c.without(item_id), who).body()

    def _open(self, request: Request) -> tuple[ConversationStore, str]:
        who = owner(self._keys, request)
        if self._store is None:
            raise NotFound(_OFF)
        return self._store, who


def _items(items: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Items as a conversation keeps them (with ids), checked as a Responses request's input."""
    if len(items) > MAX_ITEMS_PER_ADD:
        raise InvalidField(f"items has {len(items)} entries; at most {MAX_ITEMS_PER_ADD} at a time", "items")
    try:
        responses_api.as_chat_messages(items, name="items")
    except InvalidField as exc:
        raise InvalidField(str(exc), "items") from None
    return responses_api.with_ids(items, uuid.uuid4().hex)


def _with_metadata(conversation: Conversation, pairs: dict[str, str]) -> Conversation:
    return replace(conversation, metadata=pairs)
