"""Decode videos with decord and sample frames; every sampled frame becomes an image.

A frame is an RGB uint8 array turned into a PIL image and hashed like an
uploaded photo (:func:`mmserve.vision.hashing.image_key`), so identical frames
(a static scene, the same footage in two clips) share one key, one vision-tower
run and their KV. Frame selection is a pure function of the video's frame count,
frame rate, duration and the request (:func:`sample_frame_indices`).

A damaged stream is decoded frame by frame (:meth:`Video.decode`): the frames that
decode are returned and the others are listed with their times, so a caller can
answer from what is left or refuse naming them. Every decord error is caught here
and passed through :func:`~mmserve.vision.image.clean_decoder_message` (decord's
text holds its build directory and a native stack trace).
"""

from __future__ import annotations

import io
import math
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from mmserve.vision.image import (
    ImageError,
    ImageLimits,
    check_size,
    clean_decoder_message,
    to_8bit,
)

#: Frames sampled when a request names neither ``num_frames``, ``fps`` nor ``timestamps``.
DEFAULT_NUM_FRAMES = 8
_EPS = 1e-6
#: Pauses (seconds) between reads of one frame, each on a fresh reader, before it counts
#: as undecodable (11 reads over 1.5 s). decord's decoder thread reads ahead of the frame
#: asked for and its first error discards what it decoded, so a damaged packet after a
#: good frame fails that frame whenever the reading thread is descheduled at the wrong
#: moment: 5-20% of reads on busy CPUs, in bursts of up to 10 reads (0.4 s), hence
#: pauses that grow. A frame that decodes once is decodable. Paid in full once per key
#: frame group that holds damage (see :meth:`Video.decode`).
_RETRY_PAUSES = (0.0, 0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.4, 0.55)
#: Shorter pauses for the probe, which only needs some frame that decodes.
_PROBE_PAUSES = (0.0, 0.0, 0.005, 0.02)
#: Key frames after frame 0 tried for the probe when frame 0 does not decode.
_PROBE_KEYFRAMES = 3


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


@dataclass(frozen=True)
class FrameFailure:
    """A frame that did not decode.

    Attributes:
        index: its index in the video.
        timestamp: its start time (seconds).
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
        stream): frame 8 at 0.8 s, frame 12 at 1.2 s; decoder: Error sending packet."``
    """
    listed = ", ".join(f"frame {f.index} at {f.timestamp:g} s" for f in failed)
    return (
        f"{len(failed)} of the {asked} selected frames could not be decoded (damaged or "
        f"corrupt stream): {listed}; decoder: {failed[0].reason}"
    )


