"""An approximate radix tree of the token sequences recently sent to one replica.

The cache router (:mod:`mmserve.fleet.router`) keeps one per replica: what the
replica's own radix cache probably holds, without asking it. Token ids are text
ids and image pseudo-ids (content hashes, the same on every replica), so a
question about an image matches the replica that saw that image. Matching is
read-only (it refreshes nothing: only the replica a request is sent to gets
fresher); inserting refreshes the path; past ``max_tokens`` the least recently
used leaves are trimmed until 90 % of it is left.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

_BLOCK = 64


class _Node:
    __slots__ = ("children", "parent", "key", "last", "uid")

    def __init__(self, key: list[int], parent: _Node | None, last: int, uid: int) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key
        self.last = last
        self.uid = uid


def _common(key: list[int], ids: list[int], i: int) -> int:
    """Length of the common prefix of ``key`` and ``ids[i:]``."""
    n = min(len(key), len(ids) - i)
    if ids[i : i + n] == key[:n]:
        return n
    j = 0
    while j + _BLOCK <= n and ids[i + j : i + j + _BLOCK] == key[j : j + _BLOCK]:
        j += _BLOCK
    while j < n and ids[i + j] == key[j]:
        j += 1
    return j


class PrefixTree:
    """Token-level radix tree with LRU trimming.

    Args:
        max_tokens: most tokens kept (>= 1); an insert beyond it trims the least
            recently used leaves down to 90 % of it.

    Attributes:
        size: tokens stored (edge lengths summed).
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._uids = itertools.count()
        self.root = _Node([], None, 0, next(self._uids))
        self.size = 0
        self._clock = 0

    def match(self, ids: Sequence[int]) -> int:
        """Tokens of the longest prefix of ``ids`` in the tree (changes nothing)."""
        ids = list(ids)
        node, i, n = self.root, 0, len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            m = _common(child.key, ids, i)
            i += m
            if m < len(child.key):
                break
            node = child
        return i

    def insert(self, ids: Sequence[int]) -> int:
        """Add ``ids`` (refreshing its path) and trim if over ``max_tokens``.

        Returns:
            Tokens of ``ids`` that were already in the tree.
        """
        ids = list(ids)
        self._clock += 1
        now = self._clock
        node, i, n = self.root, 0, len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                node.children[ids[i]] = _Node(ids[i:], node, now, next(self._uids))
                self.size += n - i
                break
            m = _common(child.key, ids, i)
            if m < len(child.key):
                child = self._split(child, m)
            child.last = now
            node = child
            i += m
        known = min(i, n)
        if self.size > self.max_tokens:
            self.trim(self.max_tokens * 9 // 10)
        return known

    def _split(self, child: _Node, m: int) -> _Node:
        parent = child.parent
        assert parent is not None
        mid = _Node(child.key[:m], parent, child.last, next(self._uids))
        parent.children[mid.key[0]] = mid
        child.key = child.key[m:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    def trim(self, target: int) -> int:
        """Remove least recently used leaves until at most ``target`` tokens remain.

        Returns:
            Tokens removed.
        """
        heap = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                heap.append((node.last, node.uid, node))
        heapq.heapify(heap)
        removed = 0
        while self.size > target and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            self.size -= len(node.key)
            removed += len(node.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, parent.uid, parent))
        return removed

    def clear(self) -> None:
        """Drop everything (the replica's cache was flushed)."""
        self.root.children = {}
        self.size = 0

    def node_count(self) -> int:
        """Nodes, the root excluded."""
        count, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count
