"""Bounded, content-addressed store of uploaded images, optionally kept on disk.

The id is the image key (xxh3-128 of decoded pixels + processor fingerprint),
so uploading the same pixels again returns the same id. The store keeps no decoded
image: an entry is the key, size and mode found when it was decoded, and (for uploads)
the encoded file, which the front end decodes again when a request needs the
image's tower input and the embedding cache does not hold its features. A decoded
6000x6000 image is about 108 MB; its PNG may be 100 KB, so keeping files rather than
pixels keeps the store's memory what its byte bound says. A bytes memo
(xxh3-64 of the file -> id) lets a repeated upload skip decoding; it never
decides sharing by itself: the image key does (docs/architecture.md, section 2,
invariant (1)).

With a directory, each uploaded image's original bytes are written to
``<dir>/<id>.img`` and read back (decoded and hashed again) at start, oldest
first, so uploads survive a restart; the bounds apply to the files too. An image's
display name, when it has one, is kept beside it in ``<dir>/<id>.name`` (written in
the id's section before the id is listed, unlinked after its file). An upload,
a delete and an eviction of one id each commit the index and the file in one
critical section of that id (:mod:`api.commit`), so the listing, GET and the files
agree after any mix of concurrent calls, and after a restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from api.commit import IdLocks, unlink_durably, write_bytes_atomic
from api.uploads import UploadStore, clean_name
from mmserve.vision.image import ImageError
from mmserve.vision.inputs import ImageInput

log = logging.getLogger(__name__)

_SUFFIX = ".img"


@dataclass
class StoredImage:
    """One entry of the store.

    Attributes:
        image: the image's key and size, with the encoded file as ``source`` when the
            store keeps files (no decoded image, no pixels).
        nbytes: bytes the entry holds in memory (its file, or 0; what the byte bound
            counts).
        file_bytes: size of the encoded file as uploaded (bytes).
        created: when it was first stored (Unix seconds).
        persisted: whether its bytes are on disk.
        color_mode: the decoded image's PIL mode (``RGB``, ``L``, ...).
        filename: its name (:func:`api.uploads.clean_name`): the ``name`` or file name
            of its first named upload (``/v1/images``, or ``/v1/files`` purpose vision);
            "" if none. Kept across a restart in ``<id>.name`` beside its file.
    """

    image: ImageInput
    nbytes: int
    file_bytes: int
    created: float
    persisted: bool = False
    color_mode: str = ""
    filename: str = ""


class ImageStore(UploadStore[StoredImage]):
    """LRU store of hashed images bounded by count and the bytes it holds.

    Args:
        prepare: decodes and hashes bytes (``InputProcessor.prepare_image``, returning
            the decoded image in ``image``, which the store drops); raises ImageError.
        max_images: most images kept.
        max_bytes: most bytes of encoded files kept in memory (bytes).
        directory: where to keep uploads across restarts (None: memory only).
        keep_files: keep each image's encoded file (uploads: a later request decodes it
            again); False keeps only keys and sizes (a memo of data-URL and remote images,
            whose requests bring the file again).
    """

    def __init__(
        self,
        prepare: Callable[[bytes], ImageInput],
        max_images: int = 256,
        max_bytes: int = 1 << 30,
        directory: str | os.PathLike | None = None,
        keep_files: bool = True,
    ) -> None:
        super().__init__(max_images, max_bytes, lambda e: e.nbytes)
        self.prepare = prepare
        self.keep_files = keep_files
        self.max_images = max_images
        self.directory = Path(directory) if directory else None
        self._memo: dict[int, str] = {}
        self._lock = threading.Lock()  # the memo, and LRU puts with their memo update
        self._ids = IdLocks()  # one critical section per id (api.commit)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load()

    # ---- public -----------------------------------------------------------
    def put(self, data: bytes, persist: bool = True, name: str = "") -> ImageInput:
        """Decode (unless memoised), store and return an image; idempotent for equal pixels.

        Decoding and hashing run outside any lock; whether the image is already stored,
        the file's write and the index update are one critical section of its id
        (:mod:`api.commit`), so a concurrent delete of the same id takes effect wholly
        before or wholly after this upload.

        Args:
            data: the encoded file.
            persist: also write it to the store's directory (uploads; not data URLs).
            name: its display name (cleaned by the caller); kept, in the same section,
                unless the image already has one.

        Raises:
            ImageError: if the bytes are not an acceptable image.
        """
        digest = xxhash.xxh3_64_intdigest(data)
        with self._lock:
            known = self._memo.get(digest)
            seen = self._entries.get(known, touch=False) if known is not None else None
        # a memo hit only spares the decode: the section below decides what is stored
        fresh = (
            dataclasses.replace(seen, persisted=False, created=time.time())
            if seen is not None
            else self._entry(self.prepare(data), data, time.time())
        )
        write = persist and self.directory is not None
        return self._commit(fresh, data, digest, write, name).image

    def lookup(self, data: bytes) -> ImageInput | None:
        """The stored image of these exact bytes (marked recently used), or None; never
        decodes."""
        digest = xxhash.xxh3_64_intdigest(data)
        with self._lock:
            known = self._memo.get(digest)
            entry = self._entries.get(known) if known is not None else None
        return entry.image if entry is not None else None

    def add(self, image: ImageInput, data: bytes) -> None:
        """Keep an image the caller decoded and hashed from ``data`` (its decoded image
        and pixels are not kept; never written to the directory)."""
        entry = self._entry(image, data, time.time())
        self._commit(entry, data, xxhash.xxh3_64_intdigest(data), write=False)

    def _entry(self, image: ImageInput, data: bytes, created: float) -> StoredImage:
        mode = image.image.mode if image.image is not None else ""
        source = data if self.keep_files else None
        bare = dataclasses.replace(image, image=None, pixels=None, features=None, source=source)
        return StoredImage(
            bare, len(data) if self.keep_files else 0, len(data), created, False, mode
        )

    def get(self, image_id: str) -> ImageInput | None:
        """The stored image (marked as recently used), or None."""
        entry = self.info(image_id, touch=True)
        return entry.image if entry is not None else None

    def info(self, image_id: str, touch: bool = False) -> StoredImage | None:
        """The entry of ``image_id`` or None; ``touch`` marks it recently used.

        Reads the index only: a listed id's file was written before it was listed and
        is unlinked only after it is unlisted."""
        entry = self._entries.get(image_id, touch=touch)
        if entry is not None and touch and entry.persisted:
            self._touch(image_id)
        return entry

    def delete(self, image_id: str) -> bool:
        """Remove an image (and its file) in one critical section of its id. Returns
        whether it was stored. Blocks while an upload of the same id commits: call it
        from a worker thread."""
        with self._ids.hold(image_id):
            with self._lock:
                entry = self._entries.pop(image_id)
                if entry is None:
                    return False
                self._memo = {d: i for d, i in self._memo.items() if i != image_id}
            if self.directory is not None:  # unlisted first, so never listed without it
                unlink_durably(self._path(image_id), self._name_path(image_id))
        return True

    # ---- internals --------------------------------------------------------
    def _commit(
        self, fresh: StoredImage, data: bytes, digest: int, write: bool, name: str = ""
    ) -> StoredImage:
        """Keep ``fresh`` unless its id is stored (then mark that entry used), writing
        ``data`` to its file first when ``write``; a non-empty ``name`` becomes the
        entry's (and its sidecar's) if it has none yet; one critical section of the id.
        Returns the stored entry."""
        image_id = fresh.image.id
        evicted: list[tuple[str, StoredImage]] = []
        with self._ids.hold(image_id):
            entry = self._entries.get(image_id)  # marks it most recently used
            if name and not (entry or fresh).filename:  # the first name stays
                (entry or fresh).filename = name
                if self.directory is not None and (write or (entry and entry.persisted)):
                    write_bytes_atomic(self._name_path(image_id), name.encode())
            if entry is None:
                entry = fresh
                if write:
                    self._write(image_id, data)
                    entry.persisted = True
                with self._lock:
                    evicted = self._entries.put(image_id, entry)
            elif write and not entry.persisted:
                self._write(image_id, data)
                entry.persisted = True
            with self._lock:
                self._memo[digest] = image_id
                if len(self._memo) > 4 * self.max_images or evicted:
                    self._memo = {d: i for d, i in self._memo.items() if i in self._entries}
        for old_id, _ in evicted:  # in their own sections: never two at once
            self._drop_file(old_id)
        return entry

    def _drop_file(self, image_id: str) -> None:
        """Unlink the file of an evicted id, unless an upload stored it again since."""
        if self.directory is None:
            return
        with self._ids.hold(image_id):
            if self._entries.get(image_id, touch=False) is None:
                unlink_durably(self._path(image_id), self._name_path(image_id))

    def _path(self, image_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{image_id}{_SUFFIX}"

    def _name_path(self, image_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{image_id}.name"

    def _write(self, image_id: str, data: bytes) -> None:
        write_bytes_atomic(self._path(image_id), data)

    def _touch(self, image_id: str) -> None:
        try:
            os.utime(self._path(image_id))
        except OSError:
            pass

    def _load(self) -> None:
        assert self.directory is not None
        for tmp in self.directory.glob(".img-*.*.tmp"):  # writes cut short
            tmp.unlink(missing_ok=True)
        files = sorted(self.directory.glob(f"img-*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            data = path.read_bytes()
            try:
                image = self.prepare(data)
            except ImageError as e:  # limits or model changed since it was stored
                log.warning("image store: skipping %s: %s", path.name, e)
                continue
            created = path.stat().st_mtime
            old_name = path.with_suffix(".name")
            try:
                name = clean_name(old_name.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                name = ""
            if path.name != f"{image.id}{_SUFFIX}":  # another processor: another key
                if name:
                    os.replace(old_name, self._name_path(image.id))
                os.replace(path, self._path(image.id))
            entry = self._entry(image, data, created)
            entry.persisted = True
            entry.filename = name
            self._commit(entry, data, xxhash.xxh3_64_intdigest(data), write=False)
        log.info("image store: %d images loaded from %s", len(self._entries), self.directory)
