"""``/v1/models`` and ``/v1/chat/completions`` (OpenAI shape, streaming, logprobs, ``n``)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from api.errors import APIError
from api.generation import make_requests, sampling_params
from api.openai_format import TokenText, chat_completion, chat_stream
from api.schemas import ChatCompletionRequest, ChatMessage
from api.state import ServerState, State
from api.submit import ClientDisconnected

router = APIRouter()


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
    """OpenAI chat completion, streamed as server-sent events when ``stream`` is set."""
    st.check_model(body.model)
    n = body.n or 1
    if n > st.settings.max_n:
        raise APIError(400, f"n is {n}; the limit is {st.settings.max_n}", param="n")
    params = sampling_params(body)
    messages, urls = _split_images(body.messages, st.engine.config.max_images_per_request)
    images = [await st.media.resolve(url, param) for url, param in urls]
    reqs = await make_requests(
        st.engine, messages, images, params, n, st.settings.default_max_tokens
    )
    sub = st.client.submit(reqs)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    tokens = TokenText(st.engine.model.tokenizer.decode) if params.logprobs is not None else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        holdback = max((len(s) for s in params.stop), default=1) - 1

        def on_failure(result) -> str | None:  # noqa: ANN001
            return st.client.failure().message if st.client.engine_failed(result) else None

        events = chat_stream(
            sub, cid, created, st.model_name, tokens, include_usage, holdback, on_failure
        )
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        results = await sub.wait(request)
    except ClientDisconnected:
        return Response(status_code=499)
    if any(st.client.engine_failed(r) for r in results):
        raise st.client.failure()
    return chat_completion(cid, created, st.model_name, results, tokens)


def _split_images(
    messages: list[ChatMessage], max_images: int
) -> tuple[list[dict], list[tuple[str, str]]]:
    """Engine messages with image parts, and each image's ``(url, param)`` in order.

    Raises:
        APIError: 400 for more images than ``max_images`` (before any is decoded), an
            image outside a user message, or an image part without a url.
    """
    out, urls = [], []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if m.content is None or isinstance(m.content, str):
            out.append({"role": role, "content": m.content or ""})
            continue
        parts = []
        for j, p in enumerate(m.content):
            param = f"messages.{i}.content.{j}"
            if p.type == "text":
                parts.append({"type": "text", "text": p.text or ""})
                continue
            iu = p.image_url
            url = iu if isinstance(iu, str) else iu.url if iu is not None else ""
            if not url:
                raise APIError(400, f"{param}: image_url part without a url", param=param)
            if m.role != "user":
                raise APIError(
                    400, f"{param}: images are only allowed in user messages", param=param
                )
            urls.append((url, f"{param}.image_url"))
            parts.append({"type": "image"})
        out.append({"role": role, "content": parts})
    if len(urls) > max_images:
        raise APIError(
            400,
            f"{len(urls)} images in one request; the limit is {max_images}",
            param="messages",
            code="too_many_images",
        )
    return out, urls
