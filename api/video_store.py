"""Bounded store of uploaded videos, and expanding a video into hashed frame images.

A video is kept as its encoded bytes plus what a probe found (frame count, fps,
duration, size); its id is xxh3-128 of the bytes (``vid-...``), so uploading
the same file twice changes nothing. Frames are decoded per request and each
becomes an :class:`~mmserve.engine.request.ImageInput` exactly like an uploaded
photo: its key comes from its pixels, so equal frames share one key whatever
video (or image upload) they came from. Frames of a damaged stream that do not
decode are skipped and reported (:func:`sample_decodable_frames`) or refused
(:func:`sample_frames`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from mmserve.engine.engine import Engine
from mmserve.engine.request import ImageInput
from mmserve.vision.budget import RequestPixels, decoded_bytes
from mmserve.vision.hashing import image_key
from mmserve.vision.video import (
    FrameFailure,
    FrameSelection,
    Video,
    VideoError,
    VideoInfo,
    VideoLimits,
    undecodable_message,
)


@dataclass
class StoredVideo:
    """One uploaded video: ``id``, encoded ``data``, probe ``info``, ``created`` (Unix s)."""

    id: str
    data: bytes
    info: VideoInfo
    created: float


@dataclass
class Frame:
    """A sampled frame: its index in the video, its time (seconds) and its hashed image."""

    index: int
    timestamp: float
    image: ImageInput


def video_id(data: bytes) -> str:
    """The id of an encoded video: ``vid-`` + xxh3-128 of its bytes."""
    return "vid-" + xxhash.xxh3_128_hexdigest(data)


def open_video(engine: Engine, data: bytes, limits: VideoLimits) -> Video:
    """Open and probe ``data`` against the video and the engine's image limits.

    Raises:
        VideoError: naming the problem.
    """
    return Video(data, limits, engine.config.image_limits, engine.processor.shortest_edge)


def sample_frames(
    engine: Engine,
    video: Video,
    selection: FrameSelection,
    mode: str | None = None,
    pixels: RequestPixels | None = None,
) -> list[Frame]:
    """Decode the selected frames and hash each as an image (equal pixels: one key); given
    ``mode``, preprocess each and drop its decoded image (:func:`_sample`).

    Raises:
        VideoError: a bad selection, or any selected frame that does not decode (the
            message names each such frame and its time).
    """
    frames, failed = _sample(engine, video, selection, mode, pixels)
    if failed:
        raise VideoError(undecodable_message(failed, len(failed) + len({f.index for f in frames})))
    return frames


def sample_decodable_frames(
    engine: Engine,
    video: Video,
    selection: FrameSelection,
    mode: str | None = None,
    pixels: RequestPixels | None = None,
) -> tuple[list[Frame], list[FrameFailure]]:
    """The selected frames that decode, hashed, and the selected frames that do not.

    Returns:
        ``(frames, skipped)``: frames in selection order without the undecodable ones,
        and each undecodable frame once, ascending by index.

    Raises:
        VideoError: a bad selection, or no selected frame decodes (the message names
            every one of them).
    """
    frames, failed = _sample(engine, video, selection, mode, pixels)
    if not frames:
        raise VideoError(undecodable_message(failed, len(failed)))
    return frames, failed


def _sample(
    engine: Engine,
    video: Video,
    selection: FrameSelection,
    mode: str | None = None,
    pixels: RequestPixels | None = None,
) -> tuple[list[Frame], list[FrameFailure]]:
    """The selected frames, decoded and hashed, with their decoded bytes held in the
    server-wide budget from before decoding until they are preprocessed (``mode``) or
    returned; every selected frame is charged to ``pixels``.

    Raises:
        PixelBudgetError, ImageError: past the request's pixel budget, or frames larger
            than the whole server budget.
        DecodeBusyError: the server-wide budget stayed full.
    """
    indices = video.indices(selection)
    w, h = video.info.width, video.info.height
    if pixels is not None:
        for _ in indices:
            pixels.charge(w, h, "video frame")
    processor = engine.processor
    held = len(set(indices)) * decoded_bytes(w, h, "RGB")
    processor.decode_budget.acquire(held)
    try:
        got = video.decode(indices)
        keys: dict[int, ImageInput] = {}
        for i in dict.fromkeys(indices):
            im = got.images.get(i)
            if im is not None:
                keys[i] = ImageInput(image_key(im, processor.fingerprint), im)
        if mode is not None:  # the tower input made here, the decoded frames dropped
            ready = processor.prepare_frames(list(keys.values()), mode)
            keys = dict(zip(keys, ready, strict=True))
        out = [Frame(i, video.info.frame_times[i], keys[i]) for i in indices if i in keys]
        failed = list(got.failed)
        del got
    finally:
        processor.decode_budget.release(held)
    return out, failed


class VideoStore:
    """LRU store of encoded videos bounded by count and bytes (memory only).

    Args:
        max_videos: most videos kept.
        max_bytes: most encoded bytes kept.
    """

    def __init__(self, max_videos: int = 32, max_bytes: int = 512 << 20) -> None:
        self.max_videos = max_videos
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredVideo] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, info: VideoInfo) -> StoredVideo:
        """Keep a probed video (idempotent for equal bytes) and return its entry."""
        vid = video_id(data)
        with self._lock:
            entry = self._entries.get(vid)
            if entry is None:
                entry = StoredVideo(vid, data, info, time.time())
                self._entries[vid] = entry
                self._bytes += len(data)
            self._entries.move_to_end(vid)
            while len(self._entries) > 1 and (
                len(self._entries) > self.max_videos or self._bytes > self.max_bytes
            ):
                _, gone = self._entries.popitem(last=False)
                self._bytes -= len(gone.data)
        return entry

    def get(self, vid: str) -> StoredVideo | None:
        """The entry (marked recently used), or None."""
        with self._lock:
            entry = self._entries.get(vid)
            if entry is not None:
                self._entries.move_to_end(vid)
            return entry

    def delete(self, vid: str) -> bool:
        """Remove a video; returns whether it was stored."""
        with self._lock:
            entry = self._entries.pop(vid, None)
            if entry is not None:
                self._bytes -= len(entry.data)
            return entry is not None

    def list(self) -> list[StoredVideo]:
        """Every entry, most recently used first."""
        with self._lock:
            return list(reversed(self._entries.values()))

    @property
    def total_bytes(self) -> int:
        """Encoded bytes held."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
