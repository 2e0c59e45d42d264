"""``/v1/streams``: live video streams. Frames arrive over time (``/frames``, or a
WebSocket), each prefilled into the stream's held prefix as it comes; questions
(``/ask``) prefill only what follows the last frame. The state, the window rule and the
held prefix are in :mod:`api.streams`, the frame intake in :mod:`api.stream_frames`;
docs/api.md documents the routes and docs/video.md the window rule.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.types import Message

from api.cache_fields import CacheSaltField, effective_salt
from api.disconnect import request_token, until_cancelled
from api.errors import (
    APIError,
    ClientDisconnected,
    deny_websocket,
    describe_validation_errors,
)
from api.generation import check_questions, make_requests, sampling_params
from api.ids import STREAM
from api.json_body import JSONBodyRoute, parse_json_object, read_json_object
from api.openai_format import usage
from api.routes_videos import clip_prompt
from api.schemas import STRICT, Detail, NoLogprobsFields, SamplingFields
from api.sse import SSE_HEADERS
from api.state import ServerState, State
from api.stream_frames import (
    Incoming,
    check_timestamps,
    json_frames,
    prepare,
    read_frames,
    smallest_frame_bytes,
)
from api.streams import (
    ASK_ROOM_TOKENS,
    DEFAULT_MAX_FRAMES,
    MAX_TIMESTAMP_S,
    Stream,
    StreamFrame,
    StreamRegistry,
    check_window,
    frame_mode,
)
from api.submit import Submission
from mmserve import cancel
from mmserve.types import EngineRequest

router = APIRouter(route_class=JSONBodyRoute)


class StreamCreateRequest(CacheSaltField):
    """``POST /v1/streams`` body."""

    model_config = STRICT
    model: str | None = Field(default=None, description="the served model (default: it)")
    fps: float | None = Field(
        default=None, gt=0, le=120, description="frames kept per second (default: every frame)"
    )
    max_frames: int | None = Field(default=None, ge=1, description="most frames in the window")
    roll_frames: int | None = Field(
        default=None, ge=1, description="frames between two rolls of a full window"
    )
    detail: Detail | None = Field(default=None, description="frame view, as an image's detail")
    system: str | None = Field(default=None, description="an optional system message")


class StreamWindow(BaseModel):
    """``window`` of an ask: the last ``frames`` frames or the last ``seconds`` seconds."""

    model_config = STRICT
    frames: int | None = Field(default=None, ge=1)
    seconds: float | int | None = Field(default=None, ge=0)


class StreamAskRequest(NoLogprobsFields, SamplingFields, CacheSaltField):
    """``POST /v1/streams/{id}/ask`` body: the body of ``/v1/images/{id}/ask`` plus
    ``window`` and ``stream``. ``system`` defaults to the stream's (another one starts
    another prompt: the held prefix is not reused); ``detail`` is the stream's (set when
    it was made), so only that value is accepted."""

    questions: list[str] = Field(min_length=1)
    system: str | None = Field(default=None, description="default: the stream's system")
    detail: Detail | None = Field(default=None, description="the stream's detail (only)")
    window: int | StreamWindow | None = Field(
        default=None, description="last N frames (an integer, or {frames}) or {seconds}"
    )
    stream: bool = False
    stream_format: Literal["sse", "ndjson"] | None = None


def registry(st: ServerState) -> StreamRegistry:
    """The app's stream registry (made on first use)."""
    reg = getattr(st, "streams", None)
    if reg is None:
        reg = st.streams = StreamRegistry(st.settings.max_streams, st.settings.stream_idle_seconds)
    return reg


_CREATE_BODY = {
    "requestBody": {
        "required": False,
        "content": {"application/json": {"schema": StreamCreateRequest.model_json_schema()}},
    }
}


