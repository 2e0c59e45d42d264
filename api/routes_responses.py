"""``/v1/responses``: OpenAI's Responses API for text and image input, text output, and
its stored responses (retrieve, delete, input items, cancel).

The work (check, prepare, answer) is its handler's
(:data:`api.endpoints.responses.RESPONSES`), shared with batch lines; storing,
``previous_response_id``, ``conversation`` and ``background`` are
:mod:`api.stored_responses`'s.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from api.json_body import JSONBodyRoute
from api.response_store import owner_of, paginate
from api.schemas import ResponsesRequest
from api.state import State
from api.stored_responses import cancel_response, create_response, not_found, stores

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/responses", response_model=None)
async def create(body: ResponsesRequest, request: Request, st: State) -> dict | Response:
    """Create a model response (OpenAI ``responses.create``), streamed as server-sent
    events when ``stream`` is set; stored unless ``store`` is false (or the server runs
    with ``--responses-store off``); unsupported fields get a 400 naming them."""
    return await create_response(st, body, request)


async def _record(st: State, request: Request, response_id: str) -> dict:
    rs = stores(st, "response_id").responses
    rec = await rs.run(rs.get, owner_of(request), response_id)
    if rec is None:
        raise not_found("response", response_id, "response_id")
    return rec


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request, st: State) -> dict:
    """A stored response (OpenAI ``responses.retrieve``): a background one's status
    (``queued``, ``in_progress``, ``completed``, ``failed``, ``cancelled``) as it runs.
    404 for an unknown id or another tenant's."""
    return (await _record(st, request, response_id))["response"]


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request, st: State) -> dict:
    """Delete a stored response (a running background one is cancelled first); 404 for
    an unknown id or another tenant's."""
    await _record(st, request, response_id)  # the caller's own, or 404
    rs = stores(st, "response_id")
    task = rs.tasks.pop(response_id, None)
    if task is not None:
        task.cancel()
    if not await rs.responses.run(rs.responses.delete, owner_of(request), response_id):
        raise not_found("response", response_id, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    request: Request,
    st: State,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
    include: Annotated[list[str] | None, Query()] = None,
) -> dict:
    """The input items a stored response ran on (the earlier turns' items, then its own
    input), paginated as OpenAI: ``after`` (an item id), ``limit`` (1-100, default 20),
    ``order`` (``desc``, the default, or ``asc``); ``first_id``, ``last_id``,
    ``has_more``. ``include`` is accepted (no extra data exists to include)."""
    rec = await _record(st, request, response_id)
    return paginate(rec["input_items"], after, limit, order)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, request: Request, st: State) -> dict:
    """Cancel a background response (OpenAI ``responses.cancel``): its status becomes
    ``cancelled`` unless it had finished; 400 for one not run in the background."""
    return await cancel_response(st, owner_of(request), response_id)
