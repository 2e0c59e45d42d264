"""Stored responses around ``POST /v1/responses``: ``store``, ``previous_response_id``,
``conversation``, ``metadata`` and ``background`` (OpenAI's Responses API).

A stored response keeps its response object and its input items: the whole context it
ran on (the earlier turns' items, then its own input; ``instructions`` are not kept in
the items and not carried over, as OpenAI). ``previous_response_id`` continues from
them: the new request's messages are the stored input items, the stored output items,
then the new input, so the earlier turns are a cached prefix. ``conversation`` runs on
the conversation's items and appends the turn's input and output items to it. An image
sent as a data URL is stored by its image id (``img-...``, put in the image store, on
disk when the image store has a directory): the stored items name images as uploads do.

``background: true`` stores the response as ``queued`` and answers at once; the work
runs at background priority (:meth:`api.submit.EngineClient.submit`), is polled with
``GET /v1/responses/{id}`` and stopped with ``POST /v1/responses/{id}/cancel``. A disk
store that finds a background response unfinished at start marks it ``failed`` with
the error code ``server_restarted`` (never dropped silently).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from api.disconnect import request_token, until_cancelled
from api.endpoints.responses import RESPONSES, ResponseCall, response_object
from api.errors import APIError
from api.media import decode_data_url, image_error
from api.response_store import (
    JsonStore,
    check_metadata,
    encoded,
    owner_of,
    store_off,
)
from api.schemas import InputMessage, ResponsesRequest
from api.settings import ServerSettings
from api.sse import SSE_HEADERS
from api.state import ServerState
from mmserve.vision.image import ImageError

log = logging.getLogger(__name__)

#: Statuses of a response still running (a background one).
RUNNING = ("queued", "in_progress")


@dataclass
class ResponseStores:
    """The stored responses and conversations of one server, and the background
    responses running now (``tasks``: response id -> its task)."""

    responses: JsonStore
    conversations: JsonStore
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> ResponseStores | None:
        """The stores ``settings`` ask for (None with ``responses_store`` "off"); a
        disk store marks the background responses a restart cut short as failed."""
        if settings.responses_store == "off":
            return None
        root: Path | None = None
        if settings.responses_store == "disk":
            root = settings.resolved_data_dir()
        bounds = (
            settings.max_stored_responses,
            settings.max_stored_response_bytes,
            settings.max_stored_object_bytes,
        )
        stores = cls(
            JsonStore("response", *bounds, root / "responses" if root else None),
            JsonStore("conversation", *bounds, root / "conversations" if root else None),
        )
        stores.fail_interrupted()
        return stores

    def fail_interrupted(self) -> int:
        """Mark every stored response left ``queued`` or ``in_progress`` (by a server
        that stopped) ``failed`` with error ``server_restarted``; how many."""
        n = 0
        for rec in list(self.responses.records()):
            if rec["response"]["status"] not in RUNNING:
                continue
            rec["response"]["status"] = "failed"
            rec["response"]["error"] = {
                "code": "server_restarted",
                "message": "the server stopped before this background response finished; "
                "create it again",
            }
            self.responses.put(rec)
            log.warning("background response %s was cut short by a restart: failed", rec["id"])
            n += 1
        return n


def stores(st: ServerState, param: str) -> ResponseStores:
    """The server's stores.

    Raises:
        APIError: 400 naming ``param`` and ``--responses-store off`` when there are none.
    """
    if st.responses is None:
        raise store_off(param)
    return st.responses


def new_item_id() -> str:
    """A fresh message item id."""
    return f"msg_{uuid.uuid4().hex}"


def message_items(body_input: str | list[InputMessage]) -> list[dict]:
    """``input`` as message items (each with ``type``, ``id``, ``status``, ``role`` and a
    list of content parts; a string content is one ``input_text`` part, ``output_text``
    for an assistant)."""
    msgs = [InputMessage(role="user", content=body_input)] if isinstance(body_input, str) else []
    msgs = msgs or list(body_input)  # type: ignore[arg-type]
    out = []
    for m in msgs:
        item = m.model_dump(exclude_none=True)
        item["type"] = "message"
        item["id"] = item.get("id") or new_item_id()
        item.setdefault("status", "completed")
        if isinstance(item["content"], str):
            kind = "output_text" if m.role == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        out.append(item)
    return out


def as_messages(items: list[dict], param: str) -> list[InputMessage]:
    """Stored or sent message items as ``input`` messages.

    Raises:
        APIError: 400 naming ``param[i]`` for an item that is not a message.
    """
    out = []
    for i, item in enumerate(items):
        try:
            out.append(InputMessage.model_validate(item))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise APIError(
                400, f"{param}[{i}].{where}: {err['msg']}", param=f"{param}[{i}]"
            ) from None
    return out


def keep_images(st: ServerState, items: list[dict], param: str = "items") -> list[dict]:
    """``items`` with each data-URL image replaced by its id in the image store (the
    image is put there, on disk when the store has a directory), so that stored items
    stay small. Blocking (decodes an image the store does not hold yet): run it in a
    worker thread.

    Raises:
        APIError: 400 naming ``param[i].content[j].image_url`` for a bad image.
    """
    for i, item in enumerate(items):
        for j, part in enumerate(item.get("content") or []):
            url = part.get("image_url") if isinstance(part, dict) else None
            if isinstance(url, str) and url.startswith("data:"):
                where = f"{param}[{i}].content[{j}].image_url"
                try:
                    part["image_url"] = st.store.put(decode_data_url(url, where)).id
                except ImageError as e:
                    raise image_error(e, where) from None
    return items


def stored_size(items: list[dict]) -> int:
    """The bytes ``items`` take once stored: their JSON, each data-URL image counted as
    the image id :func:`keep_images` puts in its place."""
    n = len(encoded({"items": items}))
    for item in items:
        for part in item.get("content") or []:
            url = part.get("image_url") if isinstance(part, dict) else None
            if isinstance(url, str) and url.startswith("data:"):
                n -= len(url) - 36
    return n


def conversation_id(value: str | dict[str, str]) -> str:
    """The id in ``conversation`` (a string or ``{"id": ...}``).

    Raises:
        APIError: 400 naming ``conversation.id`` for an object without it.
    """
    if isinstance(value, str):
        return value
    if set(value) != {"id"}:
        raise APIError(400, "conversation.id: give the conversation's id", param="conversation.id")
    return value["id"]


async def create_response(st: ServerState, body: ResponsesRequest, http: Request) -> Any:
    """``POST /v1/responses`` with storing: the history, the run (plain, streamed or in
    the background), the stored record and the conversation's new items.

    Raises:
        APIError: 400 naming ``store``, ``background``, ``previous_response_id`` or
            ``conversation`` when ``--responses-store off`` is set (the message names the
            flag), ``background`` without ``store``, ``stream`` with ``background``,
            ``previous_response_id`` with ``conversation``, ``metadata`` out of bounds,
            ``input`` when the stored object would exceed its bound; 404 naming
            ``previous_response_id`` or ``conversation`` for an unknown (or another
            tenant's) id; and what the plain handler raises.
    """
    RESPONSES.check(st, body)
    owner = owner_of(http)
    if body.store is True:
        stores(st, "store")
    if body.background:
        stores(st, "background")
        if body.store is False:
            raise APIError(
                400,
                "background: needs store: true (a background response is polled with "
                "GET /v1/responses/{id})",
                param="background",
            )
        if body.stream:
            raise APIError(
                400,
                "stream: not available with background: true; poll GET /v1/responses/{id}",
                param="stream",
            )
    if body.previous_response_id is not None and body.conversation is not None:
        raise APIError(
            400,
            "conversation: give previous_response_id or conversation, not both",
            param="conversation",
        )
    meta = check_metadata(body.metadata)
    stored = body.store is not False and st.responses is not None
    history: list[dict] = []
    conv_id: str | None = None
    conv_size = 0
    if body.previous_response_id is not None:
        rs = stores(st, "previous_response_id").responses
        prev = await rs.run(rs.get, owner, body.previous_response_id)
        if prev is None:
            raise not_found("response", body.previous_response_id, "previous_response_id")
        if prev["response"]["status"] in RUNNING:
            raise APIError(
                400,
                f"previous_response_id: {body.previous_response_id!r} is still "
                f"{prev['response']['status']}; wait until it has finished",
                param="previous_response_id",
                code="response_not_finished",
            )
        history = prev["input_items"] + prev["response"]["output"]
    if body.conversation is not None:
        cs = stores(st, "conversation").conversations
        conv_id = conversation_id(body.conversation)
        conv = await cs.run(cs.get, owner, conv_id)
        if conv is None:
            raise not_found("conversation", conv_id, "conversation")
        history = conv["items"]
        conv_size = len(encoded(conv))
    new_items = message_items(body.input)
    if st.responses is not None and (stored or conv_id):
        size = stored_size(history + new_items)
        st.responses.responses.check_size(size, "input")
        if conv_id:
            extra = stored_size(new_items)
            st.responses.conversations.check_size(conv_size + extra, "input")
    run_body = body.model_copy(
        update={
            "input": as_messages(history, "history") + as_messages(new_items, "input"),
            "store": stored,
            "metadata": meta,
            "conversation": conv_id,
            "background": bool(body.background),
        }
    )
    call = await RESPONSES.prepare(st, run_body)
    if stored or conv_id:  # images by id: the data URLs were decoded by prepare
        new_items = await asyncio.to_thread(keep_images, st, new_items, "input")
    turn = _Turn(st, owner, run_body, call, history + new_items, new_items, conv_id, stored)
    if body.background:
        return await turn.start_background()
    sub = st.client.submit(call.reqs)
    if body.stream:
        events = until_cancelled(turn.stream(sub), request_token(http))
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    results = await sub.answers(http)
    obj = RESPONSES.answer(st, run_body, call, results).body
    await turn.finish(obj)
    return obj


def not_found(kind: str, ident: str, param: str) -> APIError:
    """The 404 for a stored object that ``ident`` (in ``param``) does not name for the
    caller."""
    return APIError(
        404,
        f"{param}: no {kind} {ident!r} (never stored, deleted, evicted, or another tenant's)",
        "not_found_error",
        param=param,
        code="not_found",
    )


@dataclass
class _Turn:
    """One running response and what is stored when it ends."""

    st: ServerState
    owner: str
    body: ResponsesRequest
    call: ResponseCall
    context: list[dict]  # the stored input items: history then the new input
    new_items: list[dict]
    conv_id: str | None
    stored: bool

    def record(self, obj: dict) -> dict:
        """The stored record of response ``obj``."""
        return {
            "id": obj["id"],
            "owner": self.owner,
            "response": obj,
            "input_items": self.context,
        }

    async def finish(self, obj: dict) -> None:
        """Store ``obj`` (when stored) and append the turn to its conversation."""
        rs = self.st.responses
        if rs is None:
            return
        if self.stored:
            await rs.responses.run(rs.responses.put, self.record(obj))
        if self.conv_id is not None:
            items = self.new_items + obj["output"]

            def append(conv: dict) -> dict:
                conv["items"] = conv["items"] + items
                return conv

            done = await rs.conversations.run(
                rs.conversations.update, self.owner, self.conv_id, append
            )
            if done is None:
                log.warning("conversation %s deleted during %s", self.conv_id, obj["id"])

    async def stream(self, sub: Any) -> AsyncIterator[str]:
        """The plain handler's events; the final response is stored when it comes."""
        async for event in RESPONSES.stream(self.st, self.body, self.call, sub):
            yield event
            if event.startswith(("event: response.completed", "event: response.incomplete")):
                data = json.loads(event.split("data: ", 1)[1])
                await self.finish(data["response"])

    async def start_background(self) -> dict:
        """Store the ``queued`` response and start its work; the queued object."""
        st, call = self.st, self.call
        rs = st.responses
        assert rs is not None
        obj = response_object(st, self.body, call.id, call.msg_id, call.created, None, "queued")
        await rs.responses.run(rs.responses.put, self.record(obj))
        # a fresh context: the HTTP request's cancel token must not stop the work
        task = asyncio.get_running_loop().create_task(
            self._background(), context=contextvars.Context()
        )
        rs.tasks[call.id] = task
        return obj

    async def _background(self) -> None:
        st, call = self.st, self.call
        rs = st.responses
        assert rs is not None
        store = rs.responses
        sub = None
        try:
            sub = st.client.submit(call.reqs, background=True)
            await store.run(store.update, self.owner, call.id, _set_status("in_progress"))
            results = await sub.answers()
            if any(r.finish_reason == "abort" for r in results):  # the server stops
                raise APIError(
                    503,
                    "the server aborted this background response (it was stopping); "
                    "create it again",
                    code="aborted",
                )
            obj = RESPONSES.answer(st, self.body, call, results).body
            obj["background"] = True
            if await store.run(store.get, self.owner, call.id) is not None:
                await self.finish(obj)
        except asyncio.CancelledError:
            if sub is not None:
                sub.cancel()
            raise
        except APIError as e:
            error = {"code": e.code or "server_error", "message": e.message}
            await store.run(store.update, self.owner, call.id, _set_status("failed", error))
        except Exception as e:  # recorded on the response, never lost
            log.exception("background response %s failed", call.id)
            error = {"code": "server_error", "message": f"{type(e).__name__}: {e}"}
            await store.run(store.update, self.owner, call.id, _set_status("failed", error))
        finally:
            rs.tasks.pop(call.id, None)


def _set_status(status: str, error: dict | None = None) -> Any:
    """A record change setting a still-running response's status (and error)."""

    def change(rec: dict) -> dict | None:
        if rec["response"]["status"] not in RUNNING:
            return None
        rec["response"]["status"] = status
        if error is not None:
            rec["response"]["error"] = error
        return rec

    return change


async def cancel_response(st: ServerState, owner: str, rid: str) -> dict:
    """``POST /v1/responses/{id}/cancel``: stop a background response (its status becomes
    ``cancelled``); a finished one is answered as it is.

    Raises:
        APIError: 404 for an unknown id; 400 for a response that was not run in the
            background.
    """
    rs = stores(st, "response_id")
    rec = await rs.responses.run(rs.responses.get, owner, rid)
    if rec is None:
        raise not_found("response", rid, "response_id")
    if not rec["response"].get("background"):
        raise APIError(
            400,
            f"response_id: {rid!r} did not run in the background; only background "
            "responses can be cancelled",
            param="response_id",
        )
    task = rs.tasks.pop(rid, None)
    if task is not None:
        task.cancel()
    new = await rs.responses.run(rs.responses.update, owner, rid, _set_status("cancelled"))
    return (new or rec)["response"]
