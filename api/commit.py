"""How every store commits: one critical section per id over its index and its files.

Every store of the server (uploaded images and videos, ``/v1/files`` with the batch
output and error files, and any store added later, such as stored responses) changes
an id only inside ``IdLocks.hold(id)``:

- an upload decides "already stored" from the index *inside* the section, writes the
  file there (:func:`write_bytes_atomic`: temporary file, fsync, rename, fsync of the
  directory), and only then adds the id to the index;
- a delete (or an eviction) removes the id from the index first, then unlinks the
  file, in the section of that id.

So two operations on one id never interleave: the outcome is the one of some serial
order of the operations (each takes effect inside its section), and an operation
that returned is never undone by one that returned before it. Readers (GET, listing)
read the index without the section: since a file is written before its id is listed
and an id is unlisted before its file goes, a listed id always has its file. Heavy
work (decoding, hashing, probing) stays outside the section; only the commit is
locked. The sections are ``threading`` locks: stores take them in worker threads
(``run_in_threadpool``, the batch IO thread), never for long on the event loop.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class _Slot:
    """The lock of one id and how many threads hold it or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: a section may call the store's own
        self.users = 0


class IdLocks:
    """A table of per-id locks whose entries live only while a thread holds or waits
    for them (reference counted), so the table never holds more entries than there
    are threads inside or waiting for a section: it does not grow with the ids seen.

    Sections of different ids run in parallel; a thread may enter the section it is in
    again (so a caller can hold a section around several calls of the store), but must
    not hold sections of two ids at once (no lock order between ids): a store that
    evicts other ids inside a section unlinks their files in their own sections after
    leaving its own.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._slots: dict[str, _Slot] = {}

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """The critical section of ``key``: blocks until no other thread is inside it."""
        with self._mutex:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
            slot.users += 1
        try:
            with slot.lock:
                yield
        finally:
            with self._mutex:
                slot.users -= 1
                if slot.users == 0:
                    del self._slots[key]

    def __len__(self) -> int:
        """Ids with a thread inside or waiting for their section."""
        with self._mutex:
            return len(self._slots)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old or the new file, never a
    torn one (temporary file, fsync, rename, fsync of the directory)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: object) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, json.dumps(obj).encode("utf-8"))


def unlink_durably(*paths: Path) -> None:
    """Remove ``paths`` in order (missing ones are fine) and fsync their directories,
    so the removal survives a power cut."""
    dirs = []
    for path in paths:
        path.unlink(missing_ok=True)
        if path.parent not in dirs:
            dirs.append(path.parent)
    for d in dirs:
        if d.is_dir():
            fsync_dir(d)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or a new file in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
