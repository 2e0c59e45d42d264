"""Free-list allocator for KV-cache page ids.

A page holds the K/V of ``page_size`` consecutive tokens; this module only tracks which page ids
``0..num_pages-1`` are free. Pages that are not free are owned either by the radix tree
(:class:`~mmserve.cache.radix_cache.RadixCache`) or by a running request.
"""

from __future__ import annotations

from collections.abc import Iterable


class PageAllocator:
    """Free-list of KV page ids ``0..num_pages-1``.

    ``alloc`` and ``free`` cost O(n) in the number of pages moved. A per-page flag catches double
    frees, so every page must be freed exactly once per allocation.

    Args:
        num_pages: total pages managed (>= 0).

    Raises:
        ValueError: if ``num_pages`` is negative.
    """

    __slots__ = ("num_pages", "_stack", "_is_free")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._stack: list[int] = []
        self._is_free = bytearray()
        self.reset()

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free pages.

        Args:
            n: number of pages (>= 0).

        Returns:
            ``n`` distinct page ids, or ``None`` (nothing taken) if fewer than ``n`` pages are free.
            ``n == 0`` returns ``[]``.

        Raises:
            ValueError: if ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        stack = self._stack
        if n > len(stack):
            return None
        if n == 0:
            return []
        out = stack[-n:]
        del stack[-n:]
        # The stack is popped from its end; reversing hands out ascending ids from a fresh pool.
        out.reverse()
        flags = self._is_free
        for p in out:
            flags[p] = 0
        return out

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list.

        All-or-nothing: if any page is invalid, no page is freed.

        Args:
            pages: page ids currently allocated (ints, or a tensor/array of ints).

        Raises:
            ValueError: if a page id is out of ``[0, num_pages)``, is already free, or appears
                twice in ``pages``.
        """
        tolist = getattr(pages, "tolist", None)
        ids: list[int] = tolist() if tolist is not None else list(pages)
        flags = self._is_free
        n = self.num_pages
        for k, p in enumerate(ids):
            if not 0 <= p < n or flags[p]:
                for q in ids[:k]:  # roll back so a failed call frees nothing
                    flags[q] = 0
                what = "out of range" if not 0 <= p < n else "double free"
                raise ValueError(f"cannot free page {p}: {what} (num_pages={n})")
            flags[p] = 1
        self._stack.extend(ids)

    @property
    def num_free(self) -> int:
        """Number of free pages."""
        return len(self._stack)

    def reset(self) -> None:
        """Mark every page free again (forgets all outstanding allocations)."""
        self._stack = list(range(self.num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * self.num_pages
