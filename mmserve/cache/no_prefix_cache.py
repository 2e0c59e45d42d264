"""The prefix cache when reuse is off (``EngineConfig.disable_radix_cache``).

:class:`NoPrefixCache` has :class:`~mmserve.cache.radix_cache.RadixCache`'s interface and
holds nothing: every match is empty, an insert keeps no page, nothing is evictable and
locks are no-ops. The scheduler is written once, against that interface, and the engine
picks this cache once when the radix cache is disabled, instead of a branch per call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from mmserve.cache.radix_cache import (
    InsertResult,
    MatchResult,
    RadixCache,
    TreeNode,
    check_insert,
)


class NoPrefixCache:
    """A prefix cache that stores nothing, behind the radix cache's interface.

    Args:
        page_size: tokens per KV page (>= 1).
        free_pages: callback receiving page ids :meth:`insert` releases (e.g.
            ``PageAllocator.free``).
        root_key: the chain key "before" the first page (no tiers use it; kept for
            :meth:`last_page_key`).

    Raises:
        ValueError: if ``page_size < 1``.
    """

    #: nothing inserted is ever matched: cache-aware orders and the wait for another
    #: request's prefill (to hit the tree after it) have nothing to gain
    reuses_prefixes = False

    def __init__(
        self, page_size: int, free_pages: Callable[[list[int]], None], root_key: bytes = b""
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root_key = root_key
        self._free_pages = free_pages
        self.root = TreeNode([], [], None, 0, 0)

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """No cached prefix: ``(0, [], root)`` for any ``key``."""
        return MatchResult(0, [], self.root)

    def insert(self, key: Sequence[int], pages: Sequence[int]) -> int:
        """Take ``pages`` and release them at once through ``free_pages``; returns 0 (no
        token of ``key`` was cached).

        Raises:
            ValueError: if ``len(key)`` is not a multiple of ``page_size`` or
                ``len(pages) != len(key) // page_size``.
        """
        check_insert(key, pages, self.page_size)
        if len(pages):
            self._free_pages(list(pages))
        return 0

    def insert_prefix(self, key: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Keep nothing: ``(0, 0, [], root)``; the caller keeps (and later frees) every page.

        Raises:
            ValueError: as :meth:`insert`.
        """
        check_insert(key, pages, self.page_size)
        return InsertResult(0, 0, [], self.root)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """No-op: nothing to pin."""

    def dec_lock_ref(self, node: TreeNode) -> None:
        """No-op: nothing was pinned."""

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict; returns 0 tokens."""
        return 0

    def page_keys(self, node: TreeNode) -> list[bytes]:
        """No pages, no keys: ``[]``."""
        return []

    def last_page_key(self, node: TreeNode) -> bytes:
        """``root_key``: every node is the root."""
        return self.root_key

    def iter_pages(self) -> Iterator[tuple[list[bytes], list[int]]]:
        """Nothing to flush: an empty iterator."""
        return iter(())

    def evictable_size(self) -> int:
        """0 tokens."""
        return 0

    def protected_size(self) -> int:
        """0 tokens."""
        return 0

    def total_size(self) -> int:
        """0 tokens."""
        return 0

    def num_pages(self) -> int:
        """0 pages."""
        return 0

    def node_count(self) -> int:
        """0 nodes."""
        return 0

    def reset(self) -> None:
        """Nothing to drop."""


#: Either prefix cache; the scheduler and the engine use only the shared interface.
PrefixCache = RadixCache | NoPrefixCache
