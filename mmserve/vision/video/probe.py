"""Open a video with PyAV and index its video stream by demuxing only (nothing decoded):
every frame's time, the key frames, the duration and the frame rate (:class:`VideoInfo`).

Timing follows what a player shows. A frame's time is its presentation timestamp
(pts) relative to the container's start; the frame shown at time ``t`` is the last one
whose time is ``<= t``. The duration is the container's, unless that ends before the
last frame starts (then the last frame's end from the stream's own timing).

FFmpeg errors are passed through :func:`~mmserve.vision.image.clean_decoder_message`
(:func:`_reason`) before a client sees them.
"""

from __future__ import annotations

import io
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from statistics import median
from typing import TYPE_CHECKING

from mmserve.vision.image import clean_decoder_message
from mmserve.vision.video.select import _EPS, VideoError, VideoLimits

if TYPE_CHECKING:
    from av.container import InputContainer

#: Length (seconds) given to a last frame that has no duration of its own and no
#: neighbours or frame rate to take one from.
_FALLBACK_FRAME_SECONDS = 0.04


@dataclass(frozen=True)
class VideoInfo:
    """What a probe of a video found.

    Attributes:
        num_frames: frames in the video stream.
        fps: average frame rate (frames per second): ``num_frames`` over the span from
            the first frame's start to the last frame's end.
        duration: seconds from the container's start to the end (see module docs).
        width, height: frame size as displayed, after rotation (pixels).
        frame_times: presentation time of each frame (seconds from the container's
            start, ascending).
    """

    num_frames: int
    fps: float
    duration: float
    width: int
    height: int
    frame_times: tuple[float, ...]


class _Index:
    """The video stream's packets, found by demuxing only (nothing decoded).

    Frame ``i`` is the ``i``-th in presentation order; ``pos[i]`` is the position of its
    packet in decode (file) order and ``index_at`` the inverse. ``timed``: every packet
    has its own pts, so decoded frames are matched to indices by pts and seeking works;
    otherwise (a raw elementary stream, repeated pts) they are matched by output order
    in one pass from the start.
    """

    def __init__(self, pts: Sequence[int | None], keys: Sequence[bool]) -> None:
        n = len(pts)
        known = [p for p in pts if p is not None]
        self.timed = len(known) == n and len(set(known)) == n
        order = sorted(range(n), key=lambda i: known[i]) if self.timed else list(range(n))
        self.pts: tuple[int | None, ...] = tuple(pts)
        self.pos: tuple[int, ...] = tuple(order)
        at = [0] * n
        for i, p in enumerate(order):
            at[p] = i
        self.index_at: tuple[int, ...] = tuple(at)
        self.by_pts: dict[int | None, int] = (
            {pts[p]: i for i, p in enumerate(order)} if self.timed else {}
        )
        # a stream that does not start with a key frame still starts a group at 0
        self.keys: tuple[int, ...] = (0, *(p for p in range(1, n) if keys[p]))

    def gop(self, p: int) -> int:
        """Decode position of the key frame that starts the group holding position ``p``."""
        return self.keys[bisect_right(self.keys, p) - 1]

    def start_for(self, i: int) -> int:
        """Decode position of a key frame from which decoding reaches frame ``i``: the last
        key frame before its packet that is also shown no later than it. In an open group
        of pictures (MPEG-4 Part 2, H.264 with open GOPs) the frames shown before their
        group's key frame predict from the previous group; FFmpeg drops them after a seek
        to their own key frame."""
        p = self.pos[i]
        k = bisect_right(self.keys, p) - 1
        if self.timed:
            while k > 0 and self.pts[self.keys[k]] > self.pts[p]:  # type: ignore[operator]
                k -= 1
        return self.keys[k]


def _open(data: bytes) -> InputContainer:
    import av

    return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")


_NO_DECODER = (
    "the video stream's codec cannot be decoded (an unknown or unsupported codec, or a "
    "corrupt file)"
)


