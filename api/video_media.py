"""Video in requests: a ``video_url`` (an uploaded ``vid-...`` id or a data URL) or a
stored video turned into its sampled frames, prepared for their prompt, with the 400s
that name the field at fault. Used by the chat, responses and video routes.

The decoding, hashing and preparing is the front end's
(:meth:`~mmserve.frontend.processor.InputProcessor.sample_frames`); this module maps
requests onto it and its errors onto HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.concurrency import run_in_threadpool

from api.errors import APIError
from api.ids import VIDEO, id_like
from api.media import busy_error, decode_data_url, image_error
from api.schemas import FrameFields
from api.state import ServerState
from mmserve.cancel import check_cancelled
from mmserve.vision.budget import DecodeBusyError, RequestPixels
from mmserve.vision.image import ImageError
from mmserve.vision.inputs import Frame
from mmserve.vision.video import FrameFailure, FrameSelection, VideoError

VIDEO_HINT = (
    "upload the video with POST /v1/videos (multipart field 'file') and pass its id "
    "(vid-...) as the url, or send a data:video/...;base64,... URL"
)


@dataclass(frozen=True)
class VideoPart:
    """A video in a request: its frame selection and where the selection's fields sit.

    Attributes:
        selection: the frame fields the client set.
        fields_at: the path prefix of those fields (``"messages[0].content[1].video_url."``
            or ``"messages[0].content[1]."``), so an error names the field as sent.
    """

    selection: FrameSelection
    fields_at: str

    def param(self, frames: int) -> str:
        """The field to name in an error about taking ``frames`` frames (the one that
        decided their number, :meth:`FrameSelection.count_field`), with its path."""
        return self.fields_at + self.selection.count_field(frames)


def fewer_frames(field: str, most: int) -> str:
    """Advice for taking at most ``most`` frames, worded for the field at fault."""
    if field == "timestamps":
        return f"give at most {most} timestamps"
    if field == "num_frames":
        return f"ask for num_frames={most}"
    return f"set max_frames={most}" if most else "send fewer images with it"


def selection(fields: FrameFields) -> FrameSelection:
    """The frame selection named by request fields."""
    ts = tuple(fields.timestamps) if fields.timestamps is not None else None
    return FrameSelection(
        fields.num_frames, fields.fps, ts, fields.max_frames, fields.max_video_tokens
    )


async def expand_video(
    st: ServerState,
    data: bytes,
    sel: FrameSelection,
    param: str,
    skip: bool = False,
    fields_at: str = "",
    mode: str | None = None,
    pixels: RequestPixels | None = None,
) -> tuple[list[Frame], list[FrameFailure]]:
    """Decode and hash the selected frames of an encoded video and, given ``mode``,
    preprocess them (their decoded images dropped).

    Args:
        param: the request field holding the video (named by errors about the video).
        skip: leave out selected frames that do not decode (and return them) rather
            than refuse the video.
        fields_at: where the frame selection fields sit in the request (``""`` for the
            top level, ``"messages[0].content[1].video_url."`` for a content part).
        mode: the mode the frames take in their prompt (None: keep decoded images).
        pixels: the request's pixel count, charged with every selected frame.

    Returns:
        ``(frames, skipped)``; ``skipped`` is empty unless ``skip``.

    Raises:
        APIError: 400 ``invalid_video`` naming the problem (bad file, a frame that does
            not decode when not ``skip``, or none that decodes); 400
            ``invalid_frame_selection`` naming the selection field the client set
            (``timestamps``, ``fps``, ``num_frames``, ``max_frames``,
            ``max_video_tokens``) for a selection that does not fit the video or crosses a
            limit (the message names it), e.g. a timestamp at or past its end (the
            message gives the duration); 400
            ``request_image_pixels_exceeded`` past the request's pixel budget; 503 when
            the server's decoded-image budget stays full.
        Cancelled: the request's client left (checked before and between frames).
    """

    def work() -> tuple[list[Frame], list[FrameFailure]]:
        processor = st.engine.processor
        video = processor.open_video(data, st.settings.video_limits())
        return processor.sample_frames(video, sel, mode, pixels, skip)  # checks the token

    check_cancelled()  # the client left: no probing, no decoding
    try:
        return await run_in_threadpool(work)
    except ImageError as e:
        raise image_error(e, param) from None
    except DecodeBusyError as e:
        raise busy_error(e) from None
    except VideoError as e:
        if e.field is not None:
            where = fields_at + e.field
            raise APIError(
                400, f"{where}: {e}", param=where, code="invalid_frame_selection"
            ) from None
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_video") from None


async def resolve_video(
    st: ServerState,
    url: str,
    part: VideoPart,
    param: str,
    mode: str | None = None,
    pixels: RequestPixels | None = None,
) -> list[Frame]:
    """The frames of a ``video_url``: an uploaded ``vid-...`` id or a base64 data URL,
    prepared in ``mode`` (see :func:`expand_video`); ``param`` names the url's field.

    Raises:
        APIError: 400 for a malformed or unknown id, another kind of url, or a bad video (a frame
            that does not decode included: a prompt cannot skip it).
    """
    url = url.strip()
    if id_like(url):
        entry = VIDEO.find(url, param, st.videos.get)
        data = entry.data
    else:
        if url.split(":", 1)[0].lower() != "data":
            raise APIError(
                400,
                f"{param}: unsupported video url; {VIDEO_HINT}",
                param=param,
                code="invalid_video",
            )
        data = decode_data_url(url, param)
    sel, at = part.selection, part.fields_at
    return (await expand_video(st, data, sel, param, False, at, mode, pixels))[0]


def frame_parts(frames: list[Frame]) -> list[dict]:
    """Content parts of a clip: ``Frame at 1.5s: <image>`` per frame, in order."""
    parts: list[dict] = []
    for fr in frames:
        parts += [{"type": "text", "text": f"Frame at {fr.timestamp:.1f}s: "}, {"type": "image"}]
    return parts
