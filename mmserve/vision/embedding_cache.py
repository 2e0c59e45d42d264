"""LRU cache of projected vision embeddings keyed by image key, and the mirror of its
keys another process keeps (:class:`FeatureKeys`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import torch

from mmserve.lru import LRU


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class EmbeddingCache:
    """Maps a 16-byte image key to its ``[num_image_tokens, hidden]`` projected features.

    Bounded in bytes, since an image's run length depends on the model family and
    the image's size. The engine thread reads and writes it; the front end's threads
    only :meth:`peek` (the LRU's lock makes each call atomic).

    Args:
        capacity_bytes: most tensor bytes kept (0 disables the cache).
    """

    def __init__(self, capacity_bytes: int = 256 << 20) -> None:
        self.capacity_bytes = capacity_bytes
        self._store: LRU[bytes, torch.Tensor] = LRU(max_bytes=capacity_bytes, size=_tensor_bytes)
        self._recording = False
        self._lock = threading.Lock()
        self._added: dict[bytes, None] = {}  # insertion-ordered set
        self._dropped: set[bytes] = set()
        self._cleared = False

    def record_changes(self) -> None:
        """From now on remember which keys come (put) and go (evicted, cleared), for
        :meth:`take_changes` (the engine process reports them to the API process's
        :class:`FeatureKeys`)."""
        self._recording = True

    def take_changes(self) -> tuple[list[bytes], list[bytes], bool] | None:
        """The changes since the last call as ``(added, dropped, cleared)``, or None when
        there were none. Applied to the keys held at the last call by
        :meth:`FeatureKeys.apply` (clear if ``cleared``, drop ``dropped``, add ``added``)
        they give the keys held now: a key that came and went since is in the one list
        that says how it ended."""
        if not self._recording or not (self._added or self._dropped or self._cleared):
            return None
        with self._lock:
            out = (list(self._added), list(self._dropped), self._cleared)
            self._added, self._dropped, self._cleared = {}, set(), False
        return out

    def peek(self, key: bytes) -> torch.Tensor | None:
        """The cached features for ``key`` or None, without counting a hit or a miss
        (the front end asks whether an image's tower input is needed at all); a found
        entry becomes the most recently used."""
        return self._store.get(key, count=False)

    def get(self, key: bytes) -> torch.Tensor | None:
        """The cached features for ``key`` or None; counts a hit or a miss."""
        return self._store.get(key)

    def put(self, key: bytes, feats: torch.Tensor) -> None:
        """Insert features, evicting the least recently used entries past capacity
        (features larger than the whole capacity are not kept)."""
        evicted = self._store.put(key, feats)
        if self._recording:
            with self._lock:
                for gone, _ in evicted:
                    self._added.pop(gone, None)
                    self._dropped.add(gone)
                if key in self._store:
                    self._dropped.discard(key)
                    self._added[key] = None

    @property
    def hits(self) -> int:
        """Lookups by :meth:`get` that found their key."""
        return self._store.hits

    @property
    def misses(self) -> int:
        """Lookups by :meth:`get` that did not."""
        return self._store.misses

    @property
    def nbytes(self) -> int:
        """Tensor bytes held now."""
        return self._store.nbytes

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is cached (counts nothing, changes no order)."""
        return key in self._store

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Drop every entry."""
        self._store.clear()
        if self._recording:
            with self._lock:
                self._added, self._dropped, self._cleared = {}, set(), True


class FeatureKeys:
    """The keys whose features an :class:`EmbeddingCache` in another process holds, as
    its :meth:`~EmbeddingCache.take_changes` reported them: the API process's mirror of
    the engine process's cache. The front end asks it whether an image's tower input is
    needed at all; an image it names goes to the engine by key only. The mirror may lag
    (a key evicted there since): the engine then answers a miss for that request, and the
    front end sends the pixels.

    Membership tests are safe from any thread; :meth:`apply` runs on one (the event loop).
    """

    def __init__(self) -> None:
        self._keys: set[bytes] = set()

    def apply(self, added: Iterable[bytes], dropped: Iterable[bytes], cleared: bool) -> None:
        """Take in one :meth:`EmbeddingCache.take_changes` record."""
        if cleared:
            self._keys = set()
        self._keys.difference_update(dropped)
        self._keys.update(added)

    def discard(self, keys: Iterable[bytes]) -> None:
        """Forget ``keys`` (the engine said it no longer holds them)."""
        self._keys.difference_update(keys)

    def clear(self) -> None:
        """Forget every key (a new engine process: an empty cache)."""
        self._keys = set()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._keys))

    def __len__(self) -> int:
        return len(self._keys)
