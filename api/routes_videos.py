"""``/v1/videos``: upload, list, get, delete, and question answering over sampled frames.

Every sampled frame is an image with its own content key, so a frame repeated
in a static scene, in two overlapping clips or in another upload of the same
footage runs the vision tower once and shares its KV through the radix cache.
Question answering skips selected frames that do not decode (a damaged stream)
and lists them as ``skipped_frames``; a ``video_url`` in a chat completion
cannot skip and is refused with a 400 that names them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from api.cache_fields import effective_salt
from api.disconnect import request_token, until_cancelled
from api.errors import APIError
from api.generation import check_questions, make_requests, sampling_params
from api.ids import VIDEO
from api.json_body import JSONBodyRoute
from api.schemas import VideoQARequest
from api.sse import SSE_HEADERS
from api.state import ServerState, State
from api.thumbnails import THUMBNAIL_HEADERS, thumbnail_jpeg
from api.uploads import read_upload, upload_body
from api.video_media import VideoPart, expand_video, fewer_frames, frame_parts, selection
from api.video_store import StoredVideo
from mmserve.cancel import Cancelled
from mmserve.model.families.base import FRAME_MODE
from mmserve.types import EngineRequest
from mmserve.vision.inputs import Frame
from mmserve.vision.video import FrameFailure, VideoError

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/videos", openapi_extra=upload_body("video"))
async def upload_video(request: Request, st: State) -> dict:
    """Upload a video: multipart field ``file``, or JSON ``{"data": "<base64>"}``; an
    optional field ``name`` (else the multipart file name) is its display ``name``.

    The file is probed (frame count, fps, duration, size) and refused with a 4xx
    that names the problem if it is not a decodable video within the limits.
    """
    limits = st.settings.video_limits()
    data, param, name = await read_upload(request, limits.max_bytes, "video")
    if len(data) > limits.max_bytes:
        raise APIError(
            413,
            f"video is over {limits.max_bytes} bytes (the server's --max-video-bytes)",
            param=param,
            code="video_too_large",
        )
    try:
        video = await run_in_threadpool(st.engine.processor.open_video, data, limits)
    except VideoError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_video") from None
    return _info(await run_in_threadpool(st.videos.put, data, video.info, name))


@router.get("/v1/videos")
async def list_videos(st: State) -> dict:
    """Stored videos, most recently used first."""
    return {"object": "list", "data": [_info(e) for e in st.videos.list()]}


@router.get("/v1/videos/{video_id}")
async def get_video(video_id: str, st: State) -> dict:
    """Metadata of a stored video; 404 if unknown, deleted or evicted."""
    return _info(_entry(st, video_id))


@router.get("/v1/videos/{video_id}/thumbnail")
async def video_thumbnail(video_id: str, st: State) -> Response:
    """A JPEG of the video's first frame that decodes (frame 0, else its middle frame),
    at most 256 pixels on its longer edge; 404 if unknown."""
    entry = _entry(st, video_id)
    limits = st.settings.video_limits()

    def make() -> bytes:
        video = st.engine.processor.open_video(entry.data, limits)
        for index in (0, video.info.num_frames // 2):
            got = video.decode([index])
            if index in got.images:
                return thumbnail_jpeg(got.images[index])
        raise VideoError("no frame decodes")

    try:
        data = await run_in_threadpool(st.thumbnails.get, video_id, make)
    except VideoError as e:
        raise APIError(404, f"video_id: no thumbnail: {e}", param="video_id") from None
    return Response(data, media_type="image/jpeg", headers=THUMBNAIL_HEADERS)


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, st: State) -> dict:
    """Remove a video from the store; 404 if unknown."""
    deleted = await run_in_threadpool(st.videos.delete, video_id)
    return VIDEO.deleted(video_id, deleted, "video_id")


@router.post("/v1/videos/{video_id}/qa", response_model=None)
async def video_qa(
    video_id: str, body: VideoQARequest, request: Request, st: State
) -> StreamingResponse:
    """Answer questions about frames of a stored video, streaming answers as they finish.

    ``per_frame`` asks every question about every selected frame (one prompt each:
    system + frame + question); ``clip`` puts the selected frames in one prompt, in
    order with their timestamps, and asks each question about the whole clip.
    Newline-delimited JSON (or server-sent events): a ``frames`` event, one
    ``answer`` event per answer (with progress), then a ``summary``. Selected frames
    that do not decode are left out and listed, each once and ascending, as
    ``skipped_frames`` (``[{"index", "timestamp", "reason"}]``, empty for a sound
    video) in the ``frames`` event and the summary; if none decodes, a 400
    ``invalid_video`` names them.
    """
    st.check_model(body.model)
    entry = _entry(st, video_id)
    check_questions(body.questions, st.settings.max_questions, st.engine.processor, body.system)
    params = sampling_params(body)
    processor = st.engine.processor
    if body.mode == "per_frame":  # each frame alone in its prompt
        mode = processor.image_mode(1)
    else:  # a video, or frames as the images of one prompt
        video_path = st.engine.model.video_token_id is not None
        mode = FRAME_MODE if video_path else processor.image_mode(st.settings.max_video_frames)
    part = VideoPart(selection(body), "")
    frames, skipped = await expand_video(
        st, entry.data, part.selection, "video", True, "", mode, processor.request_pixels()
    )
    system = [{"role": "system", "content": body.system}] if body.system else []
    default_tokens = st.settings.default_max_tokens
    salt = effective_salt(body.cache_salt, st.settings.shared_cache)
    jobs: list[tuple[int | None, int]] = []  # (position of the frame or None for clip, question)
    reqs: list[EngineRequest] = []
    if body.mode == "per_frame":
        for k, fr in enumerate(frames):
            for qi, q in enumerate(body.questions):
                msgs = [*system, _user([{"type": "image"}, {"type": "text", "text": q}])]
                reqs += await make_requests(
                    st.engine.processor,
                    msgs,
                    [fr.image],
                    params,
                    1,
                    default_tokens,
                    cache_salt=salt,
                )
                jobs.append((k, qi))
    else:
        if st.engine.model.video_token_id is None:  # frames are images: the image limit
            _check_clip_count(st, len(frames), part)
        for qi, q in enumerate(body.questions):
            msgs, images, videos = clip_prompt(st, frames, system, q)
            try:
                reqs += await make_requests(
                    st.engine.processor,
                    msgs,
                    images,
                    params,
                    1,
                    default_tokens,
                    videos,
                    cache_salt=salt,
                )
            except APIError as e:
                raise await _clip_too_long(st, frames, system, q, params, e, part) from None
            jobs.append((None, qi))
    sub = st.client.submit(reqs, final_only=True)  # each answer is sent whole when done
    sse = body.stream_format == "sse" or (
        body.stream_format is None and "text/event-stream" in request.headers.get("accept", "")
    )
    head = {
        "id": f"videoqa-{uuid.uuid4().hex}",
        "video_id": video_id,
        "mode": body.mode,
        "model": st.model_name,
    }
    head["skipped_frames"] = [_skipped_info(f) for f in skipped]
    # the client hanging up ends the stream (and aborts the answers) at once
    events = until_cancelled(
        _events(st, sub, frames, body.questions, jobs, head), request_token(request)
    )
    if sse:
        return StreamingResponse(
            (f"data: {json.dumps(e)}\n\n" async for e in events),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    return StreamingResponse(
        (json.dumps(e) + "\n" async for e in events), media_type="application/x-ndjson"
    )


async def _events(
    st: ServerState,
    sub,
    frames: list[Frame],
    questions: list[str],
    jobs: list[tuple[int | None, int]],
    head: dict,
) -> AsyncIterator[dict]:
    t0 = time.perf_counter()
    total = len(jobs)
    yield {
        **head,
        "type": "frames",
        "frames": [_frame_info(k, fr) for k, fr in enumerate(frames)],
        "num_answers": total,
    }
    done = 0
    results = []
    async for i, upd in sub.updates():
        res = upd.result
        if res is None:
            continue
        err = st.client.failure(res)
        if err is not None:
            yield {"type": "error", **err.body()}
            sub.cancel()
            return
        done += 1
        results.append(res)
        k, qi = jobs[i]
        ev = {"type": "answer", "completed": done, "total": total}
        if k is not None:
            ev |= {"frame": k, "frame_index": frames[k].index, "timestamp": frames[k].timestamp}
        ev |= {
            "question_index": qi,
            "question": questions[qi],
            "text": res.text,
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            "cached_tokens": res.cached_tokens,
            "completion_tokens": res.completion_tokens,
        }
        yield ev
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    yield {
        **head,
        "type": "summary",
        "frames": len(frames),
        "distinct_frames": len({fr.image.key for fr in frames}),
        "questions": len(questions),
        "answers": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": sum(r.completion_tokens for r in results),
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "vision_tower_runs": sum(r.vision_tower_runs for r in results),
        "seconds": time.perf_counter() - t0,
    }


def clip_prompt(
    st: ServerState, frames: list[Frame], system: list[dict], question: str
) -> tuple[list[dict], list, list[list]]:
    """A clip's messages, images and videos: on a model with a video path (LLaVA-OneVision)
    one video part whose frames are the clip's, in order; elsewhere the frames as images in
    ``Frame at 1.5s: <image>`` lines (:func:`frame_parts`)."""
    text = {"type": "text", "text": question}
    if st.engine.model.video_token_id is not None:
        return [*system, _user([{"type": "video"}, text])], [], [[fr.image for fr in frames]]
    return [*system, _user([*frame_parts(frames), text])], [fr.image for fr in frames], []


def _check_clip_count(st: ServerState, n: int, part: VideoPart) -> None:
    """Refuse a clip of ``n`` frames over the images-per-prompt limit, naming the frame
    field that decided ``n``."""
    most = st.engine.config.max_images_per_request
    if n > most:
        field = part.param(n)
        raise APIError(
            400,
            f"{field}: a clip of {n} frames is over the limit of {most} images per prompt; "
            f"select at most {most} frames ({fewer_frames(field, most)}) or use "
            "mode=per_frame",
            param=field,
            code="clip_too_long",
        )


async def _clip_too_long(st, frames, system, question, params, err, part) -> APIError:
    """The 400 for a clip that does not fit the context: how many frames would, naming
    the frame field that decided their number."""
    field = part.param(len(frames))
    lens = []
    for k in (1, 2):
        msgs, imgs, videos = clip_prompt(st, frames[:k], system, question)
        try:
            p = params if params.max_tokens else _one_token(params)
            r = await run_in_threadpool(
                st.engine.processor.make_request,
                messages=msgs,
                images=imgs,
                params=p,
                videos=videos,
            )
        except Cancelled:  # the client left: the route answers 499, not this 400
            raise
        except Exception:  # noqa: BLE001 - even one frame does not fit
            return APIError(
                400, f"{field}: clip does not fit: {err.message}", param=field, code="clip_too_long"
            )
        lens.append(r.prompt_len)
    per = max(1, lens[1] - lens[0]) if len(frames) > 1 else lens[0]
    room = st.engine.processor.output_room(max(params.max_tokens, 1))
    fit = max(0, (room - (lens[0] - per)) // per)
    return APIError(
        400,
        f"{field}: a clip of {len(frames)} frames does not fit the model's context "
        f"({st.engine.processor.max_context} tokens, {per} tokens per frame): at most {fit} frames "
        f"would; {fewer_frames(field, fit)} or use mode=per_frame ({err.message})",
        param=field,
        code="clip_too_long",
    )


def _one_token(params):
    from dataclasses import replace

    return replace(params, max_tokens=1)


def _user(content: list[dict]) -> dict:
    return {"role": "user", "content": content}


def _frame_info(k: int, fr: Frame) -> dict:
    return {"frame": k, "frame_index": fr.index, "timestamp": fr.timestamp, "image_id": fr.image.id}


def _skipped_info(f: FrameFailure) -> dict:
    return {"index": f.index, "timestamp": f.timestamp, "reason": f.reason}


def _entry(st: ServerState, video_id: str) -> StoredVideo:
    return VIDEO.find(video_id, "video_id", st.videos.get, 404)


def _info(entry: StoredVideo) -> dict:
    i = entry.info
    return {
        "id": entry.id,
        "object": "video",
        "name": entry.name,
        "thumbnail_url": f"/v1/videos/{entry.id}/thumbnail",
        "created_at": int(entry.created),
        "duration": i.duration,
        "fps": i.fps,
        "num_frames": i.num_frames,
        "width": i.width,
        "height": i.height,
        "bytes": len(entry.data),
    }
