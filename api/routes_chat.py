"""``/v1/models`` and ``/v1/chat/completions`` (OpenAI shape, streaming, logprobs, ``n``).

The chat completion's work (check, prepare, answer) is its handler's
(:data:`api.endpoints.chat.CHAT`), shared with batch lines.
"""

from __future__ import annotations

import functools

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


#: The model card's ``note`` for a checkpoint of random weights.
RANDOM_NOTE = (
    "This model's weights are seeded random numbers (mmserve make-model, the bundled "
    "default model): its answers are noise, meant for trying the server, not the model"
)


@functools.lru_cache(maxsize=8)
def _random_weights(model_path: str | None) -> bool:
    from mmserve.testing.checkpoints import random_weights_checkpoint

    return random_weights_checkpoint(model_path)


def _model_card(st: ServerState) -> dict:
    card = {
        "id": st.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "mmserve",
        "max_model_len": st.engine.max_context,
        "random_weights": _random_weights(st.engine.config.model_path),
    }
    if card["random_weights"]:
        card["note"] = RANDOM_NOTE
    return card


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, st: State
) -> dict | Response:
    """OpenAI chat completion, streamed as server-sent events when ``stream`` is set.

    ``tool_choice`` ``"required"`` or a named function is enforced by constrained
    decoding and answered as ``tool_calls`` (:func:`api.structured.tool_calling`).
    """
    return await CHAT.serve(st, body, request)
