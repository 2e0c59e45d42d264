"""Frames into a live stream: read from a ``/v1/streams/{id}/frames`` body (multipart
``file`` fields with optional ``timestamp`` fields, JSON ``{"frames": [...]}``, or
``{"video_id": ...}`` to replay an uploaded video) or a WebSocket message, checked,
decoded, hashed and prepared, then handed to the stream all at once: a bad frame
refuses the whole post (a 4xx naming its field) and leaves the stream as it was.
"""

from __future__ import annotations

import base64
import binascii
import math
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.errors import APIError, describe_validation_errors
from api.ids import VIDEO
from api.json_body import json_media_type, read_json_object
from api.media import busy_error, image_error
from api.schemas import STRICT, FrameFields
from api.state import ServerState
from api.streams import MAX_TIMESTAMP_S, Stream
from api.video_media import VideoPart, expand_video, selection
from mmserve.vision.budget import DecodeBusyError
from mmserve.vision.image import ImageError
from mmserve.vision.inputs import ImageInput

FRAMES_HINT = (
    "send multipart/form-data with one or more 'file' fields (and optionally one "
    "'timestamp' field per file, in seconds, increasing), or JSON "
    '{"frames": [{"data": "<base64 image>", "timestamp": 1.5}]}, or JSON '
    '{"video_id": "vid-...", "num_frames": 8} to replay an uploaded video'
)


@dataclass
class Incoming:
    """One frame of a post, before it joins the stream.

    Attributes:
        data: its encoded bytes (None for a replayed video frame, already prepared).
        timestamp: its time in seconds, or None (the stream gives one).
        param: the field that holds it (named by errors about the image).
        ts_param: the field of its timestamp.
        image: the prepared frame (set by :func:`prepare`, or by the replay).
    """

    data: bytes | None
    timestamp: float | None
    param: str
    ts_param: str
    image: ImageInput | None = None


class JSONFrame(BaseModel):
    """One frame of a JSON post."""

    model_config = STRICT
    data: str = Field(description="the encoded image, base64")
    timestamp: float | int | None = Field(default=None, description="seconds, increasing")


class JSONFrames(BaseModel):
    """A JSON ``/frames`` body: ``frames``, or ``video_id`` and its frame selection."""

    model_config = STRICT
    frames: list[JSONFrame] | None = None
    video_id: str | None = None
    num_frames: int | None = Field(default=None, ge=1)
    fps: float | None = Field(default=None, gt=0)
    timestamps: list[float] | None = None
    max_frames: int | None = Field(default=None, ge=1)
    time_offset: float = Field(
        default=0.0, description="seconds added to a replayed video's frame times"
    )


async def read_frames(request: Request, st: ServerState, stream: Stream) -> list[Incoming]:
    """The frames of a ``/frames`` request, prepared (see the module docstring).

    Raises:
        APIError: 400 naming the field (a malformed body, an unknown field, a frame that
            is not an image or is over the image limits, a timestamp that does not
            increase, more frames than ``--max-stream-frames-per-post``); 415 for
            another content type; 503 when the decoded-image budget stays full.
    """
    ctype = request.headers.get("content-type", "").lower()
    if ctype.startswith("multipart/form-data"):
        frames = await _multipart(request, st)
    elif json_media_type(ctype) or ctype.startswith("application/json"):
        _, body = await read_json_object(request)
        frames = await json_frames(body, st, stream)
    else:
        raise APIError(415, FRAMES_HINT, code="unsupported_media_type")
    return await prepare(st, stream, frames)


