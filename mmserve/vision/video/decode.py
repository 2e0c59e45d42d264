"""Decode the frames a request selected (:class:`Video`): PyAV, one pass per call,
damaged streams decoded packet by packet.

One decoder reads every video: PyAV, FFmpeg's own API. decord (used before) refused
frames narrower than about 32 pixels and some odd widths (8, 12, 16, 24, 48, 72: "The
size must exactly match"), and its decoder thread read ahead into damaged packets and
dropped good frames before them now and then. Where decord decoded a frame, PyAV's
``rgb24`` conversion gives the same bytes (both use libswscale's defaults; checked in
``tests/test_video_decoders.py``).

A damaged stream is decoded packet by packet (:meth:`Video.decode`): frames that
decode are returned and the others are listed with their times, so a caller can
answer from what is left or refuse naming them. Every decoder error is passed
through :func:`~mmserve.vision.image.clean_decoder_message`.

Each decoded frame becomes an RGB PIL image, hashed like an uploaded photo
(:func:`mmserve.vision.hashing.image_key`).
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from mmserve.cancel import Cancelled, check_cancelled
from mmserve.vision.image import (
    ImageError,
    ImageLimits,
    check_size,
    to_8bit,
)
from mmserve.vision.video.orientation import display_matrix, orient
from mmserve.vision.video.probe import (
    _NO_DECODER,
    VideoInfo,
    _open,
    _probe,
    _reason,
    _video_stream,
)

if TYPE_CHECKING:
    from av.container import InputContainer

from mmserve.vision.video.select import (
    FrameCost,
    FrameSelection,
    VideoError,
    VideoLimits,
    sample_frame_indices,
)

log = logging.getLogger(__name__)

#: Key frames after frame 0 tried for the probe when frame 0 does not decode.
_PROBE_KEYFRAMES = 3
#: Packets sent after a frame's own packet before a frame the decoder never returned
#: counts as lost (FFmpeg's H.264 decoder holds at most 16 frames for reordering).
_REORDER_SLACK = 32


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


class _Pass:
    """One decoding pass over a video for a set of frames (see :meth:`Video.decode`)."""

    # the container's video stream and its decoder, set by _restart when it opens the
    # container (PyAV objects, kept untyped as _video_stream returns them)
    stream: Any
    codec: Any

    def __init__(self, video: Video, wanted: Sequence[int]) -> None:
        self.video = video
        self.ix = video._index
        self.pending = set(wanted)
        self.got: dict[int, np.ndarray] = {}
        self.failed: dict[int, str] = {}
        self.gop_error: dict[int, str] = {}  # key position -> first error in its group
        self.tainted: dict[int, str] = {}  # frame index -> the error its packet followed
        self.seekable = self.ix.timed
        self.container: InputContainer | None = None
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
                check_cancelled()  # between packets: the requester may have left
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
            pts = self.ix.pts[start]
            assert pts is not None  # seekable: every packet has its own pts
            try:
                self.container.seek(pts, stream=self.stream, backward=True)
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
        assert self.container is not None  # _restart opened it just before
        self.packets = self.container.demux(self.stream)
        self.start, self.cursor, self.fresh = start, start - 1, True

    def _next(self):
        assert self.packets is not None  # run() restarts (which sets them) first
        try:
            packet = next(self.packets)
        except StopIteration:
            return None
        except Exception as e:  # noqa: BLE001 - damaged or cut container data: stop here
            self.last_error = _reason(e)
            return None
        return None if packet.size == 0 else packet

    def _send(self, packet) -> None:
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

    def _take(self, frame) -> None:
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
        except Exception as e:  # PyAV failing on hostile data: the data's fault
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
            Cancelled: the current :class:`~mmserve.cancel.CancelToken` was cancelled
                (checked between packets).
        """
        wanted = sorted(set(indices))
        try:
            arrays, failed = _Pass(self, wanted).run()
        except (VideoError, Cancelled):
            raise
        except Exception as e:  # PyAV failing on hostile data: frames lost
            log.warning("video decode failed on client data", exc_info=True)
            arrays, failed = {}, dict.fromkeys(wanted, _reason(e))
        times = self.info.frame_times
        return DecodedFrames(
            {i: _image(a) for i, a in sorted(arrays.items())},
            tuple(FrameFailure(i, times[i], failed[i]) for i in sorted(failed)),
        )
