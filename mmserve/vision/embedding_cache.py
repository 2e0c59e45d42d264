"""LRU cache of projected vision embeddings keyed by image key."""

from __future__ import annotations

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
        self._store.put(key, feats)

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
