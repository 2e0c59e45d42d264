"""``/v1/models`` and ``/v1/chat/completions`` (OpenAI shape, streaming, logprobs, ``n``).

The chat completion's work (check, prepare, answer) is its handler's
(:data:`api.endpoints.chat.CHAT`), shared with batch lines.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.endpoints.chat import CHAT
from api.json_body import JSONBodyRoute
from api.schemas import ChatCompletionRequest
from api.state import ServerState, State

router = APIRouter(route_class=JSONBodyRoute)


@router.get("/v1/models")
async def list_models(st: State) -> dict:
    """The one served model, in the OpenAI list shape."""
    return {"object": "list", "data": [_model_card(st)]}


@router.get("/v1/models/{model}")
async def get_model(model: str, st: State) -> dict:
    """The served model's card; 404 for any other name."""
    st.check_model(model)
    return _model_card(st)


def _model_card(st: ServerState) -> dict:
    return {
        "id": st.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "mmserve",
        "max_model_len": st.engine.max_context,
    }


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, st: State
) -> dict | Response:
    """OpenAI chat completion, streamed as server-sent events when ``stream`` is set.

    ``tool_choice`` ``"required"`` or a named function is enforced by constrained
    decoding and answered as ``tool_calls`` (:func:`api.structured.tool_calling`).
    """
    return await CHAT.serve(st, body, request)
