"""A bounded least-recently-used map: the one LRU of the server's caches and stores.

Imports nothing of mmserve (and no torch), so any layer may use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from enum import Enum
from typing import Final, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Missing(Enum):
    """An absent key's value: an enum member, so ``is _MISSING`` narrows the type."""

    MISSING = 0


_MISSING: Final = _Missing.MISSING


class LRU(Generic[K, V]):
    """A map bounded by entry count and/or bytes; the least recently used entries go first.

    Thread-safe: every method holds the map's own lock (callers that combine several
    calls into one step hold a lock of their own around them).

    Args:
        max_items: most entries kept (None: no count bound).
        max_bytes: most bytes kept, as ``size`` measures values (None: no byte bound).
        size: bytes of one value (needed with ``max_bytes``; default: every value is 0).
        keep_newest: when True the entry just put is never evicted, even if it alone
            exceeds a bound (a store still serves an upload larger than its bound until
            the next one comes); when False a value larger than ``max_bytes`` is not
            stored at all and the map is left as it was.

    Attributes:
        hits, misses: lookups by :meth:`get` (with ``count=True``) that found / did not
            find their key.
    """

    def __init__(
        self,
        max_items: int | None = None,
        max_bytes: int | None = None,
        size: Callable[[V], int] | None = None,
        keep_newest: bool = False,
    ) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.keep_newest = keep_newest
        self._size = size or (lambda _v: 0)
        self._data: OrderedDict[K, V] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(
        self, key: K, default: V | None = None, *, touch: bool = True, count: bool = True
    ) -> V | None:
        """The value of ``key``, or ``default``.

        Args:
            touch: mark a found entry most recently used.
            count: count the lookup in :attr:`hits` / :attr:`misses`.
        """
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                self.misses += count
                return default
            self.hits += count
            if touch:
                self._data.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Keep ``value`` under ``key`` as the most recently used entry (replacing an old
        value); returns the ``(key, value)`` pairs evicted to stay within the bounds,
        least recently used first."""
        nbytes = self._size(value)
        with self._lock:
            if not self.keep_newest and self.max_bytes is not None and nbytes > self.max_bytes:
                return []
            old = self._data.pop(key, _MISSING)
            if old is not _MISSING:
                self._nbytes -= self._size(old)
            self._data[key] = value
            self._nbytes += nbytes
            evicted = []
            while self._over() and (len(self._data) > 1 or not self.keep_newest):
                gone = self._data.popitem(last=False)
                self._nbytes -= self._size(gone[1])
                evicted.append(gone)
            return evicted

    def _over(self) -> bool:
        return (self.max_items is not None and len(self._data) > self.max_items) or (
            self.max_bytes is not None and self._nbytes > self.max_bytes
        )

    def touch(self, key: K) -> bool:
        """Mark ``key`` most recently used; returns whether it is held."""
        with self._lock:
            if key not in self._data:
                return False
            self._data.move_to_end(key)
            return True

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove ``key``; its value, or ``default`` when it was not held."""
        with self._lock:
            value = self._data.pop(key, _MISSING)
            if value is _MISSING:
                return default
            self._nbytes -= self._size(value)
            return value

    def evict(
        self, max_items: int | None = None, max_bytes: int | None = None
    ) -> list[tuple[K, V]]:
        """Drop least recently used entries until at most ``max_items`` entries and
        ``max_bytes`` bytes remain (None: the map's own bound); returns them."""
        items = self.max_items if max_items is None else max_items
        limit = self.max_bytes if max_bytes is None else max_bytes
        with self._lock:
            evicted = []
            while self._data and (
                (items is not None and len(self._data) > items)
                or (limit is not None and self._nbytes > limit)
            ):
                gone = self._data.popitem(last=False)
                self._nbytes -= self._size(gone[1])
                evicted.append(gone)
            return evicted

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        with self._lock:
            self._data.clear()
            self._nbytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held, as ``size`` measures them."""
        return self._nbytes

    def keys(self) -> list[K]:
        """Keys, least recently used first (a copy)."""
        with self._lock:
            return list(self._data)

    def values(self) -> list[V]:
        """Values, least recently used first (a copy)."""
        with self._lock:
            return list(self._data.values())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        return len(self._data)
