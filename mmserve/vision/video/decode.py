"""Decode videos with PyAV (FFmpeg) and sample frames; every sampled frame becomes an image.

A frame is an RGB uint8 array turned into a PIL image and hashed like an
uploaded photo (:func:`mmserve.vision.hashing.image_key`), so identical frames
(a static scene, the same footage in two clips) share one key, one vision-tower
run and their KV. Frame selection is a pure function of the video's frame times,
duration, the request and its caps (:func:`sample_frame_indices`).

One decoder reads every video: PyAV, FFmpeg's own API. decord (used before) refused
frames narrower than about 32 pixels and some odd widths (8, 12, 16, 24, 48, 72: "The
size must exactly match"), and its decoder thread read ahead into damaged packets and
dropped good frames before them now and then. Where decord decoded a frame, PyAV's
``rgb24`` conversion gives the same bytes (both use libswscale's defaults; checked in
``tests/test_video_decoders.py``).

Timing follows what a player shows. A frame's time is its presentation timestamp
(pts) relative to the container's start; the frame shown at time ``t`` is the last one
whose time is ``<= t``. The duration is the container's, unless that ends before the
last frame starts (then the last frame's end from the stream's own timing). The
display matrix (rotation and mirroring, also what FFmpeg makes of a JPEG or PNG frame's
EXIF orientation) is applied as FFmpeg's command line does (:func:`orient`); a frame
without one is shown as the first decoded frame was.

A damaged stream is decoded packet by packet (:meth:`Video.decode`): frames that
decode are returned and the others are listed with their times, so a caller can
answer from what is left or refuse naming them. Every decoder error is passed
through :func:`~mmserve.vision.image.clean_decoder_message`.
"""

from __future__ import annotations

import io
import logging
import math
import struct
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from statistics import median

import numpy as np
from PIL import Image

from mmserve.vision.image import (
    ImageError,
    ImageLimits,
    check_size,
    clean_decoder_message,
    to_8bit,
)

log = logging.getLogger(__name__)

#: Frames sampled when a request names neither ``num_frames``, ``fps`` nor ``timestamps``.
DEFAULT_NUM_FRAMES = 8
_EPS = 1e-6
#: Key frames after frame 0 tried for the probe when frame 0 does not decode.
_PROBE_KEYFRAMES = 3
#: Packets sent after a frame's own packet before a frame the decoder never returned
#: counts as lost (FFmpeg's H.264 decoder holds at most 16 frames for reordering).
_REORDER_SLACK = 32
#: Length (seconds) given to a last frame that has no duration of its own and no
#: neighbours or frame rate to take one from.
_FALLBACK_FRAME_SECONDS = 0.04