async def _multipart(request: Request, st: ServerState) -> list[Incoming]:
    most = st.settings.max_stream_frames_per_post
    limit = st.engine.config.image_limits.max_bytes
    try:
        form = await request.form(max_files=most + 1, max_fields=most + 1)
    except (ValueError, StarletteHTTPException) as e:
        detail = getattr(e, "detail", e)
        raise APIError(
            400, f"malformed multipart body: {detail}; {FRAMES_HINT}", param="file"
        ) from None
    try:
        other = next((k for k in form.keys() if k not in ("file", "timestamp")), None)
        if other is not None:
            raise APIError(
                400,
                f"{other}: unknown field; the server does not act on it, so it is refused "
                f"rather than ignored: {FRAMES_HINT}",
                param=other,
            )
        files = form.getlist("file")
        stamps = form.getlist("timestamp")
        if not files or not all(isinstance(f, UploadFile) for f in files):
            raise APIError(400, f"file: no frame; {FRAMES_HINT}", param="file")
        _check_count(len(files), most, "file")
        if stamps and len(stamps) != len(files):
            raise APIError(
                400,
                f"timestamp: {len(stamps)} timestamps for {len(files)} files; give one per "
                "file, in the same order, or none",
                param="timestamp",
            )
        out = []
        for i, f in enumerate(files):
            assert isinstance(f, UploadFile)
            data = await f.read(limit + 1)
            where = _nth("file", i, len(files))
            if len(data) > limit:
                raise APIError(
                    400,
                    f"{where}: larger than {limit} bytes (--max-image-bytes)",
                    param="file",
                    code="file_too_large",
                )
            ts = _number(stamps[i], "timestamp") if stamps else None
            out.append(Incoming(data, ts, "file", "timestamp"))
        return out
    finally:
        await form.close()


async def json_frames(body: dict, st: ServerState, stream: Stream) -> list[Incoming]:
    """The frames of a JSON body (``frames``, or a replay of ``video_id``), not yet
    prepared (a replay's are).

    Raises:
        APIError: as :func:`read_frames`.
    """
    try:
        got = JSONFrames.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors())
        raise APIError(400, message, param=param) from None
    most = st.settings.max_stream_frames_per_post
    if (got.frames is None) == (got.video_id is None):
        raise APIError(400, f"frames: give frames or video_id; {FRAMES_HINT}", param="frames")
    replay = ("num_frames", "fps", "timestamps", "max_frames", "time_offset")
    if got.frames is not None:
        extra = [k for k in replay if k in body]
        if extra:
            raise APIError(400, f"{extra[0]}: only with video_id", param=extra[0])
        if not got.frames:
            raise APIError(400, "frames: empty; send at least one frame", param="frames")
        _check_count(len(got.frames), most, "frames")
        out = []
        for i, fr in enumerate(got.frames):
            where = f"frames[{i}].data"
            try:
                data = base64.b64decode(fr.data, validate=True)
            except (ValueError, binascii.Error):
                raise APIError(400, f"{where}: not valid base64", param=where) from None
            limit = st.engine.config.image_limits.max_bytes
            if len(data) > limit:
                raise APIError(
                    400,
                    f"{where}: larger than {limit} bytes (--max-image-bytes)",
                    param=where,
                    code="file_too_large",
                )
            ts = None if fr.timestamp is None else float(fr.timestamp)
            out.append(Incoming(data, ts, where, f"frames[{i}].timestamp"))
        return out
    assert got.video_id is not None
    return await _replay(got, st, stream)


async def _replay(got: JSONFrames, st: ServerState, stream: Stream) -> list[Incoming]:
    """An uploaded video's selected frames, prepared in the stream's mode, at their own
    times plus ``time_offset``."""
    entry = VIDEO.find(got.video_id or "", "video_id", st.videos.get)
    fields = FrameFields(
        num_frames=got.num_frames, fps=got.fps, timestamps=got.timestamps, max_frames=got.max_frames
    )
    part = VideoPart(selection(fields), "")
    processor = st.engine.processor
    frames, _ = await expand_video(
        st,
        entry.data,
        part.selection,
        "video_id",
        True,
        "",
        stream.mode,
        processor.request_pixels(),
    )
    most = st.settings.max_stream_frames_per_post
    if len(frames) > most:
        field = part.param(len(frames))
        raise APIError(
            400,
            f"{field}: the selection has {len(frames)} frames; one post takes at most {most} "
            "(--max-stream-frames-per-post): select fewer (num_frames, max_frames) or replay "
            "the video in several posts (timestamps)",
            param=field,
        )
    # a time out of order comes from the client's timestamps when it chose them
    when = "timestamps" if got.timestamps else "time_offset"
    return [
        Incoming(None, fr.timestamp + got.time_offset, "video_id", when, fr.image) for fr in frames
    ]


