"""Decode videos with decord and sample frames; every sampled frame becomes an image.

A frame is an RGB uint8 array turned into a PIL image and hashed like an
uploaded photo (:func:`mmserve.vision.hashing.image_key`), so identical frames
(a static scene, the same footage in two clips) share one key, one vision-tower
run and their KV. Frame selection is a pure function of the video's frame count,
frame rate, duration and the request (:func:`sample_frame_indices`).
"""

from __future__ import annotations

import io
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from mmserve.vision.image import ImageError, ImageLimits, check_size

#: Frames sampled when a request names neither ``num_frames``, ``fps`` nor ``timestamps``.
DEFAULT_NUM_FRAMES = 8
_EPS = 1e-6


class VideoError(ValueError):
    """A video or frame selection that cannot be accepted; the message says why (HTTP 400)."""


@dataclass(frozen=True)
class VideoLimits:
    """Bounds checked on every video.

    Attributes:
        max_bytes: largest encoded upload (bytes).
        max_frames: most frames sampled for one request.
        max_side: largest frame width or height (pixels).
        max_pixels: largest width*height of a frame (pixels).
    """

    max_bytes: int = 64 * 1024 * 1024
    max_frames: int = 64
    max_side: int = 3840
    max_pixels: int = 3840 * 2160


@dataclass(frozen=True)
class FrameSelection:
    """Which frames a request wants: exactly one of the fields (none: 8 uniform frames).

    Attributes:
        num_frames: frames spread uniformly over the video (each the centre of its segment).
        fps: frames per second of video, starting at 0 s.
        timestamps: explicit times (seconds); each picks the frame shown at that time.
    """

    num_frames: int | None = None
    fps: float | None = None
    timestamps: tuple[float, ...] | None = None


@dataclass(frozen=True)
class VideoInfo:
    """What a probe of a video found.

    Attributes:
        num_frames: decodable frames.
        fps: average frame rate (frames per second).
        duration: seconds, to the end of the last frame.
        width, height: frame size (pixels).
        frame_times: start time of each frame (seconds, ascending).
    """

    num_frames: int
    fps: float
    duration: float
    width: int
    height: int
    frame_times: tuple[float, ...]


