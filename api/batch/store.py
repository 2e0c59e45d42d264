"""The batch API's store: ``/v1/files`` on disk (batch input files and batch output/error
files) and the atomic writes the batch jobs' state uses.

Layout under the data directory (``--data-dir``)::

    files/<file-id>.jsonl   the bytes
    files/<file-id>.json    the OpenAI file object (written atomically, after the bytes)

A file whose object is missing is not listed (an upload cut short by a crash); the
object is written last, so a listed file always has all its bytes. Adding, publishing,
reading and deleting one id are each one critical section of that id over the index
and both files (:mod:`api.commit`), so the listing, GET, the content and the files on
disk agree under concurrent calls and after a restart. The total size is bounded
(``max_stored_file_bytes``; checked and reserved atomically, so concurrent uploads
cannot pass it together).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from api.commit import IdLocks, fsync_dir, unlink_durably, write_bytes_atomic, write_json_atomic
from api.errors import APIError
from api.ids import FILE

#: ``purpose`` values a client may upload (output files get ``batch_output``; ``vision``
#: files are images, kept by the image store: :mod:`api.vision_files`).
UPLOAD_PURPOSES = ("batch", "vision")


def new_file_id() -> str:
    """A fresh ``file-<24 hex>`` id."""
    return f"file-{uuid.uuid4().hex[:24]}"


class FileStore:
    """Files of the batch API, on disk under ``root/files``.

    Args:
        root: the data directory (``--data-dir``; created on first write).
        max_total_bytes: most bytes all files may take together.
    """

    def __init__(self, root: Path, max_total_bytes: int) -> None:
        self.dir = root / "files"
        self.max_total_bytes = max_total_bytes
        self._lock = threading.Lock()  # the index and the reserved bytes
        self._ids = IdLocks()  # one critical section per id (api.commit)
        self._objects: dict[str, dict] = {}
        self._reserved = 0  # bytes of uploads being written
        if self.dir.is_dir():
            for tmp in self.dir.glob(".file-*.tmp"):  # writes cut short by a crash
                tmp.unlink(missing_ok=True)
            for meta in self.dir.glob("file-*.json"):
                try:
                    obj = json.loads(meta.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    continue
                fid = str(obj.get("id", ""))
                if FILE.parse(fid) is not None and self.path(fid).is_file():
                    self._objects[fid] = obj

    def path(self, file_id: str) -> Path:
        """Where the bytes of ``file_id`` are (whether or not it exists)."""
        return self.dir / f"{file_id}.jsonl"

    def total_bytes(self) -> int:
        """Bytes taken by all stored files."""
        with self._lock:
            return sum(o["bytes"] for o in self._objects.values())

    def add(self, data: bytes, filename: str, purpose: str, file_id: str | None = None) -> dict:
        """Store ``data`` (bytes, then object, then index: one critical section of the
        id) and return its file object. Blocking IO: call it from a worker thread.

        Raises:
            APIError: 400 when the store would exceed ``max_total_bytes``.
        """
        with self._lock:
            used = sum(o["bytes"] for o in self._objects.values()) + self._reserved
            if used + len(data) > self.max_total_bytes:
                raise APIError(
                    400,
                    f"the file store is full ({self.max_total_bytes} bytes); delete files first",
                    param="file",
                    code="file_store_full",
                )
            self._reserved += len(data)
        try:
            file_id = file_id or new_file_id()
            with self._ids.hold(file_id):
                self.dir.mkdir(parents=True, exist_ok=True)
                write_bytes_atomic(self.path(file_id), data)
                return self._register(file_id, filename, purpose)
        finally:
            with self._lock:
                self._reserved -= len(data)

    def publish(self, file_id: str, src: Path, filename: str) -> bool:
        """Move ``src`` (when it exists and is not empty) to the bytes of ``file_id`` and
        list it as a ``batch_output`` file, unless it is listed already; one critical
        section of the id. Idempotent, so a batch resumed after a crash may publish
        again. Returns whether ``file_id`` is listed (False when there was nothing to
        publish, or the client deleted it after an earlier publish)."""
        with self._ids.hold(file_id):
            dst = self.path(file_id)
            moved = src.exists() and src.stat().st_size > 0
            if moved:
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
                fsync_dir(dst.parent)
            if not dst.exists():
                return False
            with self._lock:
                listed = file_id in self._objects
            if moved or not listed:  # new bytes: their object (size) too
                self._register(file_id, filename, "batch_output")
            return True

    def _register(self, file_id: str, filename: str, purpose: str) -> dict:
        """Publish the file object of bytes already at :meth:`path` (written atomically;
        the caller holds the id's section)."""
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": self.path(file_id).stat().st_size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        write_json_atomic(self.dir / f"{file_id}.json", obj)
        with self._lock:
            self._objects[file_id] = obj
        return obj

    def get(self, file_id: str, param: str = "file_id", status: int = 404) -> dict:
        """The file object of ``file_id`` (the request field ``param``).

        Raises:
            APIError: 404 for an unknown or deleted id; for a malformed one, ``status``
                (404 for a path parameter, 400 for a request field).
        """
        with self._lock:
            return FILE.find(file_id, param, self._objects.get, status, missing=404)

    def read(
        self,
        file_id: str,
        param: str = "file_id",
        status: int = 404,
        then: Callable[[bytes], None] | None = None,
    ) -> bytes:
        """The bytes of ``file_id`` (the request field ``param``; bounded by the upload and
        output limits), read in the id's section, so a concurrent delete comes wholly
        before or after; ``then(bytes)`` runs in the section too (a batch checks and
        claims its input there, so a delete cannot pass between). Blocking IO: call it
        from a worker thread.

        Raises:
            APIError: 404 for an unknown or deleted id (``status`` for a malformed one,
                as :meth:`get`); whatever ``then`` raises.
        """
        with self._ids.hold(file_id):
            self.get(file_id, param, status)
            data = self.path(file_id).read_bytes()
            if then is not None:
                then(data)
            return data

    def list(self, purpose: str | None = None) -> list[dict]:
        """File objects, newest first, optionally of one ``purpose``."""
        with self._lock:
            objs = list(self._objects.values())
        objs = [o for o in objs if purpose is None or o["purpose"] == purpose]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def delete(self, file_id: str, in_use: Callable[[str], bool] | None = None) -> None:
        """Remove ``file_id`` in one critical section of the id: unlisted first, then
        its object and its bytes unlinked (and the directory synced), so it is never
        listed without bytes and a restart does not bring it back. ``in_use(file_id)``
        is asked inside the section (a batch claims its input in it too). Blocking IO:
        call it from a worker thread.

        Raises:
            APIError: 404 for an unknown id; 409 ``file_in_use`` when ``in_use`` says so.
        """
        with self._ids.hold(file_id):
            self.get(file_id)
            if in_use is not None and in_use(file_id):
                raise APIError(
                    409,
                    f"file {file_id!r} is the input of an unfinished batch; cancel it first",
                    code="file_in_use",
                )
            with self._lock:
                self._objects.pop(file_id, None)
            unlink_durably(self.dir / f"{file_id}.json", self.path(file_id))