def check_timestamps(stream: Stream, frames: list[Incoming]) -> None:
    """Refuse timestamps that are not finite, negative, over :data:`MAX_TIMESTAMP_S`, or not
    after the previous frame's (the post's or the stream's newest). A frame without one
    counts as timestamped now (:meth:`Stream.default_timestamp`), so a later frame's must
    come after that.

    Raises:
        APIError: 400 ``invalid_timestamp`` naming the timestamp's field.
    """
    last = stream.last_timestamp
    for i, fr in enumerate(frames):
        t = fr.timestamp
        if t is None:  # it will take the seconds since the stream began: later ones follow it
            now = time.monotonic() - stream.started
            last = now if last is None or now > last else last + 1e-3
            continue
        where = _nth(fr.ts_param, i, len(frames)) if fr.ts_param == "timestamp" else fr.ts_param
        if not math.isfinite(t) or not 0 <= t <= MAX_TIMESTAMP_S:
            raise APIError(
                400, f"{where}: {t!r} is not a time in seconds from 0 to {MAX_TIMESTAMP_S:g}",
                param=fr.ts_param, code="invalid_timestamp",
            )  # fmt: skip
        if last is not None and t <= last:
            raise APIError(
                400,
                f"{where}: {t:g} s is not after the previous frame's {last:g} s; a stream's "
                "timestamps must increase",
                param=fr.ts_param,
                code="invalid_timestamp",
            )
        last = t


async def prepare(st: ServerState, stream: Stream, frames: list[Incoming]) -> list[Incoming]:
    """Check the timestamps, then decode, hash and prepare each encoded frame in the
    stream's mode (one at a time: one decoded image held at once).

    Raises:
        APIError: 400 naming the field of the first bad frame or timestamp; 503 when the
            decoded-image budget stays full.
    """
    check_timestamps(stream, frames)
    processor = st.engine.processor
    for i, fr in enumerate(frames):
        if fr.image is not None:
            continue
        assert fr.data is not None
        where = _nth(fr.param, i, len(frames)) if fr.param == "file" else fr.param

        def work(data: bytes = fr.data) -> ImageInput:
            item = processor.prepare_image(data)  # decoded, hashed
            item.video = True
            return processor.prepare_frames([item], stream.mode)[0]

        try:
            fr.image = await run_in_threadpool(work)
        except ImageError as e:
            err = image_error(e, fr.param)
            err.message = f"{where}: {e}"
            raise err from None
        except DecodeBusyError as e:
            raise busy_error(e) from None
    return frames


def _check_count(n: int, most: int, param: str) -> None:
    if n > most:
        raise APIError(
            400,
            f"{param}: {n} frames in one post; the limit is {most} "
            "(--max-stream-frames-per-post): send them in several posts",
            param=param,
        )


def _nth(param: str, i: int, n: int) -> str:
    """``param`` with the frame's place when a post has several: ``file (frame 2 of 3)``."""
    return f"{param} (frame {i + 1} of {n})" if n > 1 else param


def _number(value: object, param: str) -> float:
    """A multipart number field.

    Raises:
        APIError: 400 naming ``param`` when it is not a number.
    """
    try:
        return float(value) if isinstance(value, str) else float("nan")
    except ValueError:
        raise APIError(
            400, f"{param}: {str(value)[:40]!r} is not a number of seconds", param=param,
            code="invalid_timestamp",
        ) from None  # fmt: skip
