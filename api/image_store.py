"""Bounded, content-addressed store of uploaded images, optionally kept on disk.

The id is the image key (xxh3-128 of decoded pixels + processor fingerprint),
so uploading the same pixels again returns the same id. A bytes memo
(xxh3-64 of the file -> id) lets a repeated upload skip decoding; it never
decides sharing by itself (DESIGN.md, "Two hashes, two jobs").

With a directory, each uploaded image's original bytes are written to
``<dir>/<id>.img`` and read back (decoded and hashed again) at start, oldest
first, so uploads survive a restart; the bounds apply to the files too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from mmserve.engine.request import ImageInput
from mmserve.vision.image import ImageError

log = logging.getLogger(__name__)

_SUFFIX = ".img"


@dataclass
class StoredImage:
    """One entry of the store.

    Attributes:
        image: the decoded image and its key.
        nbytes: decoded pixel bytes (what the byte bound counts).
        file_bytes: size of the encoded file as uploaded (bytes).
        created: when it was first stored (Unix seconds).
        persisted: whether its bytes are on disk.
    """

    image: ImageInput
    nbytes: int
    file_bytes: int
    created: float
    persisted: bool = False


class ImageStore:
    """LRU store of decoded images bounded by count and decoded bytes.

    Args:
        prepare: decodes and hashes bytes (``InputProcessor.prepare_image``); raises ImageError.
        max_images: most images kept.
        max_bytes: most decoded pixel bytes kept (bytes).
        directory: where to keep uploads across restarts (None: memory only).
    """

    def __init__(
        self,
        prepare: Callable[[bytes], ImageInput],
        max_images: int = 256,
        max_bytes: int = 1 << 30,
        directory: str | os.PathLike | None = None,
    ) -> None:
        self.prepare = prepare
        self.max_images = max_images
        self.max_bytes = max_bytes
        self.directory = Path(directory) if directory else None
        self._entries: OrderedDict[str, StoredImage] = OrderedDict()
        self._memo: dict[int, str] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load()

    # ---- public -----------------------------------------------------------
    def put(self, data: bytes, persist: bool = True) -> ImageInput:
        """Decode (unless memoised), store and return an image; idempotent for equal pixels.

        Args:
            data: the encoded file.
            persist: also write it to the store's directory (uploads; not data URLs).

        Raises:
            ImageError: if the bytes are not an acceptable image.
        """
        digest = xxhash.xxh3_64_intdigest(data)
        with self._lock:
            known = self._memo.get(digest)
            entry = self._entries.get(known) if known is not None else None
            if entry is not None:
                self._entries.move_to_end(known)
        if entry is None:
            image = self.prepare(data)
            entry = StoredImage(image, _size(image), len(data), time.time())
        if persist and not entry.persisted and self.directory is not None:
            self._write(entry.image.id, data)
            entry.persisted = True
        with self._lock:
            self._add(entry, digest)
        return entry.image

    def get(self, image_id: str) -> ImageInput | None:
        """The stored image (marked as recently used), or None."""
        entry = self.info(image_id, touch=True)
        return entry.image if entry is not None else None

    def info(self, image_id: str, touch: bool = False) -> StoredImage | None:
        """The entry of ``image_id`` or None; ``touch`` marks it recently used."""
        with self._lock:
            entry = self._entries.get(image_id)
            if entry is not None and touch:
                self._entries.move_to_end(image_id)
        if entry is not None and touch and entry.persisted:
            self._touch(image_id)
        return entry

    def delete(self, image_id: str) -> bool:
        """Remove an image (and its file). Returns whether it was stored."""
        with self._lock:
            entry = self._entries.pop(image_id, None)
            if entry is None:
                return False
            self._bytes -= entry.nbytes
            self._memo = {d: i for d, i in self._memo.items() if i != image_id}
        if entry.persisted:
            self._unlink(image_id)
        return True

    def list(self) -> list[StoredImage]:
        """Every entry, most recently used first (does not change the order)."""
        with self._lock:
            return list(reversed(self._entries.values()))

    @property
    def total_bytes(self) -> int:
        """Decoded pixel bytes held (bytes)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    # ---- internals --------------------------------------------------------
    def _add(self, entry: StoredImage, digest: int | None) -> None:
        image_id = entry.image.id
        old = self._entries.get(image_id)
        if old is None:
            self._entries[image_id] = entry
            self._bytes += entry.nbytes
        else:
            old.persisted = old.persisted or entry.persisted
        self._entries.move_to_end(image_id)
        if digest is not None:
            self._memo[digest] = image_id
        evicted = []
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_images or self._bytes > self.max_bytes
        ):
            old_id, gone = self._entries.popitem(last=False)
            self._bytes -= gone.nbytes
            evicted.append((old_id, gone))
        if len(self._memo) > 4 * self.max_images or evicted:
            self._memo = {d: i for d, i in self._memo.items() if i in self._entries}
        for old_id, gone in evicted:
            if gone.persisted:
                self._unlink(old_id)

    def _path(self, image_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{image_id}{_SUFFIX}"

    def _write(self, image_id: str, data: bytes) -> None:
        path = self._path(image_id)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _touch(self, image_id: str) -> None:
        try:
            os.utime(self._path(image_id))
        except OSError:
            pass

    def _unlink(self, image_id: str) -> None:
        try:
            self._path(image_id).unlink()
        except FileNotFoundError:
            pass

    def _load(self) -> None:
        assert self.directory is not None
        files = sorted(self.directory.glob(f"img-*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            data = path.read_bytes()
            try:
                image = self.prepare(data)
            except ImageError as e:  # limits or model changed since it was stored
                log.warning("image store: skipping %s: %s", path.name, e)
                continue
            created = path.stat().st_mtime
            if path.name != f"{image.id}{_SUFFIX}":  # another processor: another key
                os.replace(path, self._path(image.id))
            entry = StoredImage(image, _size(image), len(data), created, persisted=True)
            self._add(entry, xxhash.xxh3_64_intdigest(data))
        log.info("image store: %d images loaded from %s", len(self._entries), self.directory)


def _size(image: ImageInput) -> int:
    im = image.image
    per_band = 4 if im.mode in ("I", "F") else 2 if "16" in im.mode else 1
    return im.width * im.height * max(1, len(im.getbands())) * per_band
