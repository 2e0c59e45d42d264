"""``POST /v1/responses``: OpenAI's Responses API for text and image input, text output.

The work (check, prepare, answer) is its handler's
(:data:`api.endpoints.responses.RESPONSES`), shared with batch lines.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.endpoints.responses import RESPONSES
from api.json_body import JSONBodyRoute
from api.schemas import ResponsesRequest
from api.state import State

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, st: State) -> dict | Response:
    """Create a model response (OpenAI ``responses.create``), streamed as server-sent
    events when ``stream`` is set. Responses are not stored (``store`` must be false or
    absent); unsupported fields get a 400 naming them."""
    return await RESPONSES.serve(st, body, request)
