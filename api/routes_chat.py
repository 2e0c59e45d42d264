"""``/v1/models`` and ``/v1/chat/completions`` (OpenAI shape, streaming, logprobs, ``n``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import NamedTuple

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from api.errors import APIError, field_path
from api.generation import log_end_user, make_requests, sampling_params, template_options
from api.json_body import JSONBodyRoute
from api.media import check_image_count
from api.openai_format import TokenText, chat_completion, chat_stream
from api.schemas import ChatCompletionRequest, ChatMessage, ContentPart
from api.state import ServerState, State
from api.structured import ToolCalling, tool_calling
from api.video_media import VideoPart, fewer_frames, frame_parts, resolve_video, selection
from mmserve.frontend.prompt import NEW_TURN, ChatTemplateOptions
from mmserve.model.families.base import FRAME_MODE
from mmserve.types import EngineRequest, SamplingParams
from mmserve.vision.inputs import ImageInput

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
    st.check_model(body.model)
    n = body.n or 1
    if n > st.settings.max_n:
        raise APIError(400, f"n is {n}; the limit is {st.settings.max_n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400,
            "stream_options: not used without stream: true (a plain response always has usage)",
            param="stream_options",
        )
    reqs, params, tools = await prepare_chat(st, body)
    tokens = None
    if params.logprobs is not None:  # the byte table is built once, off the event loop
        tokens = await run_in_threadpool(TokenText, st.engine.model.tokenizer)
    sub = st.client.submit(reqs)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        holdback = max((len(s) for s in params.stop), default=1) - 1
        events = chat_stream(
            sub, cid, created, st.model_name, tokens, include_usage, holdback, tools
        )
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    results = await sub.answers(request)
    return chat_completion(cid, created, st.model_name, results, tokens, tools)


async def prepare_chat(
    st: ServerState, body: ChatCompletionRequest
) -> tuple[list[EngineRequest], SamplingParams, ToolCalling | None]:
    """The engine requests of a chat completion body (``n`` of them), its sampling
    parameters and its enforced tool call (None without one).

    Shared by the route and batch jobs (:mod:`api.batches`); ``n`` and ``stream`` are
    the caller's to check.

    Raises:
        APIError: 400 naming the field at fault (sampling fields, media, prompt limits).
    """
    tools = tool_calling(body)
    params = sampling_params(body)
    if tools is not None:
        params = replace(params, guided=tools.spec)
    messages, urls = _split_images(body.messages, st.engine.config.max_images_per_request)
    template = template_options(body, messages)
    reqs = await engine_requests(st, messages, urls, params, body.n or 1, template)
    log_end_user(body, reqs)
    return reqs, params, tools


class MediaRef(NamedTuple):
    """A media part of a prompt: its url, the request field naming it, the video's frame
    fields and where they sit (None for an image) and an image's ``detail`` ("auto",
    "low" or "high")."""

    url: str
    param: str
    frames: VideoPart | None = None
    detail: str = "auto"


async def engine_requests(
    st: ServerState,
    messages: list[dict],
    urls: list[MediaRef],
    params: SamplingParams,
    n: int = 1,
    template: ChatTemplateOptions = NEW_TURN,
) -> list[EngineRequest]:
    """Resolve the media of ``messages`` (``urls`` as :func:`_split_images` gives them:
    upload ids, data URLs, allowed files or remote URLs; videos become their sampled
    frames; each image in the view its ``detail`` asks for) and build ``n`` engine
    requests, the prompt ending as ``template`` says.

    Raises:
        APIError: 400 naming the part at fault (unknown id, undecodable image, too many
            images, prompt too long, ...).
    """
    video_path = st.engine.model.video_token_id is not None
    processor = st.engine.processor
    # one image at a time: decoded, hashed, preprocessed, its pixels dropped, in the mode
    # its prompt gives it (frames without a video path are images of the prompt too)
    pixels = processor.request_pixels()
    num_images = sum(ref.frames is None for ref in urls)
    frame_mode = FRAME_MODE if video_path else processor.image_mode(num_images)
    media = []
    for ref in urls:
        if ref.frames is None:
            mode = processor.image_mode(num_images, ref.detail)
            media.append(await st.media.resolve(ref.url, ref.param, mode, pixels))
        else:  # a video: its sampled frames, each an image
            media.append(
                await resolve_video(st, ref.url, ref.frames, ref.param, frame_mode, pixels)
            )
    messages, images, videos, details = _expand_videos(
        messages, media, st.engine.config.max_images_per_request, video_path, urls
    )
    return await make_requests(
        st.engine.processor,
        messages,
        images,
        params,
        n,
        st.settings.default_max_tokens,
        videos,
        template,
        details,
    )


def _split_images(
    messages: list[ChatMessage], max_images: int
) -> tuple[list[dict], list[MediaRef]]:
    """Engine messages with image and video parts, and each one's :class:`MediaRef` in
    order.

    Raises:
        APIError: 400 for a message against OpenAI's rules for its role
            (:func:`check_message`), more images than ``max_images`` (before any is
            decoded), an image outside a user message, or an image part without a url.
    """
    out, urls = [], []
    for i, m in enumerate(messages):
        check_message(m, i)
        role = "system" if m.role == "developer" else m.role
        if m.content is None or isinstance(m.content, str):
            out.append({"role": role, "content": m.content or ""})
            continue
        parts = []
        for j, p in enumerate(m.content):
            param = field_path(["messages", i, "content", j])
            _check_part_fields(p, param)
            if p.type == "text":
                parts.append({"type": "text", "text": p.text or ""})
                continue
            src = p.image_url if p.type == "image_url" else p.video_url
            url = src if isinstance(src, str) else src.url if src is not None else ""
            if not url:
                raise APIError(400, f"{param}: {p.type} part without a url", param=param)
            if m.role != "user":
                raise APIError(
                    400, f"{param}: media are only allowed in user messages", param=param
                )
            if p.type == "video_url":  # frame fields on the video_url object or on the part
                on_url = not isinstance(src, str) and bool(_given(src, _FRAME_FIELDS))
                on_part = sorted(_given(p, _FRAME_FIELDS))
                if on_url and on_part:
                    where = f"{param}.{on_part[0]}"
                    raise APIError(
                        400,
                        f"{where}: frame fields are given on both the part and its video_url; "
                        "give them in one place",
                        param=where,
                    )
                fields, at = (src, f"{param}.video_url.") if on_url else (p, f"{param}.")
                urls.append(MediaRef(url, f"{param}.video_url", VideoPart(selection(fields), at)))
                parts.append({"type": "video"})
            else:
                # the field holding the url: image_url itself, or its "url" key
                at = f"{param}.image_url" if isinstance(src, str) else f"{param}.image_url.url"
                detail = "auto" if isinstance(src, str) else src.detail or "auto"
                urls.append(MediaRef(url, at, None, detail))
                parts.append({"type": "image"})
        out.append({"role": role, "content": parts})
    check_image_count(sum(ref.frames is None for ref in urls), max_images, "messages")
    return out, urls


def check_message(m: ChatMessage, i: int) -> None:
    """OpenAI's rules for a message of each role: content is required (a string, empty
    allowed, or parts) except in an assistant message with ``tool_calls``; a ``tool``
    message needs ``tool_call_id`` and no other role has one. A well-formed tool turn is
    then refused: the chat templates served cannot render it (the schema refuses
    ``tool_calls`` for the same reason).

    Raises:
        APIError: 400 naming ``messages[i].content``, ``messages[i].tool_call_id`` or
            ``messages[i].role``.
    """
    at = f"messages[{i}]"
    if m.role == "tool" and not m.tool_call_id:
        raise APIError(
            400,
            f"{at}.tool_call_id: required in a tool message (the id of the tool call it answers)",
            param=f"{at}.tool_call_id",
        )
    if m.role != "tool" and m.tool_call_id is not None:
        raise APIError(
            400,
            f"{at}.tool_call_id: not used in a {m.role!r} message (only a tool message has one)",
            param=f"{at}.tool_call_id",
        )
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise APIError(
            400,
            f"{at}.content: {m.role!r} messages need content (a string or a list of "
            "content parts); only an assistant message with tool_calls may have none",
            param=f"{at}.content",
        )
    if m.role == "tool":
        raise APIError(
            400,
            f"{at}.role: 'tool' messages are not supported: this server does not render "
            "tool results into the prompt; give the tool's result as text in a user message",
            param=f"{at}.role",
        )


_FRAME_FIELDS = frozenset({"num_frames", "fps", "timestamps", "max_frames", "max_video_tokens"})
#: The fields each content part type uses (besides ``type``).
_PART_FIELDS = {
    "text": frozenset({"text"}),
    "image_url": frozenset({"image_url"}),
    "video_url": frozenset({"video_url"}) | _FRAME_FIELDS,
}


def _given(part: BaseModel, names: frozenset[str]) -> set[str]:
    """The fields among ``names`` that the client set to something other than null (on
    a content part or its ``video_url``)."""
    return {f for f in part.model_fields_set & names if getattr(part, f) is not None}


def _check_part_fields(part: ContentPart, param: str) -> None:
    """Refuse a field that the part's type does not use (an ``image_url`` on a text
    part, frame fields on an image part) and a text part without text.

    Raises:
        APIError: 400 naming ``messages[i].content[j].<field>``.
    """
    every = frozenset().union(*_PART_FIELDS.values())
    stray = sorted(_given(part, every - _PART_FIELDS[part.type]))
    if stray:
        where = f"{param}.{stray[0]}"
        raise APIError(
            400,
            f"{where}: not used by a {part.type!r} part, so it is refused rather than ignored",
            param=where,
        )
    if part.type == "text" and part.text is None:
        raise APIError(400, f"{param}.text: field required in a text part", param=f"{param}.text")


def _expand_videos(
    messages: list[dict],
    media: list,
    max_images: int,
    video_path: bool = False,
    refs: list[MediaRef] | None = None,
) -> tuple[list[dict], list[ImageInput], list[list[ImageInput]], list[str]]:
    """Split ``media`` (in part order) into images and videos.

    On a model with a video path (``video_path``: LLaVA-OneVision) a video part stays a
    video and its frames go to ``videos``; elsewhere it is replaced by its frames
    (``Frame at 1.5s: <image>``, in order), each an image.

    Args:
        refs: each medium's :class:`MediaRef` (its ``detail``; a video's
            :class:`VideoPart`, to name the frame field at fault).

    Returns:
        ``(messages, images, videos, details)``: ``details`` holds each image's
        ``detail`` from ``refs`` (a video's frames made images: "auto").

    Raises:
        APIError: 400 ``too_many_images`` when the images (frames included, without a video
            path) exceed ``max_images``; with frames among them it names the last video's
            field that decided its frame count (``...video_url.fps``, ...).
    """
    images: list[ImageInput] = []
    videos: list[list[ImageInput]] = []
    details: list[str] = []
    blame: tuple[VideoPart, int] | None = None  # the last video and its frame count
    it = iter(zip(media, refs or [None] * len(media), strict=True))
    out = []
    for m in messages:
        if isinstance(m["content"], str):
            out.append(m)
            continue
        content = []
        for p in m["content"]:
            if p["type"] == "image":
                image, ref = next(it)
                images.append(image)
                details.append(ref.detail if ref is not None else "auto")
                content.append(p)
            elif p["type"] == "video" and video_path:
                videos.append([fr.image for fr in next(it)[0]])
                content.append(p)
            elif p["type"] == "video":
                frames, ref = next(it)
                if ref is not None and ref.frames is not None:
                    blame = (ref.frames, len(frames))
                images += [fr.image for fr in frames]
                details += ["auto"] * len(frames)
                content += frame_parts(frames)
            else:
                content.append(p)
        out.append({**m, "content": content})
    if blame is not None and len(images) > max_images:
        part, n = blame
        field = part.param(n)
        room = max(0, max_images - (len(images) - n))
        raise APIError(
            400,
            f"{field}: {len(images)} images in one request (video frames count one each; "
            f"this video's {n} frames among them); the limit is {max_images} images per "
            f"request; {fewer_frames(field.rsplit('.', 1)[-1], room)}",
            param=field,
            code="too_many_images",
        )
    check_image_count(len(images), max_images, "messages")
    return out, images, videos, details
