"""LRU cache of projected vision embeddings keyed by image key."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class EmbeddingCache:
    """Maps a 16-byte image key to its ``[num_image_tokens, hidden]`` projected features.

    Bounded in bytes, since an image's run length depends on the model family and
    the image's size. The engine thread reads and writes it; the front end's threads
    only :meth:`peek` (under the same lock).

    Args:
        capacity_bytes: most tensor bytes kept (0 disables the cache).

    Attributes:
        hits, misses: lookup counters since construction.
        nbytes: bytes held now.
    """

    def __init__(self, capacity_bytes: int = 256 << 20) -> None:
        self.capacity_bytes = capacity_bytes
        self._store: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.nbytes = 0
        self._lock = threading.Lock()

    def peek(self, key: bytes) -> torch.Tensor | None:
        """The cached features for ``key`` or None, without counting a hit or a miss
        (the front end asks whether an image's tower input is needed at all); a found
        entry becomes the most recently used."""
        with self._lock:
            feats = self._store.get(key)
            if feats is not None:
                self._store.move_to_end(key)
            return feats

    def get(self, key: bytes) -> torch.Tensor | None:
        """The cached features for ``key`` or None; counts a hit or a miss."""
        with self._lock:
            feats = self._store.get(key)
            if feats is None:
                self.misses += 1
                return None
            self._store.move_to_end(key)
            self.hits += 1
            return feats

    def put(self, key: bytes, feats: torch.Tensor) -> None:
        """Insert features, evicting the least recently used entries past capacity."""
        size = feats.numel() * feats.element_size()
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._store.pop(key, None)
            if old is not None:
                self.nbytes -= old.numel() * old.element_size()
            self._store[key] = feats
            self.nbytes += size
            while self.nbytes > self.capacity_bytes:
                _, gone = self._store.popitem(last=False)
                self.nbytes -= gone.numel() * gone.element_size()

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is cached (counts nothing, changes no order)."""
        with self._lock:
            return key in self._store

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._store.clear()
            self.nbytes = 0
