"""The batch API's store: ``/v1/files`` on disk (batch input files and batch output/error
files) and the atomic writes the batch jobs' state uses.

Layout under the data directory (``--data-dir``)::

    files/<file-id>.jsonl   the bytes
    files/<file-id>.json    the OpenAI file object (written atomically, after the bytes)

A file whose object is missing is not listed (an upload cut short by a crash); the
object is written last, so a listed file always has all its bytes. The total size is
bounded (``max_stored_file_bytes``).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

from api.errors import APIError
from api.ids import FILE

#: ``purpose`` values a client may upload (output files get ``batch_output``; ``vision``
#: files are images, kept by the image store: :mod:`api.vision_files`).
UPLOAD_PURPOSES = ("batch", "vision")


def write_json_atomic(path: Path, obj: object) -> None:
    """Write ``obj`` as JSON to ``path`` so that a crash leaves the old or the new file,
    never a torn one (:func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, json.dumps(obj).encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old or the new file, never a
    torn one (temporary file, fsync, rename, fsync of the directory)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or a new file in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self._lock = threading.Lock()
        self._objects: dict[str, dict] = {}
        if self.dir.is_dir():
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
        """Store ``data`` and return its file object.

        Raises:
            APIError: 400 when the store would exceed ``max_total_bytes``.
        """
        if self.total_bytes() + len(data) > self.max_total_bytes:
            raise APIError(
                400,
                f"the file store is full ({self.max_total_bytes} bytes); delete files first",
                param="file",
                code="file_store_full",
            )
        file_id = file_id or new_file_id()
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{file_id}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(file_id))
        return self.register(file_id, filename, purpose)

    def register(self, file_id: str, filename: str, purpose: str) -> dict:
        """Publish the file object of bytes already at :meth:`path` (written atomically)."""
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

    def read(self, file_id: str) -> bytes:
        """The bytes of ``file_id`` (bounded by the upload and output limits).

        Raises:
            APIError: 404 for an unknown id.
        """
        self.get(file_id)
        return self.path(file_id).read_bytes()

    def list(self, purpose: str | None = None) -> list[dict]:
        """File objects, newest first, optionally of one ``purpose``."""
        with self._lock:
            objs = list(self._objects.values())
        objs = [o for o in objs if purpose is None or o["purpose"] == purpose]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def delete(self, file_id: str) -> None:
        """Remove ``file_id`` (its object first, so it is never listed without bytes).

        Raises:
            APIError: 404 for an unknown id.
        """
        self.get(file_id)
        with self._lock:
            self._objects.pop(file_id, None)
        (self.dir / f"{file_id}.json").unlink(missing_ok=True)
        self.path(file_id).unlink(missing_ok=True)