@router.post("/v1/streams", openapi_extra=_CREATE_BODY)
async def create_stream(request: Request, st: State) -> dict:
    """Open a live stream (bounded by ``--max-streams``: 429 beyond). The JSON body
    (:class:`StreamCreateRequest`) may be left out: every field has a default."""
    fields: dict = {}
    if (await request.body()).strip():
        _, fields = await read_json_object(request)
    try:
        body = StreamCreateRequest.model_validate(fields)
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors())
        raise APIError(400, message, param=param) from None
    st.check_model(body.model)
    check_questions([], 0, st.engine.processor, body.system)  # every ask would refuse it
    family = st.engine.model.family
    layout = family.stream_layout()
    if layout == "video" and body.detail not in (None, "auto"):
        raise APIError(
            400,
            "detail: this model takes a stream's frames on its video path, which has one "
            'frame size; leave detail out or send "auto"',
            param="detail",
        )
    detail = body.detail or "auto"
    mode = frame_mode(st, layout, detail)
    most = _most_frames(st, layout, mode)
    max_frames = body.max_frames or min(DEFAULT_MAX_FRAMES, most)
    if max_frames > most:
        raise APIError(
            400,
            f"max_frames: {max_frames} frames do not fit: at most {most} frames fit one prompt "
            "of this model (its context, and --max-video-frames or --max-images-per-request)",
            param="max_frames",
        )
    floor = await smallest_frame_bytes(st, mode, registry(st).frame_floor)
    check_window(max_frames, floor, st.settings.max_stream_pixel_bytes)
    roll = body.roll_frames or max(1, max_frames // 2)
    if roll > max_frames:
        raise APIError(
            400, f"roll_frames: {roll} is more than max_frames ({max_frames})", param="roll_frames"
        )
    stream = registry(st).add(
        st,
        salt=effective_salt(body.cache_salt, st.settings.shared_cache),
        layout=layout,
        mode=mode,
        fps=body.fps,
        max_frames=max_frames,
        roll_frames=roll,
        detail=detail,
        system=body.system,
    )
    return {**stream.info(), "model": st.model_name}


def _most_frames(st: ServerState, layout: str, mode: str) -> int:
    """Most frames one stream prompt can hold: the frame limit of the layout, the image
    tokens one request may have (``--max-image-tokens-per-request``), and what fits the
    context (and the KV pool) with room for a question and its answer, each frame
    counted as its run plus its layout's own text (:func:`frame_text_tokens`)."""
    processor, config = st.engine.processor, st.engine.config
    side = processor.shortest_edge
    run = st.engine.model.image_tokens(side, side, mode)
    room = min(processor.max_context, processor.kv_capacity_tokens) - ASK_ROOM_TOKENS
    limit = st.settings.max_video_frames if layout == "video" else config.max_images_per_request
    runs = config.max_image_tokens_per_request // max(1, run)  # the processor's image budget
    per_frame = run + frame_text_tokens(st, layout)
    return max(1, min(limit, runs, room // max(1, per_frame)))


def frame_text_tokens(st: ServerState, layout: str) -> int:
    """Text tokens a frame brings beside its run on ``layout``: none on the video layout
    (the frames' runs follow each other; its one video newline is in the ask's room);
    on the images layout its ``Frame at 1.5s:`` label, tokenized with the longest timestamp
    a frame may have (:data:`~api.streams.MAX_TIMESTAMP_S`: no label is longer) and one
    token for the text around its image."""
    if layout == "video":
        return 0
    label = f"Frame at {MAX_TIMESTAMP_S:.1f}s: "
    return len(st.engine.model.tokenizer.encode(label, add_special_tokens=False)) + 1


@router.get("/v1/streams/{stream_id}")
async def get_stream(stream_id: str, st: State) -> dict:
    """A stream's frames held, tokens cached, window and counts; 404 if unknown."""
    return {**(await _stream(st, stream_id)).info(), "model": st.model_name}


@router.delete("/v1/streams/{stream_id}")
async def delete_stream(stream_id: str, st: State) -> dict:
    """End a stream: its prefill aborted, its held prefix released; 404 if unknown."""
    stream = await _stream(st, stream_id)
    removed = await registry(st).delete(st, stream)
    return STREAM.deleted(stream_id, removed, "stream_id")


@router.post("/v1/streams/{stream_id}/frames")
async def post_frames(stream_id: str, request: Request, st: State) -> dict:
    """Add frames (multipart ``file`` fields with optional ``timestamp`` fields, JSON
    ``{"frames": [{"data", "timestamp"}]}``, or ``{"video_id", ...}`` to replay an
    uploaded video). All are checked and prepared before any joins: a bad one refuses
    the post (400 naming its field) and the stream stays as it was."""
    stream = await _stream(st, stream_id)
    stream.touch()
    frames = await read_frames(request, st, stream)
    return _take(st, stream, frames)


def _take(st: ServerState, stream: Stream, frames: list[Incoming]) -> dict:
    """Add prepared ``frames`` to ``stream`` (thinned by its fps) and start its prefill."""
    if stream.closed:
        raise STREAM.not_found(stream.id, "stream_id")
    check_timestamps(stream, frames)  # again: another post may have come in meanwhile
    size = max((fr.image.pixels.nbytes for fr in frames if fr.image and fr.image.pixels), default=0)
    registry(st).reserve_pixels(stream, size, st.settings.max_stream_pixel_bytes)
    segment = stream.segment
    out = []
    for fr in frames:
        assert fr.image is not None
        ts = fr.timestamp if fr.timestamp is not None else stream.default_timestamp()
        kept = stream.add(ts, fr.image)
        out.append({"timestamp": ts, "kept": kept, "image_id": fr.image.id})
        if kept:
            out[-1]["frame"] = stream.frames[-1].number
    if any(f["kept"] for f in out):
        stream.prefill(st)
    stream.touch()
    return {
        "id": stream.id,
        "object": "stream.frames",
        "accepted": sum(f["kept"] for f in out),
        "thinned": sum(not f["kept"] for f in out),
        "rolled": stream.segment != segment,
        "frames": out,
        "frames_held": len(stream.frames),
        "frames_thinned": stream.thinned,
    }


@router.post("/v1/streams/{stream_id}/ask", response_model=None)
async def ask_stream(
    stream_id: str, body: StreamAskRequest, request: Request, st: State
) -> dict | StreamingResponse:
    """Answer questions about the stream's window (or its last ``window`` frames or
    seconds), in the shape of ``/v1/images/{id}/ask``; ``stream: true`` sends the answers'
    text as it comes (server-sent events, or ``stream_format: "ndjson"``)."""
    stream = await _stream(st, stream_id)
    stream.touch()
    reqs, frames = await _ask_requests(st, stream, body)
    if stream.closed:  # deleted while the prompts were built: nothing was submitted
        raise STREAM.not_found(stream.id, "stream_id")
    head = _head(st, stream, frames)
    if body.stream:
        sub = st.client.submit(reqs)
        stream.asks.add(sub)
        events = until_cancelled(
            _streamed(st, stream, sub, body.questions, head), request_token(request)
        )
        if body.stream_format == "ndjson":
            return StreamingResponse(
                (json.dumps(e) + "\n" async for e in events), media_type="application/x-ndjson"
            )
        return StreamingResponse(
            _sse(events),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    results = await _answers(stream, st.client.submit(reqs, final_only=True), request)
    stream.touch()
    return {**head, **answers_body(body.questions, results)}


async def _answers(stream: Stream, sub: Submission, request: Request | None) -> list:
    """An ask's results; the stream's delete cancels ``sub`` (:meth:`Stream.close`).

    Raises:
        APIError: 404 ``stream_not_found`` when the stream was deleted meanwhile.
        ClientDisconnected: ``request``'s client went away first.
    """
    stream.asks.add(sub)
    try:
        return await sub.answers(request)
    except cancel.Cancelled:
        if stream.closed:
            raise STREAM.not_found(stream.id, "stream_id") from None
        raise
    finally:
        stream.asks.discard(sub)
        stream.touch()  # an ask is activity until its answer is out


def answers_body(questions: list[str], results: list) -> dict:
    """``answers`` and total ``usage`` of an ask, as ``/v1/images/{id}/ask`` has them
    (each usage also with ``cached_tokens`` at its top level)."""
    answers = []
    for i, (q, r) in enumerate(zip(questions, results, strict=True)):
        u = usage([r])
        u["cached_tokens"] = u["prompt_tokens_details"]["cached_tokens"]
        answers.append(
            {
                "index": i,
                "question": q,
                "answer": r.text,
                "finish_reason": r.finish_reason,
                "usage": u,
            }
        )
    total = {
        k: sum(a["usage"][k] for a in answers)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    }
    total["prompt_tokens_details"] = {
        k: sum(a["usage"]["prompt_tokens_details"][k] for a in answers)
        for k in ("cached_tokens", "image_tokens", "video_tokens")
    }
    return {"answers": answers, "usage": total}


async def _streamed(
    st: ServerState, stream: Stream, sub: Submission, questions: list[str], head: dict
) -> AsyncIterator[dict]:
    """A streamed ask's events: ``stream.answer.delta`` per new text, then the whole
    answers object (``stream.answers``); an error event if the stream is deleted first."""
    results: list = [None] * len(questions)
    try:
        async for i, upd in sub.updates():
            if upd.delta_text:
                yield {"object": "stream.answer.delta", "index": i, "delta": upd.delta_text}
            if upd.result is not None:
                err = st.client.failure(upd.result)
                if err is not None:
                    yield {
                        "object": "error",
                        **err.body(),
                    }
                    sub.cancel()
                    return
                results[i] = upd.result
    except cancel.Cancelled:
        if not stream.closed:
            raise
        e = STREAM.not_found(stream.id, "stream_id")
        yield {"object": "error", **e.body()}
        return
    finally:
        stream.asks.discard(sub)
        stream.touch()
    yield {**head, **answers_body(questions, results)}


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for e in events:
        yield f"data: {json.dumps(e)}\n\n"
    yield "data: [DONE]\n\n"


def _window(stream: Stream, window: int | StreamWindow | None) -> list[StreamFrame]:
    """The frames an ask covers.

    Raises:
        APIError: 400 naming ``window`` for an empty one (no frames yet, or none in it).
    """
    if isinstance(window, StreamWindow) and (window.frames is None) == (window.seconds is None):
        raise APIError(
            400,
            'window: give one of "frames" and "seconds" (or an integer: frames)',
            param="window",
        )
    if isinstance(window, int) and window < 1:
        raise APIError(400, "window: must be at least 1 frame", param="window")
    if isinstance(window, int):
        frames = stream.window(frames=window)
    elif window is not None:
        frames = stream.window(window.frames, window.seconds)
    else:
        frames = stream.window()
    if not frames:
        raise APIError(
            400,
            "window: the stream has no frames yet; post frames first "
            f"(POST /v1/streams/{stream.id}/frames)",
            param="window",
            code="stream_empty",
        )
    return frames


def _window_info(frames: list[StreamFrame]) -> dict:
    return {
        "frames": len(frames),
        "first_frame": frames[0].number,
        "start": frames[0].timestamp,
        "end": frames[-1].timestamp,
    }


async def _stream(st: ServerState, stream_id: str) -> Stream:
    """The current tenant's stream ``stream_id``.

    Raises:
        APIError: 404 for a malformed, unknown, deleted, expired or another tenant's id.
    """
    ident = STREAM.check(stream_id, "stream_id", 404)
    found = await registry(st).get(st, ident)
    if found is None:
        raise STREAM.not_found(ident, "stream_id")
    return found


async def _ask_requests(
    st: ServerState, stream: Stream, body: StreamAskRequest
) -> tuple[list[EngineRequest], list[StreamFrame]]:
    """The ask's frames (its ``window``) and one engine request per question: the
    ``/qa`` clip prompt over them (the system message first), under the stream's cache
    salt unless the ask gives its own ``cache_salt``.

    Raises:
        APIError: 400 naming the field at fault (the body's fields are checked before
            the window).
    """
    st.check_model(body.model)
    check_questions(body.questions, st.settings.max_questions, st.engine.processor, body.system)
    if body.stream_format is not None and not body.stream:
        raise APIError(
            400, "stream_format: only with stream: true (the answers are sent whole)",
            param="stream_format",
        )  # fmt: skip
    params = sampling_params(body)
    salt = stream.salt
    if body.cache_salt:
        salt = effective_salt(body.cache_salt, st.settings.shared_cache)
    if body.detail is not None and body.detail != stream.detail:
        raise APIError(
            400,
            f"detail: this stream's frames are prepared with detail {stream.detail!r}, set "
            "when it was made; leave detail out or send that value",
            param="detail",
        )
    text = body.system if body.system is not None else stream.system
    system = [{"role": "system", "content": text}] if text else []
    frames = _window(stream, body.window)
    clip = stream.clip(frames)
    reqs: list[EngineRequest] = []
    for q in body.questions:
        msgs, images, videos = clip_prompt(st, clip, system, q)
        reqs += await make_requests(
            st.engine.processor,
            msgs,
            images,
            params,
            1,
            st.settings.default_max_tokens,
            videos,
            details=stream.details(st, len(frames)),
            cache_salt=salt,
        )
    return reqs, frames


def _head(st: ServerState, stream: Stream, frames: list[StreamFrame]) -> dict:
    return {
        "id": f"ask-{uuid.uuid4().hex}",
        "object": "stream.answers",
        "created": int(time.time()),
        "model": st.model_name,
        "stream_id": stream.id,
        "window": _window_info(frames),
    }


# ---- WebSocket ----------------------------------------------------------------------


@router.websocket("/v1/streams/{stream_id}/ws")
async def stream_socket(websocket: WebSocket, stream_id: str) -> None:
    """Frames in, answers out, over one connection (docs/api.md): a binary message is
    one encoded frame; a text message is JSON: ``{"frames": [...]}`` (as ``/frames``),
    ``{"type": "frame", "data", "timestamp"}`` (one frame) or ``{"type": "ask", ...}``
    (an ask's body; ``type`` may be left out when it has ``questions``). Each gets one
    JSON reply (``frames``, ``answers``, or ``error`` in the API's error shape; the
    connection stays). The stream lives as long as the connection: closing it deletes
    the stream."""
    st: ServerState = websocket.app.state.mm
    try:
        stream = await _stream(st, stream_id)
    except APIError as e:  # refused at the handshake: the HTTP status and the JSON body
        body = e.body()
        await deny_websocket(websocket.scope, websocket.send, e.status, body)
        return
    await websocket.accept()
    stream.sockets += 1
    # cancelled when the client goes: an ask then in flight is aborted in the engine
    token = cancel.CancelToken()
    inbox: asyncio.Queue[Message | None] = asyncio.Queue(maxsize=SOCKET_INBOX)
    reader = asyncio.create_task(_read_socket(websocket, inbox, token))
    try:
        with cancel.using(token):
            while (msg := await inbox.get()) is not None:
                try:
                    reply = await _socket_message(st, stream, msg)
                except APIError as e:
                    reply = {"type": "error", **e.body()}
                await websocket.send_text(json.dumps(reply))
    except (WebSocketDisconnect, ClientDisconnected, cancel.Cancelled, RuntimeError):
        return
    finally:
        token.cancel("client disconnected")
        reader.cancel()
        stream.sockets -= 1
        stream.touch()
        # the client vanished: the stream ends with it (its prefix released)
        await asyncio.shield(registry(st).delete(st, stream))


#: Messages a WebSocket reads ahead of the one being answered (the reader keeps reading
#: so that it sees the client leave during a long ask; past this it waits).
SOCKET_INBOX = 8


async def _read_socket(
    websocket: WebSocket, inbox: asyncio.Queue[Message | None], token: cancel.CancelToken
) -> None:
    """Move the socket's messages into ``inbox`` until the client leaves, then cancel
    ``token`` (aborting an ask in flight) and put ``None``."""
    try:
        while (msg := await websocket.receive())["type"] != "websocket.disconnect":
            await inbox.put(msg)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        token.cancel("client disconnected")
        if inbox.full():  # the client is gone: its unread messages go with it
            inbox.get_nowait()
        inbox.put_nowait(None)


async def _socket_message(st: ServerState, stream: Stream, msg: Mapping[str, Any]) -> dict:
    """One WebSocket message's reply (see :func:`stream_socket`)."""
    if stream.closed:
        raise STREAM.not_found(stream.id, "stream_id")
    stream.touch()
    if msg.get("bytes") is not None:
        frames = [Incoming(msg["bytes"], None, "file", "timestamp")]
        return {"type": "frames", **_take(st, stream, await prepare(st, stream, frames))}
    text = msg.get("text") or ""
    body = parse_json_object(text.encode("utf-8", "surrogatepass"), st.settings.max_json_depth)
    kind = body.pop("type", "ask" if "questions" in body else "frames")
    if kind == "frame":  # one frame: {"type": "frame", "data": ..., "timestamp": ...}
        kind, body = "frames", {"frames": [body]}
    if kind == "frames":
        frames = await prepare(st, stream, await json_frames(body, st, stream))
        return {"type": "frames", **_take(st, stream, frames)}
    if kind != "ask":
        raise APIError(
            400, f'type: {str(kind)[:40]!r}; send "frame", "frames" or "ask"', param="type"
        )
    try:
        ask = StreamAskRequest.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors())
        raise APIError(400, message, param=param) from None
    if ask.stream:
        raise APIError(
            400, "stream: a WebSocket ask answers whole; leave stream out", param="stream"
        )
    return {"type": "answers", **await _socket_ask(st, stream, ask)}


async def _socket_ask(st: ServerState, stream: Stream, body: StreamAskRequest) -> dict:
    reqs, frames = await _ask_requests(st, stream, body)
    if stream.closed:  # deleted while the prompts were built
        raise STREAM.not_found(stream.id, "stream_id")
    results = await _answers(stream, st.client.submit(reqs, final_only=True), None)
    return {**_head(st, stream, frames), **answers_body(body.questions, results)}


async def close_streams(st: ServerState) -> None:
    """Delete every live stream (the app's shutdown)."""
    if st.streams is not None:
        await st.streams.close(st)