def sample_frame_indices(
    num_frames: int,
    fps: float,
    duration: float,
    selection: FrameSelection,
    max_frames: int,
    frame_times: Sequence[float] | None = None,
) -> list[int]:
    """Frame indices for ``selection`` (ascending for ``num_frames``/``fps``; as asked for
    ``timestamps``).

    Args:
        num_frames: frames in the video.
        fps: its average frame rate.
        duration: its length (seconds).
        selection: what the request asked for.
        max_frames: most frames allowed.
        frame_times: each frame's start time (variable frame rate); default ``i / fps``.

    Returns:
        Indices into the video. ``num_frames`` beyond the video's frames gives every frame
        once (a 3-frame video asked for 8 gives 3); ``fps`` drops repeats of a frame.

    Raises:
        VideoError: no frames, a bad or over-limit selection, or a timestamp beyond the end.
    """
    if num_frames < 1:
        raise VideoError("video has no frames")
    given = [
        n
        for n, v in (
            ("num_frames", selection.num_frames),
            ("fps", selection.fps),
            ("timestamps", selection.timestamps),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise VideoError(f"give one of num_frames, fps or timestamps, not {' and '.join(given)}")
    times = list(frame_times) if frame_times is not None else [i / fps for i in range(num_frames)]

    def at(t: float) -> int:
        return min(num_frames - 1, max(0, bisect_right(times, t + _EPS) - 1))

    if selection.timestamps is not None:
        ts = list(selection.timestamps)
        if not ts:
            raise VideoError("timestamps is empty")
        _check_count(len(ts), max_frames, "timestamps")
        for t in ts:
            if not math.isfinite(t) or t < 0:
                raise VideoError(f"timestamp {t} is not a time in the video")
            if t >= duration + _EPS and not (num_frames == 1 and t <= _EPS):
                raise VideoError(
                    f"timestamp {t:g} s is beyond the video's duration ({duration:g} s)"
                )
        return [at(t) for t in ts]
    if selection.fps is not None:
        rate = selection.fps
        if not math.isfinite(rate) or rate <= 0:
            raise VideoError(f"fps must be > 0, got {rate}")
        span = duration * rate
        if not math.isfinite(span) or span > max_frames + 1:
            raise VideoError(
                f"fps={rate:g} over {duration:g} s selects more than {max_frames} frames; "
                f"the limit is {max_frames} frames per request"
            )
        count = max(1, math.ceil(span - _EPS))
        _check_count(count, max_frames, f"fps={rate:g} over {duration:g} s")
        out: list[int] = []
        for k in range(count):
            i = at(k / rate)
            if not out or out[-1] != i:
                out.append(i)
        return out
    n = DEFAULT_NUM_FRAMES if selection.num_frames is None else selection.num_frames
    if n < 1:
        raise VideoError(f"num_frames must be >= 1, got {n}")
    _check_count(n, max_frames, "num_frames")
    if n >= num_frames:
        return list(range(num_frames))
    return [min(num_frames - 1, int((k + 0.5) * num_frames / n)) for k in range(n)]


def _check_count(count: int, max_frames: int, what: str) -> None:
    if count > max_frames:
        raise VideoError(
            f"{what} selects {count} frames; the limit is {max_frames} frames per request"
        )


class Video:
    """An opened video (decord ``VideoReader``) with its probed :class:`VideoInfo`.

    Args:
        data: the encoded file (MP4, WebM, MKV, AVI, ...).
        limits: video bounds.
        image_limits: image bounds each frame must also meet.
        shortest_edge: the image processor's resize target (pixels).

    Raises:
        VideoError: empty, over-size, corrupt, truncated or frameless data, or frames over
            the size limits; no decord installed.
    """

    def __init__(
        self,
        data: bytes,
        limits: VideoLimits,
        image_limits: ImageLimits | None = None,
        shortest_edge: int = 336,
    ) -> None:
        if not data:
            raise VideoError("video is empty (0 bytes)")
        if len(data) > limits.max_bytes:
            raise VideoError(f"video is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
        try:
            import decord
        except ImportError:  # pragma: no cover - a dependency
            raise VideoError("video support needs decord (pip install decord)") from None
        try:
            vr = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0), num_threads=1)
            n = len(vr)
        except Exception as e:  # DECORDError (a RuntimeError) for anything it cannot open
            if "cannot find video stream" in str(e):
                raise VideoError("file has no video stream (audio only, or not a video)") from None
            raise VideoError(
                "data is not a decodable video (corrupt, truncated, without video frames, "
                f"or not a video): {_short(e)}"
            ) from None
        if n < 1:
            raise VideoError("video has no frames")
        try:
            first = vr[0].asnumpy()
            pts = vr.get_frame_timestamp(list(range(n)))
            fps = float(vr.get_avg_fps())
        except Exception as e:
            raise VideoError(f"video is truncated or corrupt: {_short(e)}") from None
        h, w = int(first.shape[0]), int(first.shape[1])
        if w > limits.max_side or h > limits.max_side or w * h > limits.max_pixels:
            raise VideoError(
                f"video frames are {w}x{h} pixels; limits are {limits.max_side} per side and "
                f"{limits.max_pixels} pixels per frame"
            )
        if image_limits is not None:
            try:
                check_size(w, h, image_limits, shortest_edge)
            except ImageError as e:
                raise VideoError(f"video frames: {e}") from None
        starts = [round(max(0.0, float(p[0])), 6) for p in pts]
        if not math.isfinite(fps) or fps <= 0:
            fps = 1.0
        if any(b < a for a, b in zip(starts, starts[1:], strict=False)) or not all(
            math.isfinite(s) for s in starts
        ):
            starts = [i / fps for i in range(n)]
        end = float(pts[-1][1]) if math.isfinite(float(pts[-1][1])) else 0.0
        duration = round(max(end, starts[-1] + 1 / fps), 6)
        self.limits = limits
        self.info = VideoInfo(n, round(fps, 6), duration, w, h, tuple(starts))
        self._reader = vr

    def indices(self, selection: FrameSelection) -> list[int]:
        """Frame indices for ``selection`` (see :func:`sample_frame_indices`)."""
        i = self.info
        return sample_frame_indices(
            i.num_frames, i.fps, i.duration, selection, self.limits.max_frames, i.frame_times
        )

    def frames(self, indices: Sequence[int]) -> list[Image.Image]:
        """The frames at ``indices`` as RGB PIL images (each distinct index decoded once).

        Raises:
            VideoError: if decoding fails part-way (a damaged stream).
        """
        distinct = sorted(set(indices))
        try:
            arrays = self._reader.get_batch(distinct).asnumpy()
        except Exception as e:
            raise VideoError(f"video is truncated or corrupt: {_short(e)}") from None
        by_index = {i: Image.fromarray(a, "RGB") for i, a in zip(distinct, arrays, strict=True)}
        return [by_index[i] for i in indices]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
