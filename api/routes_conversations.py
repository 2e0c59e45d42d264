"""``/v1/conversations``: OpenAI's Conversations API (create with items and metadata,
retrieve, update metadata, delete; list, add, get and delete items).

A conversation is a record of the response store (:mod:`api.response_store`): the same
bounds (count, bytes, one object's bytes) and the same owner rule (another tenant's
conversation is a 404). ``conversation`` on ``POST /v1/responses`` runs a turn on its
items and appends the turn's input and output items (:mod:`api.stored_responses`).
Items are messages (``type`` ``message``), as ``input`` takes them; data-URL images are
kept by their image id.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from api.errors import APIError
from api.json_body import JSONBodyRoute
from api.response_store import check_metadata, encoded, owner_of, paginate
from api.schemas import STRICT
from api.state import ServerState, State
from api.stored_responses import as_messages, keep_images, message_items, not_found, stores

router = APIRouter(route_class=JSONBodyRoute)

#: Most items one create or add call may carry (OpenAI's bound).
MAX_ITEMS_PER_CALL = 20


class ConversationCreate(BaseModel):
    """``POST /v1/conversations``: initial ``items`` (messages) and ``metadata``."""

    model_config = STRICT
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class ConversationUpdate(BaseModel):
    """``POST /v1/conversations/{id}``: the new ``metadata`` (replaces the old)."""

    model_config = STRICT
    metadata: dict[str, Any]


class ItemsCreate(BaseModel):
    """``POST /v1/conversations/{id}/items``: the ``items`` to append."""

    model_config = STRICT
    items: list[dict[str, Any]] = Field(min_length=1)


def conversation_object(rec: dict) -> dict:
    """The ``conversation`` object of a stored record."""
    return {
        "id": rec["id"],
        "object": "conversation",
        "created_at": rec["created_at"],
        "metadata": rec["metadata"],
    }


async def _items(st: ServerState, raw: list[dict[str, Any]]) -> list[dict]:
    """Sent ``items`` checked and made stored message items (ids, image ids).

    Raises:
        APIError: 400 naming ``items`` (more than :data:`MAX_ITEMS_PER_CALL`) or
            ``items[i]`` (not a message).
    """
    if len(raw) > MAX_ITEMS_PER_CALL:
        raise APIError(
            400,
            f"items: at most {MAX_ITEMS_PER_CALL} items per call, got {len(raw)}",
            param="items",
        )
    items = message_items(as_messages(raw, "items"))
    return await asyncio.to_thread(keep_images, st, items)


async def _get(st: ServerState, request: Request, conversation_id: str) -> dict:
    cs = stores(st, "conversation_id").conversations
    rec = await cs.run(cs.get, owner_of(request), conversation_id)
    if rec is None:
        raise not_found("conversation", conversation_id, "conversation_id")
    return rec


@router.post("/v1/conversations")
async def create(body: ConversationCreate, request: Request, st: State) -> dict:
    """Create a conversation (OpenAI ``conversations.create``) with up to 20 initial
    ``items`` and ``metadata`` (16 pairs); 400 naming the field for anything beyond the
    bounds, including the stored object's byte bound."""
    cs = stores(st, "conversation").conversations
    meta = check_metadata(body.metadata)
    items = await _items(st, body.items or [])
    rec = {
        "id": f"conv_{uuid.uuid4().hex}",
        "owner": owner_of(request),
        "created_at": int(time.time()),
        "metadata": meta,
        "items": items,
    }
    await cs.run(cs.put, rec, "items")
    return conversation_object(rec)


@router.get("/v1/conversations/{conversation_id}")
async def retrieve(conversation_id: str, request: Request, st: State) -> dict:
    """A conversation (404 for an unknown id or another tenant's)."""
    return conversation_object(await _get(st, request, conversation_id))


@router.post("/v1/conversations/{conversation_id}")
async def update(
    conversation_id: str, body: ConversationUpdate, request: Request, st: State
) -> dict:
    """Replace a conversation's ``metadata`` (OpenAI ``conversations.update``)."""
    meta = check_metadata(body.metadata)
    cs = stores(st, "conversation_id").conversations

    def change(rec: dict) -> dict:
        rec["metadata"] = meta
        return rec

    rec = await cs.run(cs.update, owner_of(request), conversation_id, change)
    if rec is None:
        raise not_found("conversation", conversation_id, "conversation_id")
    return conversation_object(rec)


@router.delete("/v1/conversations/{conversation_id}")
async def delete(conversation_id: str, request: Request, st: State) -> dict:
    """Delete a conversation and its items (404 for an unknown id or another tenant's)."""
    cs = stores(st, "conversation_id").conversations
    if not await cs.run(cs.delete, owner_of(request), conversation_id):
        raise not_found("conversation", conversation_id, "conversation_id")
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(
    conversation_id: str,
    request: Request,
    st: State,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
    include: Annotated[list[str] | None, Query()] = None,
) -> dict:
    """A conversation's items, paginated as OpenAI (``after``, ``limit`` 1-100,
    ``order`` ``desc`` by default; ``first_id``, ``last_id``, ``has_more``).
    ``include`` is accepted (no extra data exists to include)."""
    rec = await _get(st, request, conversation_id)
    return paginate(rec["items"], after, limit, order)


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: ItemsCreate, request: Request, st: State) -> dict:
    """Append up to 20 ``items`` (OpenAI ``conversations.items.create``); answers the
    list of the added items. 400 naming ``items`` when the conversation would exceed
    the stored object's byte bound."""
    cs = stores(st, "conversation_id").conversations
    items = await _items(st, body.items)

    def change(rec: dict) -> dict:
        rec["items"] = rec["items"] + items
        cs.check_size(len(encoded(rec)), "items")
        return rec

    if await cs.run(cs.update, owner_of(request), conversation_id, change) is None:
        raise not_found("conversation", conversation_id, "conversation_id")
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"],
        "last_id": items[-1]["id"],
        "has_more": False,
    }


def _find(rec: dict, item_id: str) -> int:
    for i, item in enumerate(rec["items"]):
        if item.get("id") == item_id:
            return i
    raise not_found("item", item_id, "item_id")


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, request: Request, st: State) -> dict:
    """One item of a conversation (404 naming ``item_id`` when it has none such)."""
    rec = await _get(st, request, conversation_id)
    return rec["items"][_find(rec, item_id)]


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request, st: State) -> dict:
    """Remove one item; answers the conversation (as OpenAI)."""
    cs = stores(st, "conversation_id").conversations
    await _get(st, request, conversation_id)

    def change(rec: dict) -> dict:
        del rec["items"][_find(rec, item_id)]
        return rec

    rec = await cs.run(cs.update, owner_of(request), conversation_id, change)
    if rec is None:
        raise not_found("conversation", conversation_id, "conversation_id")
    return conversation_object(rec)
