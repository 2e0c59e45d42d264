"""Paged radix-tree prefix cache (RadixAttention).

Implements the KV-cache radix tree of Zheng et al., "SGLang: Efficient Execution of Structured
Language Model Programs" (arXiv 2312.07104), Section 3 and Figure 3: edges are labelled with token
sequences, each node owns the KV pages of its edge, prefixes are shared between requests, and
unreferenced leaves are evicted in LRU order.

The KV cache is paged (``page_size`` tokens per page, written ``P`` below) and only full pages
enter the tree: every edge length is a multiple of ``P`` and matching compares whole pages. With
``P == 1`` this is the classic token-level radix tree. Tokens are arbitrary hashable ints (text ids
are >= 0, hashed image pseudo-tokens are negative int64).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Tokens compared per slice when scanning for a mismatch inside an edge: one C-level slice compare
# per block, then a short page-by-page scan inside the mismatching block.
_SCAN_BLOCK_TOKENS = 64


class TreeNode:
    """One node of the radix tree; its edge from ``parent`` is labelled ``key``.

    Attributes:
        children: child nodes keyed by the first page of their edge (a tuple of ``P`` tokens, or
            the token int itself when ``P == 1``).
        parent: parent node; ``None`` for the root and for nodes removed from the tree.
        key: edge tokens (length a positive multiple of ``P``; empty only for the root).
        pages: page ids holding the KV of ``key`` (``len(key) // P`` of them, in order).
        lock_ref: number of live references (requests) pinning this node; > 0 blocks eviction.
        last_access: time of the last match/insert through this node (LRU key).
        uid: creation order, the LRU tie-breaker.
        in_heap: whether an eviction-heap entry for this node exists.
        hkeys: content keys of ``pages`` (:class:`~mmserve.cache.kv_tiers.PageKeyChain`),
            computed on first need when the tree has tiers; None until then.
    """

    __slots__ = (
        "children",
        "parent",
        "key",
        "pages",
        "lock_ref",
        "last_access",
        "uid",
        "in_heap",
        "hkeys",
    )

    def __init__(
        self,
        key: list[int],
        pages: list[int],
        parent: TreeNode | None,
        last_access: float,
        uid: int,
    ) -> None:
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = last_access
        self.uid = uid
        self.in_heap = False
        self.hkeys: list[bytes] | None = None

    def __repr__(self) -> str:
        return (
            f"TreeNode(uid={self.uid}, tokens={len(self.key)}, pages={len(self.pages)}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access}, "
            f"children={len(self.children)})"
        )


@dataclass
class MatchResult:
    """Result of :meth:`RadixCache.match_prefix`.

    Attributes:
        length: matched tokens, a multiple of ``page_size``.
        pages: the ``length // page_size`` page ids holding the matched KV, in order.
        last_node: deepest node covering exactly the match (the root if nothing matched); pass it
            to :meth:`RadixCache.inc_lock_ref` / :meth:`RadixCache.dec_lock_ref`.
    """

    length: int
    pages: list[int]
    last_node: TreeNode


@dataclass
class InsertResult:
    """Result of :meth:`RadixCache.insert_prefix`: where the inserted key ends in the tree.

    Attributes:
        cached: leading tokens of the key the tree held before the call (a multiple of
            ``page_size``); the caller's pages for them duplicate the tree's: it frees them.
        length: tokens of the key the tree holds after the call (the whole key; 0 when the
            cache stores nothing, and the caller keeps every page).
        pages: the tree's ``length // page_size`` page ids for those tokens, in order.
        last_node: the node ending exactly at ``length`` (the root when it is 0); pass it to
            :meth:`RadixCache.inc_lock_ref` / :meth:`RadixCache.dec_lock_ref`.
    """

    cached: int
    length: int
    pages: list[int]
    last_node: TreeNode


def check_insert(key: Sequence[int], pages: Sequence[int], page_size: int) -> None:
    """Check the arguments of an insert: whole pages, one page id per page.

    Raises:
        ValueError: if ``len(key)`` is not a multiple of ``page_size`` or
            ``len(pages) != len(key) // page_size``.
    """
    n = len(key)
    if n % page_size:
        raise ValueError(f"key length {n} is not a multiple of page_size {page_size}")
    if len(pages) != n // page_size:
        raise ValueError(f"got {len(pages)} pages for {n} tokens (page_size {page_size})")


def _as_list(seq: Sequence[int]) -> list[int]:
    """``seq`` as a list of Python ints (slices of lists and tuples never compare equal)."""
    if type(seq) is list:
        return seq
    tolist = getattr(seq, "tolist", None)  # numpy arrays / torch tensors -> Python ints
    return tolist() if tolist is not None else list(seq)


class RadixCache:
    """Radix tree over token sequences mapping cached prefixes to KV pages.

    SGLang paper (arXiv 2312.07104) Section 3, Figure 3: a request's prompt is matched against the
    tree to reuse the longest cached prefix; on completion its tokens are inserted so later requests
    can share them; nodes referenced by running requests are locked (``lock_ref > 0``); under
    memory pressure unlocked leaves are evicted least-recently-used first, leaf before parent.

    Ownership: pages stored in the tree belong to it and are released only through ``free_pages``
    (on :meth:`evict` and :meth:`reset`). Sizes are tracked in O(1).

    Args:
        page_size: tokens per KV page ``P`` (>= 1).
        free_pages: callback receiving a list of page ids the tree releases (e.g.
            ``PageAllocator.free``).
        clock: time source for LRU; must be non-decreasing. Defaults to an internal integer
            counter incremented once per :meth:`match_prefix` / :meth:`insert` (deterministic).
        page_hasher: ``(parent_key, tokens) -> keys`` giving the content keys of the full
            pages of ``tokens`` after the page keyed ``parent_key``
            (:meth:`~mmserve.cache.kv_tiers.PageKeyChain.chain`); None when there are no tiers.
        root_key: the chain key "before" the first page (``PageKeyChain.root``).
        on_evict: ``(keys, pages)`` called by :meth:`evict` with the evicted pages and their
            content keys before the pages are freed (the tiers copy them out); needs
            ``page_hasher``. An exception in it is logged; eviction goes on.

    Raises:
        ValueError: if ``page_size < 1``.
    """

    #: what :meth:`insert` keeps can be matched later (the scheduler's cache-aware
    #: orders rely on it; :class:`~mmserve.cache.no_prefix_cache.NoPrefixCache` says False)
    reuses_prefixes = True

    def __init__(
        self,
        page_size: int,
        free_pages: Callable[[list[int]], None],
        clock: Callable[[], float] | None = None,
        page_hasher: Callable[[bytes, list[int]], list[bytes]] | None = None,
        root_key: bytes = b"",
        on_evict: Callable[[list[bytes], list[int]], None] | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._free_pages = free_pages
        self._clock = clock
        self._hasher = page_hasher
        self.root_key = root_key
        self._on_evict = on_evict if page_hasher is not None else None
        self._counter = 0
        self._uids = itertools.count()
        self._block = page_size * max(1, _SCAN_BLOCK_TOKENS // page_size)
        # The root object survives reset so that root "locks" (empty matches) stay valid.
        self.root = TreeNode([], [], None, 0, next(self._uids))
        self._init_tree()

    def _init_tree(self) -> None:
        self.root.children = {}
        self._evictable = 0
        self._protected = 0
        self._node_count = 0
        # Lazy LRU heap of (last_access at push time, uid, node), at most one entry per node.
        # Pushed times are lower bounds of the true ones (time only grows), so a popped entry whose
        # time is current is the true LRU leaf; stale ones are re-pushed (see evict).
        self._heap: list[tuple[float, int, TreeNode]] = []

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        self._counter += 1
        return self._counter

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.uid, node))
        node.in_heap = True

    def _edge_key(self, key: list[int], i: int) -> Hashable:
        """Children-dict key for the page of ``key`` starting at token ``i``."""
        return key[i] if self.page_size == 1 else tuple(key[i : i + self.page_size])

    def _common_len(self, key: list[int], i: int, end: int, edge: list[int]) -> int:
        """Tokens (multiple of P) shared by ``key[i:end]`` and ``edge``; their first pages match."""
        n_edge = len(edge)
        if end - i >= n_edge:
            if key[i : i + n_edge] == edge:  # fast path: whole edge matches
                return n_edge
            n = n_edge
        else:
            n = end - i
            if key[i:end] == edge[:n]:
                return n
        P = self.page_size
        blk = self._block
        j = P
        while j + blk <= n and key[i + j : i + j + blk] == edge[j : j + blk]:
            j += blk
        if P == 1:
            while j < n and key[i + j] == edge[j]:
                j += 1
        else:
            while j < n and key[i + j : i + j + P] == edge[j : j + P]:
                j += P
        return j

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child``'s edge after ``m`` tokens (0 < m < len, multiple of P); return the
        new upper node, which takes ``child``'s place under its parent."""
        P = self.page_size
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            child.key[:m], child.pages[: m // P], parent, child.last_access, next(self._uids)
        )
        # Same lock count on both halves keeps evictable/protected sizes unchanged.
        upper.lock_ref = child.lock_ref
        if child.hkeys is not None:
            upper.hkeys = child.hkeys[: m // P]
            child.hkeys = child.hkeys[m // P :]
        child.key = child.key[m:]
        child.pages = child.pages[m // P :]
        child.parent = upper
        upper.children[self._edge_key(child.key, 0)] = child
        parent.children[self._edge_key(upper.key, 0)] = upper
        self._node_count += 1
        return upper

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Find the longest cached page-aligned prefix of ``key``.

        Only whole pages count: a trailing partial page of ``key`` and a partially matching page are
        ignored. If the match ends inside an edge (at a page boundary) that node is split so that
        ``last_node`` covers exactly the match. Refreshes the LRU time of every matched node
        (SGLang paper Section 3).

        Args:
            key: token ids (any length).

        Returns:
            MatchResult with ``length`` in tokens (multiple of ``page_size``), its
            ``length // page_size`` pages, and ``last_node``.
        """
        root = self.root
        P = self.page_size
        pages: list[int] = []
        if len(key) < P:
            return MatchResult(0, pages, root)
        key = _as_list(key)
        end = len(key) - len(key) % P
        now = self._now()
        node = root
        i = 0
        while i < end:
            child = node.children.get(key[i] if P == 1 else tuple(key[i : i + P]))
            if child is None:
                break
            m = self._common_len(key, i, end, child.key)
            partial = m < len(child.key)
            if partial:
                child = self._split(child, m)
            child.last_access = now
            pages += child.pages
            node = child
            i += m
            if partial:  # key ended or the next page differs
                break
        return MatchResult(i, pages, node)

    def insert(self, key: Sequence[int], pages: Sequence[int]) -> int:
        """Cache ``key`` whose KV lives in ``pages`` (SGLang paper Section 3, Figure 3).

        Splits nodes where ``key`` diverges from an edge and adds one leaf for the new suffix.
        Refreshes the LRU time of every node on the path.

        Args:
            key: token ids, length a multiple of ``page_size``.
            pages: ``len(key) // page_size`` page ids holding the KV of ``key``, in order.

        Returns:
            Number of leading tokens of ``key`` already cached before this call (a multiple of
            ``page_size``). The tree takes ownership of ``pages[returned // page_size:]``; the
            caller keeps ``pages[:returned // page_size]`` (duplicates of tree pages) and should
            free them.

        Raises:
            ValueError: if ``len(key)`` is not a multiple of ``page_size`` or
                ``len(pages) != len(key) // page_size``.
        """
        return self.insert_prefix(key, pages).cached

    def insert_prefix(self, key: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """:meth:`insert`, returning where ``key`` ends in the tree, so that no
        :meth:`match_prefix` has to find it again.

        Args:
            key: token ids, length a multiple of ``page_size``.
            pages: ``len(key) // page_size`` page ids holding the KV of ``key``, in order.

        Returns:
            :class:`InsertResult`: the tree takes ownership of
            ``pages[cached // page_size : length // page_size]``; its ``pages`` replace the
            caller's for the first ``length`` tokens.

        Raises:
            ValueError: as :meth:`insert`.
        """
        check_insert(key, pages, self.page_size)
        P = self.page_size
        n = len(key)
        if n == 0:
            return InsertResult(0, 0, [], self.root)
        key = _as_list(key)
        now = self._now()
        node = self.root
        held: list[int] = []
        i = 0
        while i < n:
            edge_key = key[i] if P == 1 else tuple(key[i : i + P])
            child = node.children.get(edge_key)
            if child is None:
                leaf = TreeNode(key[i:], _as_list(pages)[i // P :], node, now, next(self._uids))
                node.children[edge_key] = leaf
                self._evictable += n - i
                self._node_count += 1
                self._push(leaf)
                return InsertResult(i, n, held + leaf.pages, leaf)
            m = self._common_len(key, i, n, child.key)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            held += child.pages
            node = child
            i += m
        return InsertResult(n, n, held, node)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors (excluding the root) against eviction: +1 ``lock_ref``.

        A no-op for the root. Moves newly locked tokens from evictable to protected size.

        Raises:
            ValueError: if ``node`` is no longer in the tree (evicted or reset).
        """
        root = self.root
        if node is root:
            return
        if node.parent is None:
            raise ValueError("inc_lock_ref on a node that is no longer in the tree")
        delta = 0
        while node is not root:
            if node.lock_ref == 0:
                delta += len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable -= delta
        self._protected += delta

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref`: -1 ``lock_ref`` on ``node`` and its ancestors.

        A no-op for the root. Nodes reaching 0 become evictable again.

        Raises:
            ValueError: if ``node.lock_ref`` is already 0 or ``node`` is no longer in the tree.
        """
        root = self.root
        if node is root:
            return
        if node.parent is None:
            raise ValueError("dec_lock_ref on a node that is no longer in the tree")
        if node.lock_ref <= 0:
            raise ValueError("dec_lock_ref would make lock_ref negative")
        # Ancestors always have lock_ref >= their descendants', so checking `node` suffices.
        delta = 0
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.key)
                if not node.children and not node.in_heap:
                    self._push(node)
            node = node.parent
        self._evictable += delta
        self._protected -= delta

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves in LRU order until ``num_tokens`` tokens are freed.

        SGLang paper Section 3 / Figure 3: leaves with ``lock_ref == 0`` are removed oldest
        ``last_access`` first (ties: older node first); removing a leaf may turn its parent into an
        evictable leaf. Whole nodes are evicted, so more than ``num_tokens`` may be freed. Their
        pages are released with a single ``free_pages`` call. Locked nodes are never evicted.

        Args:
            num_tokens: tokens to free (<= 0 evicts nothing).

        Returns:
            Tokens evicted (a multiple of ``page_size``); less than ``num_tokens`` only if nothing
            evictable remains.
        """
        if num_tokens <= 0:
            return 0
        heap = self._heap
        root = self.root
        P = self.page_size
        freed: list[int] = []
        keys: list[bytes] = []
        evicted = 0
        while evicted < num_tokens and heap:
            t, _, node = heapq.heappop(heap)
            node.in_heap = False
            if node.parent is None or node.children or node.lock_ref:
                continue  # removed, no longer a leaf, or locked; re-pushed when that changes
            if t < node.last_access:  # accessed since pushed: requeue with its real time
                self._push(node)
                continue
            parent = node.parent
            key = node.key
            if self._on_evict is not None:
                keys += self.page_keys(node)
            del parent.children[key[0] if P == 1 else tuple(key[:P])]
            node.parent = None
            freed += node.pages
            evicted += len(key)
            self._node_count -= 1
            if (
                parent is not root
                and not parent.children
                and not parent.lock_ref
                and not parent.in_heap
            ):
                self._push(parent)
        self._evictable -= evicted
        if freed and self._on_evict is not None:
            try:
                self._on_evict(keys, freed)
            except Exception:  # a tier failure must not cost the pool its pages
                log.exception("on_evict failed; %d pages not kept in the tiers", len(freed))
        if freed:
            self._free_pages(freed)
        return evicted

    def page_keys(self, node: TreeNode) -> list[bytes]:
        """Content keys of ``node``'s pages (computed once per node, top-down from the
        nearest ancestor that has them).

        Raises:
            ValueError: if the tree has no ``page_hasher``.
        """
        if self._hasher is None:
            raise ValueError("page_keys needs a tree built with page_hasher")
        if node is self.root:
            return []
        todo: list[TreeNode] = []
        up: TreeNode | None = node
        while up is not self.root and up is not None and up.hkeys is None:
            todo.append(up)
            up = up.parent
        for n in reversed(todo):
            p = n.parent
            if p is None or p is self.root:
                parent_key = self.root_key
            else:
                assert p.hkeys is not None  # where the walk stopped, or set just before
                parent_key = p.hkeys[-1]
            n.hkeys = self._hasher(parent_key, n.key)
        keys = (todo[0] if todo else node).hkeys
        assert keys is not None  # set above, or the walk stopped at once because node has them
        return keys

    def last_page_key(self, node: TreeNode) -> bytes:
        """Content key of the last page covered by ``node`` (``root_key`` for the root)."""
        if node is self.root:
            return self.root_key
        return self.page_keys(node)[-1]

    def iter_pages(self) -> Iterator[tuple[list[bytes], list[int]]]:
        """``(keys, pages)`` of every node, parents before children (for a shutdown flush)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield self.page_keys(node), list(node.pages)
            stack.extend(node.children.values())

    def evictable_size(self) -> int:
        """Tokens in nodes with ``lock_ref == 0`` (O(1))."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in nodes with ``lock_ref > 0`` (O(1))."""
        return self._protected

    def total_size(self) -> int:
        """Tokens stored in the tree (``evictable_size() + protected_size()``)."""
        return self._evictable + self._protected

    def num_pages(self) -> int:
        """Pages owned by the tree (``total_size() // page_size``)."""
        return (self._evictable + self._protected) // self.page_size

    def node_count(self) -> int:
        """Number of nodes, excluding the root."""
        return self._node_count

    def reset(self) -> None:
        """Drop every node and release all tree pages through one ``free_pages`` call.

        Nodes handed out earlier become invalid (lock calls on them raise ValueError), except the
        root, which is kept.

        Raises:
            ValueError: if any node is locked (``protected_size() > 0``); nothing is changed.
        """
        if self._protected:
            raise ValueError(f"reset with {self._protected} locked tokens in the tree")
        freed: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            freed += node.pages
            stack.extend(node.children.values())
            node.parent = None
        self._init_tree()
        if freed:
            self._free_pages(freed)
