"""From engine messages and their media references to engine requests: each image or
video resolved (upload ids, data URLs, allowed files, remote URLs), videos expanded into
their frames where the model has no video path, ``n`` requests built by the front end.
Shared by the chat and Responses handlers."""

from __future__ import annotations

from typing import NamedTuple

from api.errors import APIError
from api.generation import make_requests
from api.media import check_image_count
from api.state import ServerState
from api.video_media import VideoPart, fewer_frames, frame_parts, resolve_video
from mmserve.cancel import check_cancelled
from mmserve.frontend.prompt import NEW_TURN, ChatTemplateOptions
from mmserve.model.families.base import FRAME_MODE
from mmserve.types import EngineRequest, SamplingParams
from mmserve.vision.inputs import ImageInput


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
    cache_salt: str = "",
) -> list[EngineRequest]:
    """Resolve the media of ``messages`` (``urls`` as
    :func:`api.endpoints.chat.split_media` gives them: upload ids, data URLs, allowed
    files or remote URLs; videos become their sampled frames; each image in the view its
    ``detail`` asks for) and build ``n`` engine requests, the prompt ending as
    ``template`` says.

    Raises:
        APIError: 400 naming the part at fault (unknown id, undecodable image, too many
            images, prompt too long, ...).
        Cancelled: the request's client left (checked between media and inside each
            one's preparation, :mod:`mmserve.cancel`).
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
        check_cancelled()  # the client left: no more fetching or decoding
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
        cache_salt,
    )


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
