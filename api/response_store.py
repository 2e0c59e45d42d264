"""Bounded stores of JSON records (stored responses, conversations), kept in memory or on
disk (``--responses-store memory|disk|off``), each record owned by one tenant.

A record is a JSON object with ``id`` and ``owner``; a get, update or delete by another
owner finds nothing (the routes answer 404). The store holds at most ``max_items``
records and ``max_bytes`` bytes of them (their JSON), evicting the oldest first; one
record may take at most ``max_object_bytes`` (:meth:`JsonStore.check_size`). A disk
store writes each record to ``<dir>/<id>.json`` and keeps only an index in memory; its
commits follow :mod:`api.commit` (one section per id, atomic writes, durable unlinks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import Request

from api.commit import IdLocks, unlink_durably, write_bytes_atomic
from api.errors import APIError

log = logging.getLogger(__name__)

#: The owner of every object when the server has one tenant.
DEFAULT_OWNER = "default"
#: ``--responses-store`` values.
STORE_MODES = ("memory", "disk", "off")
#: Most pairs in a ``metadata`` object, and longest key and value (OpenAI's bounds).
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def owner_of(request: Request) -> str:
    """The tenant a request acts for (``request.state.tenant`` when the auth layer set
    one; else :data:`DEFAULT_OWNER`): the owner of what it stores and the only one whose
    objects it may read."""
    return str(getattr(request.state, "tenant", DEFAULT_OWNER) or DEFAULT_OWNER)


def store_off(param: str) -> APIError:
    """The 400 for a field or route that needs the store when it is turned off."""
    return APIError(
        400,
        f"{param}: the server runs with --responses-store off, so nothing is stored; "
        "restart it with --responses-store memory or disk",
        param=param,
        code="store_disabled",
    )


def check_metadata(meta: Any, param: str = "metadata") -> dict[str, str]:
    """``meta`` checked as OpenAI's ``metadata`` (at most 16 string pairs, keys of at most
    64 characters, values of at most 512); None is ``{}``.

    Raises:
        APIError: 400 naming ``param`` (or the key) for anything else.
    """
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise APIError(400, f"{param}: must be an object of string pairs", param=param)
    if len(meta) > METADATA_PAIRS:
        raise APIError(
            400, f"{param}: at most {METADATA_PAIRS} pairs, got {len(meta)}", param=param
        )
    for k, v in meta.items():
        if len(k) > METADATA_KEY_CHARS:
            raise APIError(
                400, f"{param}: key longer than {METADATA_KEY_CHARS} characters", param=param
            )
        if not isinstance(v, str) or len(v) > METADATA_VALUE_CHARS:
            raise APIError(
                400,
                f"{param}.{k}: must be a string of at most {METADATA_VALUE_CHARS} characters",
                param=f"{param}.{k}",
            )
    return dict(meta)


def encoded(record: dict) -> bytes:
    """The bytes a record takes in the store (its compact JSON)."""
    return json.dumps(record, separators=(",", ":")).encode("utf-8")


class JsonStore:
    """Records by id, owned, bounded in count and bytes (oldest evicted first).

    Args:
        kind: what the records are, for messages ("response", "conversation").
        max_items: most records kept.
        max_bytes: most bytes all records take (their JSON).
        max_object_bytes: most bytes one record may take.
        directory: where records are kept across restarts (None: memory only).

    Methods take worker-thread time with a directory (file IO): call them off the event
    loop there (:meth:`run`).
    """

    def __init__(
        self,
        kind: str,
        max_items: int,
        max_bytes: int,
        max_object_bytes: int,
        directory: Path | None = None,
    ) -> None:
        self.kind = kind
        self.max_items, self.max_bytes, self.max_object_bytes = (
            max_items,
            max_bytes,
            max_object_bytes,
        )
        self.directory = directory
        self._lock = threading.Lock()  # the index and the byte count
        self._ids = IdLocks()
        # id -> (owner, size), oldest first
        self._index: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._mem: dict[str, bytes] = {}
        self._bytes = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._load()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, in a worker thread when the store has files (else inline)."""
        if self.directory is None:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def check_size(self, size: int, param: str) -> None:
        """Raises APIError 400 naming ``param`` when a record of ``size`` bytes would
        exceed the per-object bound."""
        if size > self.max_object_bytes:
            raise APIError(
                400,
                f"{param}: the stored {self.kind} would take {size} bytes, over the "
                f"server's bound of {self.max_object_bytes} (--max-stored-object-bytes); "
                "send less, or start a new one",
                param=param,
                code="stored_object_too_large",
            )

    def get(self, owner: str, ident: str) -> dict | None:
        """The record ``ident`` if ``owner`` owns it, else None."""
        with self._lock:
            entry = self._index.get(ident)
            data = self._mem.get(ident)
        if entry is None or entry[0] != owner:
            return None
        if data is None and self.directory is not None:
            try:
                data = self._path(ident).read_bytes()
            except FileNotFoundError:  # deleted meanwhile
                return None
        return json.loads(data) if data is not None else None

    def put(self, record: dict, param: str | None = None) -> None:
        """Store ``record`` (new or replacing its id), evicting the oldest others beyond
        the bounds; with ``param`` the per-object bound is checked first.

        Raises:
            APIError: 400 naming ``param`` for a record over the per-object bound.
        """
        data = encoded(record)
        if param is not None:
            self.check_size(len(data), param)
        ident = record["id"]
        evicted: list[str] = []
        with self._ids.hold(ident):
            if self.directory is not None:
                write_bytes_atomic(self._path(ident), data)
            with self._lock:
                old = self._index.pop(ident, None)
                self._bytes -= old[1] if old else 0
                self._index[ident] = (record["owner"], len(data))
                self._bytes += len(data)
                if self.directory is None:
                    self._mem[ident] = data
                while len(self._index) > 1 and (
                    len(self._index) > self.max_items or self._bytes > self.max_bytes
                ):
                    oldest = next(iter(self._index))
                    if oldest == ident:
                        break
                    self._bytes -= self._index.pop(oldest)[1]
                    self._mem.pop(oldest, None)
                    evicted.append(oldest)
        for old_id in evicted:  # in their own sections, never two at once
            log.info("%s store full: evicted %s (oldest first)", self.kind, old_id)
            if self.directory is not None:
                with self._ids.hold(old_id):
                    if old_id not in self._index:
                        unlink_durably(self._path(old_id))

    def update(self, owner: str, ident: str, change: Callable[[dict], dict | None]) -> dict | None:
        """Read, ``change`` and write back record ``ident`` in its section (``change``
        returns the new record, or None to leave it); None when ``owner`` has no such
        record."""
        with self._ids.hold(ident):
            record = self.get(owner, ident)
            if record is None:
                return None
            new = change(record)
            if new is not None:
                self.put(new)
                return new
            return record

    def delete(self, owner: str, ident: str) -> bool:
        """Remove record ``ident`` if ``owner`` owns it; whether it did."""
        with self._ids.hold(ident):
            with self._lock:
                entry = self._index.get(ident)
                if entry is None or entry[0] != owner:
                    return False
                del self._index[ident]
                self._bytes -= entry[1]
                self._mem.pop(ident, None)
            if self.directory is not None:  # unlisted first, so never listed without it
                unlink_durably(self._path(ident))
        return True

    def records(self) -> Iterator[dict]:
        """Every record (any owner), oldest first."""
        with self._lock:
            ids = list(self._index)
        for ident in ids:
            owner = self._index.get(ident, (None, 0))[0]
            if owner is not None:
                record = self.get(owner, ident)
                if record is not None:
                    yield record

    def __len__(self) -> int:
        return len(self._index)

    @property
    def total_bytes(self) -> int:
        """Bytes all records take."""
        return self._bytes

    def _path(self, ident: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{ident}.json"

    def _load(self) -> None:
        """Index the records on disk (oldest first by modification time); unreadable
        files are logged and skipped."""
        assert self.directory is not None
        for tmp in self.directory.glob(".*.tmp"):  # writes cut short
            tmp.unlink(missing_ok=True)
        files = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                data = path.read_bytes()
                record = json.loads(data)
                self._index[record["id"]] = (record["owner"], len(data))
                self._bytes += len(data)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("%s store: skipping unreadable %s: %s", self.kind, path, e)


def paginate(
    items: list[dict], after: str | None, limit: int, order: str, param: str = "after"
) -> dict:
    """One page of ``items`` (oldest first) as OpenAI lists them: ``order`` ``asc`` or
    ``desc``, the ``limit`` items after the item ``after`` in that order, with
    ``first_id``, ``last_id`` and ``has_more``.

    Raises:
        APIError: 400 naming ``limit`` (outside 1..100), ``order`` or ``after`` (no such
            item).
    """
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit: must be between 1 and 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: must be asc or desc, got {order!r}", param="order")
    seq = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [it.get("id") for it in seq]
        if after not in ids:
            raise APIError(400, f"{param}: no item {after!r} in this list", param=param)
        start = ids.index(after) + 1
    page = seq[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(seq),
    }