def _video_stream(container: object):
    """The video stream FFmpeg's command line picks by default (``av_find_best_stream``:
    not a cover picture, the largest and most decoded), not simply the first: a phone's
    thumbnail track or a cover image may come before the video."""
    streams = container.streams  # type: ignore[attr-defined]
    return streams.best("video") or streams.video[0]


def _reason(e: BaseException) -> str:
    """An FFmpeg error's text without its errno and function name, cleaned for clients."""
    import av

    args: tuple[object, ...] = getattr(e, "args", ())
    if isinstance(e, av.FFmpegError) and len(args) >= 2 and isinstance(args[1], str):
        return clean_decoder_message(args[1])
    return clean_decoder_message(e)


def _rate(stream: object) -> float:
    """The stream's nominal frame rate (frames per second), or 0 if it gives none."""
    for name in ("average_rate", "guessed_rate", "base_rate"):
        r = getattr(stream, name, None)
        if r and math.isfinite(float(r)) and float(r) > 0:
            return float(r)
    return 0.0


def _probe(
    container: object, limits: VideoLimits
) -> tuple[_Index, tuple[float, ...], float, float]:
    """Demux the first video stream: ``(index, frame times, duration, fps)``.

    Raises:
        VideoError: no frames, or more than ``limits.max_video_frames``.
    """
    stream = _video_stream(container)
    pts: list[int | None] = []
    keys: list[bool] = []
    durations: list[int] = []
    positions: list[int | None] = []
    try:
        for packet in container.demux(stream):  # type: ignore[attr-defined]
            # size 0: the end-of-stream marker; discard: before an edit list's start
            if packet.size == 0 or packet.is_discard:
                continue
            if len(pts) >= limits.max_video_frames:
                raise VideoError(
                    f"video has more than {limits.max_video_frames} frames; the limit is "
                    f"{limits.max_video_frames} frames per video"
                )
            pts.append(packet.pts)
            keys.append(bool(packet.is_keyframe))
            durations.append(packet.duration or 0)
            positions.append(packet.pos)
    except VideoError:
        raise
    except Exception:  # noqa: BLE001 - damaged or cut container data: the frames before it
        pass
    n = len(pts)
    try:  # the container's own key frame table (MP4 stss), which damage cannot change
        marked = {e.pos for e in stream.index_entries if e.is_keyframe and e.pos >= 0}
    except Exception:  # noqa: BLE001 - no index: the packets' flags only
        marked = set()
    keys = [k or (q is not None and q in marked) for k, q in zip(keys, positions, strict=True)]
    if n == 0:
        raise VideoError(
            "video stream has no frames (not a decodable video: corrupt, truncated, or "
            "without video frames)"
        )
    index = _Index(pts, keys)
    rate = _rate(stream)
    start_us = container.start_time  # type: ignore[attr-defined]
    tb = stream.time_base
    if index.timed and tb:
        starts = [float(Fraction(pts[p]) * tb) for p in index.pos]  # type: ignore[arg-type]
        origin = start_us / 1e6 if start_us is not None else starts[0]
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False) if b > a]
        last = durations[index.pos[-1]]
        if last > 0:
            last_seconds = float(last * tb)
        elif gaps:
            last_seconds = median(gaps)
        else:
            last_seconds = 1 / rate if rate else _FALLBACK_FRAME_SECONDS
        times = [round(max(0.0, s - origin), 6) for s in starts]
        video_end = max(starts[-1] + last_seconds - origin, times[-1])
    else:
        per = 1 / rate if rate else _FALLBACK_FRAME_SECONDS
        origin = start_us / 1e6 if start_us is not None else 0.0
        times = [round(i * per, 6) for i in range(n)]
        video_end = n * per
    duration = video_end
    total_us = container.duration  # type: ignore[attr-defined]
    if total_us is not None and total_us > 0:
        # the container's end, on the frames' clock; kept unless it cuts off a frame start
        container_end = (total_us + (start_us or 0)) / 1e6 - origin
        if container_end > times[-1] + _EPS:
            duration = container_end
    span = video_end - times[0]
    fps = n / span if span > 0 else rate
    return index, tuple(times), round(duration, 6), round(fps, 6)
