"""LRU cache of projected vision embeddings keyed by image key."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EmbeddingCache:
    """Maps a 16-byte image key to its ``[num_image_tokens, hidden]`` projected features.

    Args:
        capacity: most images kept (0 disables the cache).

    Attributes:
        hits, misses: lookup counters since construction.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._store: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        """The cached features for ``key`` or None; counts a hit or a miss."""
        feats = self._store.get(key)
        if feats is None:
            self.misses += 1
            return None
        self._store.move_to_end(key)
        self.hits += 1
        return feats

    def put(self, key: bytes, feats: torch.Tensor) -> None:
        """Insert features, evicting the least recently used entries past capacity."""
        if self.capacity <= 0:
            return
        self._store[key] = feats
        self._store.move_to_end(key)
        while len(self._store) > self.capacity:
            self._store.popitem(last=False)

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Drop every entry."""
        self._store.clear()