class VideoError(ValueError):
    """A video or frame selection that cannot be accepted; the message says why (HTTP 400).

    Attributes:
        field: the request field at fault, one the client set (``"timestamps"``,
            ``"fps"``, ``"num_frames"``, ``"max_frames"``, ``"max_video_tokens"``; or
            ``"num_frames"`` for the default count), or None when the video itself is at
            fault.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class VideoLimits:
    """Bounds checked on every video.

    Attributes:
        max_bytes: largest encoded upload (bytes).
        max_frames: most frames sampled for one request (``fps`` and the default are
            thinned to it, an exact count over it is refused: :func:`sample_frame_indices`).
        max_side: largest frame width or height (pixels).
        max_pixels: largest width*height of a frame (pixels).
        max_video_frames: most frames a video may hold (the probe reads every packet
            header, so this bounds its work: 100000 is 55 minutes at 30 fps).
        max_tokens: most pseudo-tokens the sampled frames of one video may take in a
            prompt (the server's ``--max-video-tokens``; None: no token budget). A budget:
            ``fps`` and the default sampling are thinned to fit it.
    """

    max_bytes: int = 64 * 1024 * 1024
    max_frames: int = 64
    max_side: int = 3840
    max_pixels: int = 3840 * 2160
    max_video_frames: int = 100_000
    max_tokens: int | None = None


#: The selection fields that say which frames are taken; at most one per request.
SELECTORS = ("num_frames", "fps", "timestamps")


@dataclass(frozen=True)
class FrameSelection:
    """Which frames a request wants: at most one of ``num_frames``, ``fps``,
    ``timestamps`` (none: :data:`DEFAULT_NUM_FRAMES` uniform frames), and the caps.

    A field is set when it is not None (the API maps the client's fields one to one), so
    errors can name the field the client set (:meth:`count_field`).

    Attributes:
        num_frames: frames spread uniformly over the frame list (each the centre of its
            segment; by index, so a variable frame rate does not bunch them). Exact: never
            lowered to fit a cap.
        fps: frames per second of video: the frames shown at ``0, 1/fps, 2/fps, ...``
            seconds, before the end, each once. Thinned to fit a cap.
        timestamps: explicit times (seconds, ``0 <= t < duration``); each picks the frame
            shown at that time. Exact.
        max_frames: the most frames to take (a cap: ``fps`` and the default are thinned
            to it; ``num_frames`` or ``timestamps`` over it is a contradiction).
        max_video_tokens: the most pseudo-tokens this video's frames may take (a cap like
            ``max_frames``, in tokens; the server's ``--max-video-tokens`` bounds it too).
    """

    num_frames: int | None = None
    fps: float | None = None
    timestamps: tuple[float, ...] | None = None
    max_frames: int | None = None
    max_video_tokens: int | None = None

    def selector(self) -> str | None:
        """The selection field set (``num_frames``, ``fps``, ``timestamps``), or None."""
        return next((n for n in SELECTORS if getattr(self, n) is not None), None)

    def count_field(self, chosen: int) -> str:
        """The request field that decided how many frames were taken (``chosen``), for an
        error about their number: ``timestamps`` or ``num_frames`` when set; else
        ``max_frames`` when set and ``chosen`` reached it (or nothing else was set); else
        ``fps`` when set; else ``num_frames`` (the default count, which the client may set).
        """
        sel = self.selector()
        if sel in ("timestamps", "num_frames"):
            return sel
        if self.max_frames is not None and (sel is None or chosen >= self.max_frames):
            return "max_frames"
        return sel or "num_frames"


@dataclass(frozen=True)
class FrameCost:
    """Pseudo-tokens the sampled frames of one video take in its prompt.

    Attributes:
        per_frame: tokens per frame (LLaVA-OneVision's video path: 196; a family without
            a video path: the frame's count as an image of its prompt).
        per_video: tokens once per video (OneVision: the video newline; else 0).
    """

    per_frame: int
    per_video: int = 0

    def tokens(self, frames: int) -> int:
        """Tokens ``frames`` frames take (0 for none)."""
        return frames * self.per_frame + self.per_video if frames else 0

    def fit(self, budget: int) -> int:
        """The most frames whose tokens are ``<= budget``."""
        return max(0, (budget - self.per_video) // self.per_frame)


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


def sample_frame_indices(
    num_frames: int,
    fps: float,
    duration: float,
    selection: FrameSelection,
    max_frames: int,
    frame_times: Sequence[float] | None = None,
    cost: FrameCost | None = None,
    max_tokens: int | None = None,
) -> list[int]:
    """Frame indices for ``selection`` (ascending for ``num_frames``/``fps``/the default; as
    asked for ``timestamps``).

    The frame for a time ``t`` is the one a player shows then: the last frame whose
    time is ``<= t`` (the first frame for a ``t`` before it).

    How the fields combine (one rule): at most one of ``num_frames``, ``fps``,
    ``timestamps`` picks the frames (none: :data:`DEFAULT_NUM_FRAMES` uniform). The cap is
    the smallest of the server's ``max_frames``, the request's ``max_frames`` and the
    frames that fit the token budget (the smaller of the request's ``max_video_tokens``
    and ``max_tokens``, priced by ``cost``). ``fps`` and the default are lowered to the
    cap: ``fps`` whose frames would exceed it takes the cap's count of frames spread
    evenly over the clip, as ``num_frames`` would. ``num_frames`` and ``timestamps`` are
    exact: over a cap they are refused, as is a request's ``max_frames`` or
    ``max_video_tokens`` over the server's.

    Args:
        num_frames: frames in the video.
        fps: its average frame rate (used only without ``frame_times``).
        duration: its length (seconds).
        selection: what the request asked for.
        max_frames: most frames allowed (the server's ``--max-video-frames``).
        frame_times: each frame's presentation time (seconds); default ``i / fps``.
        cost: tokens per frame and per video in the prompt (None: no token budget).
        max_tokens: the server's token budget per video (None: none).

    Returns:
        Indices into the video. ``num_frames`` beyond the video's frames gives every frame
        once (a 3-frame video asked for 8 gives 3); ``fps`` drops repeats of a frame.
        With ``cost``, ``cost.tokens(len(result))`` is within the budget.

    Raises:
        VideoError: no frames; a bad, contradictory or over-limit selection, whose
            ``field`` is the field the client set (:meth:`FrameSelection.count_field`) and
            whose message names the limit crossed; a timestamp that is negative, not a
            number, or at or past the end (the message gives the duration).
    """
    if num_frames < 1:
        raise VideoError("video has no frames")
    sel = selection
    given = [n for n in SELECTORS if getattr(sel, n) is not None]
    if len(given) > 1:
        raise VideoError(
            f"give one of num_frames, fps or timestamps, not {' and '.join(given)}", given[-1]
        )
    if sel.max_frames is not None:
        if sel.max_frames < 1:
            raise VideoError(f"max_frames must be >= 1, got {sel.max_frames}", "max_frames")
        if sel.max_frames > max_frames:
            raise VideoError(
                f"max_frames={sel.max_frames} is over the limit of {max_frames} frames per "
                "request (the server's --max-video-frames)",
                "max_frames",
            )
    asked = sel.max_video_tokens
    if asked is not None and asked < 1:
        raise VideoError(f"max_video_tokens must be >= 1, got {asked}", "max_video_tokens")
    if asked is not None and max_tokens is not None and asked > max_tokens:
        raise VideoError(
            f"max_video_tokens={asked} is over the limit of {max_tokens} video tokens (the "
            "server's --max-video-tokens)",
            "max_video_tokens",
        )
    budget = _token_budget(asked, max_tokens)
    fit: int | None = None
    if budget is not None and cost is not None:
        tokens, named, field = budget
        fit = cost.fit(tokens)
        if fit < 1:
            raise VideoError(
                f"one frame of this video takes {cost.tokens(1)} tokens; {named} leaves "
                "room for none",
                field or sel.count_field(1),
            )
    caps = [c for c in (sel.max_frames, fit) if c is not None]

    def exact(asked: int, taken: int, what: str, field: str) -> None:
        """Refuse an exact count over a limit: ``asked`` frames named, ``taken`` taken."""
        if asked > max_frames:
            raise VideoError(
                f"{what} selects {asked} frames; the limit is {max_frames} frames per "
                "request (the server's --max-video-frames)",
                field,
            )
        if sel.max_frames is not None and asked > sel.max_frames:
            raise VideoError(
                f"{what} selects {asked} frames, more than max_frames={sel.max_frames}; "
                "give one or the other",
                field,
            )
        if fit is not None and cost is not None and budget is not None and taken > fit:
            raise VideoError(
                f"{what} selects {taken} frames, {cost.tokens(taken)} video tokens at "
                f"{cost.per_frame} per frame; {budget[1]} fits {fit} frame{'s' * (fit != 1)}",
                field,
            )

    def uniform(n: int) -> list[int]:
        if n >= num_frames:
            return list(range(num_frames))
        return [min(num_frames - 1, int((k + 0.5) * num_frames / n)) for k in range(n)]

    times = list(frame_times) if frame_times is not None else [i / fps for i in range(num_frames)]

    def at(t: float) -> int:
        return min(num_frames - 1, max(0, bisect_right(times, t + _EPS) - 1))

    if sel.timestamps is not None:
        ts = list(sel.timestamps)
        if not ts:
            raise VideoError("timestamps is empty", "timestamps")
        exact(len(ts), len(ts), f"timestamps ({len(ts)} times)", "timestamps")
        span = f"from 0 up to but not including {duration:g} s, the video's duration"
        for t in ts:
            if not math.isfinite(t) or t < 0:
                raise VideoError(
                    f"timestamp {t} is not a time in the video (give times {span})", "timestamps"
                )
            # t = 0 stays valid for a video whose duration is unknown (0)
            if t > duration - _EPS and t > _EPS:
                raise VideoError(
                    f"timestamp {t:g} s is at or beyond the video's duration ({duration:g} s); "
                    f"give times {span}",
                    "timestamps",
                )
        return [at(t) for t in ts]
    if sel.fps is not None:
        rate = sel.fps
        if not math.isfinite(rate) or rate <= 0:
            raise VideoError(f"fps must be > 0, got {rate}", "fps")
        span = duration * rate
        # sample times k / rate before the end: 0 <= k / rate < duration
        count = max(1, math.ceil(span - _EPS)) if math.isfinite(span) else math.inf
        cap = min([max_frames, *caps])
        if count > cap:  # thinned: the cap's count of frames, evenly over the clip
            return uniform(cap)
        out = []
        for k in range(int(count)):
            i = at(k / rate)
            if not out or out[-1] != i:
                out.append(i)
        return out
    if sel.num_frames is None:  # the default, lowered to every limit
        return uniform(min(DEFAULT_NUM_FRAMES, max_frames, *caps))
    n = sel.num_frames
    if n < 1:
        raise VideoError(f"num_frames must be >= 1, got {n}", "num_frames")
    exact(n, min(n, num_frames), f"num_frames={n}", "num_frames")
    return uniform(n)


def _token_budget(asked: int | None, server: int | None) -> tuple[int, str, str | None] | None:
    """The video token budget: ``(tokens, its name in messages, the request field or
    None)``: the request's ``max_video_tokens`` (no more than the server's), else the
    server's, else None."""
    if asked is not None:
        return asked, f"max_video_tokens={asked}", "max_video_tokens"
    if server is not None:
        return server, f"the server's limit of {server} video tokens (--max-video-tokens)", None
    return None


@dataclass(frozen=True)
class FrameFailure:
    """A frame that did not decode.

    Attributes:
        index: its index in the video.
        timestamp: its presentation time (seconds).
        reason: the decoder's short reason (no paths, see ``clean_decoder_message``).
    """

    index: int
    timestamp: float
    reason: str


@dataclass(frozen=True)
class DecodedFrames:
    """What :meth:`Video.decode` got.

    Attributes:
        images: RGB image by frame index, for every asked index that decoded.
        failed: the asked indices that did not decode, ascending, each once.
    """

    images: dict[int, Image.Image]
    failed: tuple[FrameFailure, ...]


def undecodable_message(failed: Sequence[FrameFailure], asked: int) -> str:
    """Which frames could not be decoded, for an error message.

    Args:
        failed: the frames that failed (at least one).
        asked: how many distinct frames were asked for.

    Returns:
        E.g. ``"2 of the 8 selected frames could not be decoded (damaged or corrupt
        stream): frame 8 at 0.8 s, frame 12 at 1.2 s; decoder: Invalid data found when
        processing input."``
    """
    listed = ", ".join(f"frame {f.index} at {f.timestamp:g} s" for f in failed)
    return (
        f"{len(failed)} of the {asked} selected frames could not be decoded (damaged or "
        f"corrupt stream): {listed}; decoder: {failed[0].reason}"
    )


def orient(frame: np.ndarray, matrix: Sequence[int] | None) -> np.ndarray:
    """A decoded frame as displayed: the display matrix's rotation and mirroring applied.

    FFmpeg's display matrix (``AV_FRAME_DATA_DISPLAYMATRIX``, libavutil/display.h) maps
    a stored pixel ``(x, y)`` (y down) to ``(a*x + c*y, b*x + d*y)`` up to a shift, with
    ``a, b, c, d = m[0], m[1], m[3], m[4]`` in 16.16 fixed point. Quarter turns and
    mirrors are applied exactly, as the ``ffmpeg`` command line's autorotation does
    (``transpose``, ``hflip``, ``vflip``); other angles are rounded to the nearest quarter
    turn (the command line rotates by the exact angle and fills the corners).

    Args:
        frame: ``(H, W, C)`` array as stored.
        matrix: the 9 int32 entries, or None for none.

    Returns:
        ``(H', W', C)`` C-contiguous array; ``H', W' = W, H`` for a quarter turn.
    """
    if matrix is None:
        return frame
    a, b, _, c, d = matrix[:5]
    if a == b == c == d == 0:  # a degenerate matrix: display as stored
        return frame
    out = frame
    if abs(a) >= abs(b):  # x' = a*x, y' = d*y
        if a < 0:
            out = out[:, ::-1]
        if d < 0:
            out = out[::-1]
    else:  # x' = c*y, y' = b*x: rows become columns
        out = out.transpose(1, 0, 2)
        if c < 0:
            out = out[:, ::-1]
        if b < 0:
            out = out[::-1]
    return np.ascontiguousarray(out)


def display_matrix(frame: object) -> tuple[int, ...] | None:
    """The display matrix side data of a decoded PyAV frame (9 int32), or None.

    A frame may also carry side data that PyAV does not name (FFmpeg 8's EXIF, which
    its MJPEG, PNG, TIFF and WebP decoders attach; the EXIF orientation itself becomes
    the display matrix): :func:`_name_side_data_types` gives such types placeholder
    names, since PyAV refuses to list a frame's side data otherwise. If listing still
    fails, the rotation PyAV reads from the matrix in C (``frame.rotation``) is used,
    without mirroring.
    """
    import av.sidedata.sidedata as sd

    _name_side_data_types()
    try:
        entries = list(frame.side_data)  # type: ignore[attr-defined]
    except ValueError:  # a side data type PyAV cannot name
        return rotation_matrix(getattr(frame, "rotation", 0) or 0)
    for entry in entries:
        if entry.type == sd.Type.DISPLAYMATRIX:
            raw = bytes(entry)
            if len(raw) >= 36:
                return struct.unpack("=9i", raw[:36])
    return None


def rotation_matrix(degrees: float) -> tuple[int, ...] | None:
    """The display matrix of a rotation by ``degrees`` counter-clockwise (the angle
    ``av_display_rotation_get`` reads, PyAV's ``frame.rotation``), as libavutil's
    ``av_display_rotation_set`` writes it for the same turn given clockwise (16.16 fixed
    point; 2.30 for the last entry), or None for no rotation."""
    if not degrees % 360:
        return None
    rad = math.radians(degrees)
    c, s = (round(v * (1 << 16)) for v in (math.cos(rad), math.sin(rad)))
    return (c, -s, 0, s, c, 0, 0, 0, 1 << 30)


_side_data_types_named = False


def _name_side_data_types() -> None:
    """Give every side data type that PyAV's ``Type`` enum lacks a placeholder member.

    PyAV 18.1 names the types up to FFmpeg 7's; listing a frame's side data makes an
    enum member of each entry's type, and an unnamed one (``AV_FRAME_DATA_EXIF`` = 31
    in FFmpeg 8) raises ``ValueError`` for the whole list. A placeholder
    (``UNNAMED_31``) is what :class:`enum.Enum` returns for a value it holds; named
    types are left as they are. Idempotent.
    """
    global _side_data_types_named
    if _side_data_types_named:
        return
    import av.sidedata.sidedata as sd

    kind = sd.Type
    known = kind._value2member_map_
    for value in range(256):
        if value not in known:
            member = object.__new__(kind)
            member._value_ = value
            member._name_ = f"UNNAMED_{value}"
            known.setdefault(value, member)
    _side_data_types_named = True


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
        self.timed = None not in pts and len(set(pts)) == n
        order = sorted(range(n), key=pts.__getitem__) if self.timed else list(range(n))
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


def _open(data: bytes):  # noqa: ANN202 - av.container.InputContainer
    import av

    return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")


_NO_DECODER = (
    "the video stream's codec cannot be decoded (an unknown or unsupported codec, or a "
    "corrupt file)"
)


def _video_stream(container: object):  # noqa: ANN202 - av.VideoStream
    """The video stream FFmpeg's command line picks by default (``av_find_best_stream``:
    not a cover picture, the largest and most decoded), not simply the first: a phone's
    thumbnail track or a cover image may come before the video."""
    streams = container.streams  # type: ignore[attr-defined]
    return streams.best("video") or streams.video[0]


def _reason(e: BaseException) -> str:
    """An FFmpeg error's text without its errno and function name, cleaned for clients."""
    import av

    args = getattr(e, "args", ())
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


class _Pass:
    """One decoding pass over a video for a set of frames (see :meth:`Video.decode`)."""

    def __init__(self, video: Video, wanted: Sequence[int]) -> None:
        self.video = video
        self.ix = video._index
        self.pending = set(wanted)
        self.got: dict[int, np.ndarray] = {}
        self.failed: dict[int, str] = {}
        self.gop_error: dict[int, str] = {}  # key position -> first error in its group
        self.tainted: dict[int, str] = {}  # frame index -> the error its packet followed
        self.seekable = self.ix.timed
        self.container = None
        self.packets: Iterator | None = None
        self.cursor = -1  # decode position of the last packet sent
        self.start = 0  # decode position the current run started from
        self.fresh = True  # no packet read since the last (re)start
        self.produced = 0  # frames returned since the start of the file (untimed)
        self.last_error = ""
        self.matrix: tuple[int, ...] | None = None  # display matrix of the last frame taken

    def run(self) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        ix = self.ix
        try:
            while self.pending:
                first = min(self.pending, key=ix.pos.__getitem__)
                start = ix.start_for(first)
                if self.packets is None or (
                    self.seekable and ix.pos[first] > self.cursor and start > self.cursor + 1
                ):
                    self._restart(start)
                    continue
                packet = self._next()
                if packet is None:
                    self._drain()
                    break
                self._send(packet)
                for i in [i for i in self.pending if ix.pos[i] < self.cursor - _REORDER_SLACK]:
                    self._fail(i, self.gop_error.get(ix.gop(ix.pos[i]), "no frame returned"))
        finally:
            if self.container is not None:
                self.container.close()
        return self.got, self.failed

    def _fail(self, i: int, reason: str) -> None:
        self.pending.discard(i)
        self.failed[i] = reason

    def _fail_all(self, reason: str) -> None:
        for i in list(self.pending):
            self._fail(i, reason)

    def _restart(self, start: int) -> None:
        """Read from decode position ``start`` (a key frame): seek there, or reopen at 0."""
        if not self.seekable:
            start = 0
        if self.container is not None and start > 0:
            try:
                self.container.seek(self.ix.pts[start], stream=self.stream, backward=True)
                self.codec.flush_buffers()
                self._begin(start)
                return
            except Exception:  # noqa: BLE001 - seeking failed: read from the start
                self.seekable = False
                start = 0
        if self.container is not None:
            self.container.close()
            self.container = None
        try:
            self.container = _open(self.video._data)
        except Exception as e:  # noqa: BLE001 - opened before; report, do not raise
            self._fail_all(_reason(e))
            return
        self.stream = _video_stream(self.container)
        self.codec = self.stream.codec_context
        if self.codec is None:  # checked when the video was opened; kept safe here
            self._fail_all(_NO_DECODER)
            return
        self.codec.thread_count = 1  # errors surface at the packet that has them
        self.produced = 0
        if start > 0:
            self._restart(start)
        else:
            self._begin(0)

    def _begin(self, start: int) -> None:
        self.packets = self.container.demux(self.stream)
        self.start, self.cursor, self.fresh = start, start - 1, True

    def _next(self):  # noqa: ANN202 - av.Packet or None at the end
        try:
            packet = next(self.packets)
        except StopIteration:
            return None
        except Exception as e:  # noqa: BLE001 - damaged or cut container data: stop here
            self.last_error = _reason(e)
            return None
        return None if packet.size == 0 else packet

    def _send(self, packet) -> None:  # noqa: ANN001 - av.Packet
        ix = self.ix
        i: int | None
        if packet.is_discard:
            i = None  # decoded for its references; FFmpeg drops its frame
        elif ix.timed:
            i = ix.by_pts.get(packet.pts)
        else:
            i = ix.index_at[self.cursor + 1] if self.cursor + 1 < len(ix.pos) else None
        if i is not None:
            p = ix.pos[i]
            if self.fresh and p > self.start:  # the seek went past the key frame
                self.seekable = False
                self._restart(0)
                return
            self.fresh = False
            self.cursor = p
            # the groups it may predict from: its own, and the previous one if it is shown
            # before its own key frame
            lo, hi = ix.start_for(i), ix.gop(p)
            hurt = ix.keys[bisect_right(ix.keys, lo) - 1 : bisect_right(ix.keys, hi)]
            errors = [self.gop_error[g] for g in hurt if g in self.gop_error]
            if errors:
                self.tainted[i] = f"follows undecodable data it may predict from ({errors[0]})"
        try:
            frames = self.codec.decode(packet)
        except Exception as e:  # noqa: BLE001 - a damaged packet
            self.last_error = _reason(e)
            if not ix.timed:  # output order no longer tells which frame is which
                self._fail_all(self.last_error)
                return
            if i is not None:
                self.gop_error.setdefault(ix.gop(ix.pos[i]), self.last_error)
                if i in self.pending:
                    self._fail(i, self.last_error)
            return
        for frame in frames:
            self._take(frame)

    def _drain(self) -> None:
        try:
            for frame in self.codec.decode(None):
                self._take(frame)
        except VideoError:
            raise
        except Exception as e:  # noqa: BLE001 - nothing more to get
            self.last_error = _reason(e)
        self._fail_all(self.last_error or "no frame returned (the stream ends early)")

    def _take(self, frame) -> None:  # noqa: ANN001 - av.VideoFrame
        if self.ix.timed:
            i = self.ix.by_pts.get(frame.pts)
        else:
            i = self.produced
            self.produced += 1
        if i is None or i not in self.pending:
            return
        if i in self.tainted:
            self._fail(i, self.tainted[i])
            return
        w, h = frame.width, frame.height
        lim = self.video.limits
        if w > lim.max_side or h > lim.max_side or w * h > lim.max_pixels:
            raise VideoError(
                f"video frames are {w}x{h} pixels; limits are {lim.max_side} per side and "
                f"{lim.max_pixels} pixels per frame"
            )
        try:
            # a frame without a display matrix is shown as the probe frame was: an APNG's
            # EXIF orientation, say, comes with its first frame only
            matrix = display_matrix(frame) or self.video._matrix
            pixels = orient(frame.to_ndarray(format="rgb24"), matrix)
        except Exception as e:  # noqa: BLE001 - a frame PyAV cannot convert: not decodable
            self._fail(i, f"frame could not be converted to RGB: {_reason(e)}")
            return
        self.pending.discard(i)
        self.got[i] = pixels
        self.matrix = matrix


def _image(frame: np.ndarray) -> Image.Image:
    """An HxWx3 uint8 array as a PIL image (through ``to_8bit``, like every image path)."""
    return to_8bit(Image.fromarray(frame, "RGB"))


class Video:
    """An opened, probed video: its :class:`VideoInfo`, and frames decoded on request.

    Opening demuxes the whole video stream (packet headers, nothing decoded) to learn
    every frame's time, then decodes one frame (frame 0, else the first key frames
    after it) for the displayed size. The object holds only the encoded bytes and that
    index; each :meth:`decode` opens its own demuxer and decoder (one thread).

    Args:
        data: the encoded file (MP4, MOV, WebM, MKV, AVI, MPEG-TS, ...).
        limits: video bounds.
        image_limits: image bounds each frame must also meet.
        shortest_edge: the image processor's resize target (pixels).

    Raises:
        VideoError: empty, over-size, corrupt, truncated or frameless data, no frame
            among the first key frames that decodes, more frames than
            ``limits.max_video_frames``, or frames over the size limits; no PyAV
            installed. Messages never hold a server-side path.
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
            import av  # noqa: F401 - checked here so that the rest can assume it
        except ImportError:  # pragma: no cover - a dependency
            raise VideoError("video support needs PyAV (pip install av)") from None
        self._data = data
        self.limits = limits
        self._matrix: tuple[int, ...] | None = None  # the probe frame's display matrix
        try:
            container = _open(data)
        except Exception as e:  # noqa: BLE001 - av.FFmpegError for what FFmpeg cannot open
            raise VideoError(
                "data is not a decodable video (corrupt, truncated, without video frames, "
                f"or not a video): {_reason(e)}"
            ) from None
        try:
            self._read(container, limits, image_limits, shortest_edge)
        except VideoError:
            raise
        except Exception as e:  # noqa: BLE001 - PyAV failing on hostile data: the data's fault
            log.warning("video probe failed on client data", exc_info=True)
            raise VideoError(
                f"data is not a decodable video (corrupt or truncated): {_reason(e)}"
            ) from None

    def _read(
        self,
        container: object,
        limits: VideoLimits,
        image_limits: ImageLimits | None,
        shortest_edge: int,
    ) -> None:
        """Probe the opened ``container`` and decode the probe frame (see the class doc)."""
        with container:  # type: ignore[attr-defined]
            if not container.streams.video:  # type: ignore[attr-defined]
                kinds = sorted({str(s.type) for s in container.streams})  # type: ignore[attr-defined]
                held = f"only {' and '.join(kinds)} streams" if kinds else "no streams"
                raise VideoError(
                    f"file has no video stream: it holds {held} (an audio file, a truncated "
                    "or corrupt video, or not a video)"
                )
            if _video_stream(container).codec_context is None:
                raise VideoError(_NO_DECODER)
            self._index, times, duration, fps = _probe(container, limits)
        n = len(times)
        self.info = VideoInfo(n, fps, duration, 0, 0, times)
        candidates = [0]
        for p in self._index.keys[1:]:
            i = self._index.index_at[p]
            if len(candidates) > _PROBE_KEYFRAMES:
                break
            if i not in candidates:
                candidates.append(i)
        first, self._matrix = self._probe_frame(candidates)
        h, w = int(first.shape[0]), int(first.shape[1])
        if image_limits is not None:
            try:
                check_size(w, h, image_limits, shortest_edge)
            except ImageError as e:
                raise VideoError(f"video frames: {e}") from None
        self.info = VideoInfo(n, fps, duration, w, h, times)

    def _probe_frame(self, candidates: Sequence[int]) -> tuple[np.ndarray, tuple[int, ...] | None]:
        """The first of ``candidates`` that decodes (its size is the video's frame size)
        and its display matrix (used for frames that carry none)."""
        reason = ""
        for i in candidates:
            probe = _Pass(self, [i])
            got, failed = probe.run()
            if i in got:
                return got[i], probe.matrix
            reason = failed.get(i, reason)
        tried = ", ".join(str(i) for i in candidates)
        raise VideoError(
            f"video is truncated or corrupt: no frame decodes (tried frames {tried}): {reason}"
        )

    def indices(self, selection: FrameSelection, cost: FrameCost | None = None) -> list[int]:
        """Frame indices for ``selection`` within the limits' frame and token caps, the
        frames priced by ``cost`` (see :func:`sample_frame_indices`)."""
        i, lim = self.info, self.limits
        return sample_frame_indices(
            i.num_frames,
            i.fps,
            i.duration,
            selection,
            lim.max_frames,
            i.frame_times,
            cost,
            lim.max_tokens,
        )

    def frames(self, indices: Sequence[int]) -> list[Image.Image]:
        """The frames at ``indices`` as RGB PIL images (each distinct index decoded once).

        Raises:
            VideoError: if any of them does not decode (a damaged stream); the message
                names every such frame (:func:`undecodable_message`).
        """
        got = self.decode(indices)
        if got.failed:
            raise VideoError(undecodable_message(got.failed, len(got.images) + len(got.failed)))
        return [got.images[i] for i in indices]

    def decode(self, indices: Sequence[int]) -> DecodedFrames:
        """Decode the frames at ``indices``, keeping those that decode.

        Packets go to the decoder in file order from the key frame before the first
        asked frame; groups of pictures without an asked frame are skipped by seeking.
        A frame does not decode if the decoder refuses its packet, never returns it,
        or returns it after refusing an earlier packet of the same key frame group:
        such a frame may predict from the lost one, and FFmpeg fills the gap with
        guessed pixels (error concealment). Frames whose packets went in before the
        damage are kept, even when the decoder returns them after it (reordering).
        Damage that the decoder does not report cannot be seen and is kept.

        Args:
            indices: frame indices (``0 <= i < num_frames``; repeats allowed).

        Returns:
            :class:`DecodedFrames`: RGB images as displayed (rotation applied, see
            :func:`orient`); never raises for a damaged stream.

        Raises:
            VideoError: a decoded frame over the size limits (a stream whose frame
                size changes midway).
        """
        wanted = sorted(set(indices))
        try:
            arrays, failed = _Pass(self, wanted).run()
        except VideoError:
            raise
        except Exception as e:  # noqa: BLE001 - PyAV failing on hostile data: frames lost
            log.warning("video decode failed on client data", exc_info=True)
            arrays, failed = {}, dict.fromkeys(wanted, _reason(e))
        times = self.info.frame_times
        return DecodedFrames(
            {i: _image(a) for i, a in sorted(arrays.items())},
            tuple(FrameFailure(i, times[i], failed[i]) for i in sorted(failed)),
        )
