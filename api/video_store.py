"""Bounded store of uploaded videos.

A video is kept as its encoded bytes plus what a probe found (frame count, fps,
duration, size); its id is xxh3-128 of the bytes (``vid-...``), so uploading
the same file twice changes nothing. Frames are decoded per request by the front
end (:meth:`~mmserve.frontend.processor.InputProcessor.sample_frames`, called from
:mod:`api.video_media`), each an image keyed by its pixels like an uploaded photo.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import xxhash

from api.commit import IdLocks
from api.uploads import UploadStore
from mmserve.vision.video import VideoInfo


@dataclass
class StoredVideo:
    """One uploaded video: ``id``, encoded ``data``, probe ``info``, ``created`` (Unix s),
    ``name``: the display name of its first named upload ("" if none)."""

    id: str
    data: bytes
    info: VideoInfo
    created: float
    name: str = ""


def video_id(data: bytes) -> str:
    """The id of an encoded video: ``vid-`` + xxh3-128 of its bytes."""
    return "vid-" + xxhash.xxh3_128_hexdigest(data)


class VideoStore(UploadStore[StoredVideo]):
    """LRU store of encoded videos bounded by count and bytes (memory only; its
    sections hold no file IO, so they are short).

    Args:
        max_videos: most videos kept.
        max_bytes: most encoded bytes kept.
    """

    def __init__(self, max_videos: int = 32, max_bytes: int = 512 << 20) -> None:
        super().__init__(max_videos, max_bytes, lambda e: len(e.data))
        self.max_videos = max_videos
        self._ids = IdLocks()  # one critical section per id (api.commit)

    def put(self, data: bytes, info: VideoInfo, name: str = "") -> StoredVideo:
        """Keep a probed video (idempotent for equal bytes; a non-empty ``name`` is kept
        if it has none yet) and return its entry; the check, the insert and the naming
        are one critical section of its id (:mod:`api.commit`)."""
        vid = video_id(data)
        with self._ids.hold(vid):
            entry = self._entries.get(vid)
            if entry is None:
                entry = StoredVideo(vid, data, info, time.time(), name)
                self._entries.put(vid, entry)
            elif name and not entry.name:  # the first name stays
                entry.name = name
        return entry

    def get(self, vid: str) -> StoredVideo | None:
        """The entry (marked recently used), or None."""
        return self._entries.get(vid)

    def delete(self, vid: str) -> bool:
        """Remove a video in one critical section of its id; returns whether it was
        stored."""
        with self._ids.hold(vid):
            return self._entries.pop(vid) is not None