class Video:
    """An opened video (decord ``VideoReader``) with its probed :class:`VideoInfo`.

    Args:
        data: the encoded file (MP4, WebM, MKV, AVI, ...).
        limits: video bounds.
        image_limits: image bounds each frame must also meet.
        shortest_edge: the image processor's resize target (pixels).

    Raises:
        VideoError: empty, over-size, corrupt, truncated or frameless data, no frame
            among the first key frames that decodes, or frames over the size limits; no
            decord installed. Messages never hold a server-side path.
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
            import decord  # noqa: F401 - checked here so that _open can assume it
        except ImportError:  # pragma: no cover - a dependency
            raise VideoError("video support needs decord (pip install decord)") from None
        self._data = data
        try:
            vr = self._open()
            n = len(vr)
        except Exception as e:  # DECORDError (a RuntimeError) for anything it cannot open
            if "cannot find video stream" in str(e):
                raise VideoError("file has no video stream (audio only, or not a video)") from None
            raise VideoError(
                "data is not a decodable video (corrupt, truncated, without video frames, "
                f"or not a video): {clean_decoder_message(e)}"
            ) from None
        if n < 1:
            raise VideoError("video has no frames")
        try:
            pts = vr.get_frame_timestamp(list(range(n)))
            fps = float(vr.get_avg_fps())
            keys = sorted({int(k) for k in vr.get_key_indices() if 0 < k < n})
        except Exception as e:
            raise VideoError(f"video is truncated or corrupt: {clean_decoder_message(e)}") from None
        self._reader: object | None = vr
        self._keys = [0, *keys]
        first = self._probe_frame([0, *keys[:_PROBE_KEYFRAMES]])
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

    def _open(self):  # noqa: ANN202 - decord.VideoReader
        import decord

        return decord.VideoReader(io.BytesIO(self._data), ctx=decord.cpu(0), num_threads=1)

    def _probe_frame(self, candidates: Sequence[int]):  # noqa: ANN202 - numpy array
        """The first of ``candidates`` that decodes (its size is the video's frame size)."""
        reason = ""
        for i in candidates:
            try:
                return self._decode_one(i, _PROBE_PAUSES)
            except Exception as e:  # noqa: BLE001 - damaged there; try the next key frame
                reason = clean_decoder_message(e)
        tried = ", ".join(str(i) for i in candidates)
        raise VideoError(
            f"video is truncated or corrupt: no frame decodes (tried frames {tried}): {reason}"
        )

    def _decode_one(self, index: int, pauses: Sequence[float] = _RETRY_PAUSES):  # noqa: ANN202
        """Frame ``index`` as an HxWx3 uint8 array, read on fresh readers until one read
        succeeds or ``pauses`` (seconds before each read) are spent.

        Raises:
            Exception: decord's last error when every read on a fresh reader failed.
        """
        tries = 0
        while True:
            fresh = self._reader is None
            if fresh and tries:
                time.sleep(pauses[tries])
            try:
                if self._reader is None:
                    self._reader = self._open()
                # one native call: vr[i] is two (seek, then read), and the decoder
                # thread can meet the damage while Python runs between them
                return self._reader.get_batch([index]).asnumpy()[0]
            except Exception:
                self._reader = None  # a decord reader keeps failing after an error
                # a reused reader may carry an error from reading ahead: not a try
                tries += fresh
                if tries >= len(pauses):
                    raise

    def indices(self, selection: FrameSelection) -> list[int]:
        """Frame indices for ``selection`` (see :func:`sample_frame_indices`)."""
        i = self.info
        return sample_frame_indices(
            i.num_frames, i.fps, i.duration, selection, self.limits.max_frames, i.frame_times
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

        All of them are read in one pass first; if that fails (a damaged stream), each
        is read on its own, on fresh readers with pauses (``_RETRY_PAUSES``), and a frame
        that never decodes is listed in ``failed`` with the decoder's cleaned reason.
        decord decodes from the key frame before a frame and stops at the first bad
        packet, so in each key frame's group the frames it can give are the first ones:
        after a frame that fails, the later frames of its group are listed without
        being read. Frames that decode with visible damage (the decoder conceals
        errors) cannot be told apart and are kept.

        Args:
            indices: frame indices (``0 <= i < num_frames``; repeats allowed).

        Returns:
            :class:`DecodedFrames`; never raises for a damaged stream.
        """
        distinct = sorted(set(indices))
        try:
            if self._reader is None:
                self._reader = self._open()
            arrays = self._reader.get_batch(distinct).asnumpy()
            images = {i: _image(a) for i, a in zip(distinct, arrays, strict=True)}
            return DecodedFrames(images, ())
        except Exception:  # noqa: BLE001 - a damaged stream: find which frames decode
            self._reader = None
        images: dict[int, Image.Image] = {}
        failed: list[FrameFailure] = []
        dead: tuple[int, str] | None = None  # (key frame, reason) of a group that failed
        for i in distinct:
            key = self._keys[bisect_right(self._keys, i) - 1]
            if dead is None or dead[0] != key:
                try:
                    images[i] = _image(self._decode_one(i))
                    continue
                except Exception as e:  # noqa: BLE001 - this frame does not decode
                    dead = (key, clean_decoder_message(e))
            failed.append(FrameFailure(i, self.info.frame_times[i], dead[1]))
        return DecodedFrames(images, tuple(failed))


def _image(frame) -> Image.Image:  # noqa: ANN001 - HxWx3 uint8 numpy array
    # decord gives 8-bit RGB; to_8bit keeps every image path behind one conversion
    return to_8bit(Image.fromarray(frame, "RGB"))
