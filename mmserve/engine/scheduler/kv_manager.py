"""The KV manager: the page life cycle of requests over the pool, the prefix cache and
the tiers.

A request's pages are allocated at admission (its cached prefix from the tree, the rest
from the pool, evicting tree leaves for the shortfall), grown by one per decode token,
handed to the tree as they fill (full pages only, locked for the request) and released
at the end (its computed KV stays in the tree, the rest goes back to the pool). With KV
tiers (:mod:`mmserve.cache.kv_tiers`), pages past the device match come from host memory
or disk. Only the scheduler calls this room; it changes no queue.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mmserve.cache.kv_pool import KVPool
from mmserve.cache.kv_tiers import KVTiers, kv_namespace
from mmserve.cache.no_prefix_cache import NoPrefixCache, PrefixCache
from mmserve.cache.radix_cache import InsertResult, MatchResult, RadixCache, TreeNode
from mmserve.config import EngineConfig
from mmserve.engine.request import Request
from mmserve.model.identity import model_identity

if TYPE_CHECKING:
    from mmserve.cache.kv_tiers import FeatureCache
    from mmserve.engine.scheduler.holds import Holds
    from mmserve.model.loader import LoadedModel


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (pages for ``a`` tokens at ``b`` per page)."""
    return -(-a // b)


def make_kv_tiers(
    config: EngineConfig,
    model: LoadedModel,
    pool: KVPool,
    feature_cache: FeatureCache | None = None,
) -> KVTiers | None:
    """The host/disk KV tiers ``config`` asks for, or None (both off, or no radix cache).

    Args:
        config: ``kv_host_bytes``, ``kv_disk_dir``, ``kv_disk_bytes``, ``page_size``.
        model: the loaded model, keyed by :func:`~mmserve.model.identity.model_identity`
            (every weight byte, the tokenizer/processor files, dtype, quantization) so that
            no two checkpoints (or quantizations of one) share a page key or file.
        pool: the KV pool.
        feature_cache: the engine's embedding cache, which image features read from the
            disk tier go into (None: no feature files).
    """
    if config.disable_radix_cache or (not config.kv_host_bytes and config.kv_disk_dir is None):
        return None
    k = pool.k_buffers[0]
    namespace = kv_namespace(
        # every byte of the weights, tokenizer and processor files, dtype, quantization
        model_identity(model),
        k.dtype,
        pool.page_size,
        # fp8 pages mean something only with the scales they were written with
        ("NHD", pool.num_layers, k.shape[2], k.shape[3], *pool.k_scales, *pool.v_scales),
    )
    return KVTiers(
        pool,
        namespace,
        host_bytes=config.kv_host_bytes,
        disk_dir=config.kv_disk_dir,
        disk_bytes=config.kv_disk_bytes,
        feature_dim=model.decoder.shape.hidden_size,
        feature_cache=feature_cache,
    )


def make_tree(config: EngineConfig, pool: KVPool, tiers: KVTiers | None) -> PrefixCache:
    """The prefix cache over ``pool``: a :class:`NoPrefixCache` when
    ``config.disable_radix_cache``, else the radix cache, with the tiers' page keys and
    eviction hook if any."""
    if config.disable_radix_cache:
        return NoPrefixCache(config.page_size, pool.allocator.free)
    if tiers is None:
        return RadixCache(config.page_size, pool.allocator.free)
    return RadixCache(
        config.page_size,
        pool.allocator.free,
        page_hasher=tiers.chain.chain,
        root_key=tiers.chain.root,
        on_evict=tiers.on_evict,
    )


class KVManager:
    """Allocates, evicts, caches and releases the KV pages of requests.

    Args:
        pool: the KV pool whose allocator both the tree and requests draw from.
        tree: the prefix cache over that pool (:func:`make_tree`).
        tiers: host/disk KV tiers behind the tree (None: off); the tree must have been
            built with their page keys.

    Attributes:
        tree_seconds: wall time spent inside prefix-cache calls (seconds).
    """

    def __init__(self, pool: KVPool, tree: PrefixCache, tiers: KVTiers | None = None) -> None:
        self.pool = pool
        self.alloc = pool.allocator
        self.tree = tree
        self.tiers = tiers if tree.reuses_prefixes else None
        self.page_size = pool.page_size
        self.tree_seconds = 0.0
        #: the tree's version: bumped by every change that can make a match stale (an
        #: eviction or reset cuts one; an insert that adds tokens can lengthen one)
        self.tree_version = 0
        #: tree lookups made by :meth:`match` (carried matches not counted)
        self.matches = 0
        # rid -> (tree state, seq_len, match) of a waiting request: its match is carried
        # from step to step until the tree or its tokens change (dropped by forget)
        self._carried: dict[str, tuple[tuple[int, int], int, MatchResult]] = {}

    def _tree_state(self) -> tuple[int, int]:
        """What a carried match is valid for: the version and the tree's size (an
        eviction or insert made outside this manager, by a test, changes the size)."""
        return self.tree_version, self.tree.total_size()

    # ---- matching and locks ----------------------------------------------------
    def match(self, req: Request) -> MatchResult:
        """The tree's longest cached prefix of ``req``'s tokens, one token short of all
        of them (its logits give the next output token).

        The match is carried forward: asked again while the tree has not changed
        (:attr:`tree_version`) and ``req`` has the same tokens, it is not looked up
        again (a waiting request is matched once, not once per step, and a match made
        for the admission order is the one admission uses unless an earlier admission's
        eviction changed the tree). No copy of the whole sequence is made.
        """
        n, state = req.seq_len, self._tree_state()
        got = self._carried.get(req.rid)
        if got is not None and got[0] == state and got[1] == n:
            return got[2]
        t0 = time.perf_counter()
        m = self.tree.match_prefix(req.key_slice(0, n - 1))
        self.tree_seconds += time.perf_counter() - t0
        self.matches += 1
        self._carried[req.rid] = (self._tree_state(), n, m)
        return m

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` (and its ancestors) against eviction."""
        self.tree.inc_lock_ref(node)

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``."""
        self.tree.dec_lock_ref(node)

    # ---- pages ---------------------------------------------------------------------
    def available(self, reserved: int) -> int:
        """Pages a new claim may take: free plus evictable tree pages, minus ``reserved``
        (pages promised to admitted requests' future decode steps)."""
        return self.alloc.num_free + self.tree.evictable_size() // self.page_size - reserved

    def allocate(self, n: int) -> list[int]:
        """``n`` new pages, evicting tree leaves (LRU) for the shortfall.

        Raises:
            RuntimeError: if the pool cannot give them (the caller's accounting said it
                could: a bug).
        """
        if n <= 0:
            return []
        short = n - self.alloc.num_free
        if short > 0:
            t0 = time.perf_counter()
            if self.tree.evict(short * self.page_size):
                self.tree_version += 1
            self.tree_seconds += time.perf_counter() - t0
        pages = self.alloc.alloc(n)
        if pages is None:
            raise RuntimeError(f"KV pool exhausted: needed {n} pages (accounting bug)")
        return pages

    def grow(self, req: Request, n: int) -> None:
        """Append ``n`` new pages to ``req``'s, taken from its decode reservation first."""
        req.pages.extend(self.allocate(n))
        req.reserved_pages = max(0, req.reserved_pages - n)

    def grow_each(self, reqs: list[Request]) -> None:
        """One new page for each of ``reqs`` (a decode step's), in one allocation."""
        for req, page in zip(reqs, self.allocate(len(reqs)), strict=True):
            req.pages.append(page)
            if req.reserved_pages:
                req.reserved_pages -= 1

    def assign(self, req: Request, m: MatchResult, reserve: int) -> None:
        """Give ``req`` (being admitted) the pages of its locked match ``m`` plus new ones
        for the rest of its tokens, and a reservation of ``reserve`` decode pages."""
        new = ceil_div(req.seq_len, self.page_size) - len(m.pages)
        req.pages.reset(list(m.pages) + self.allocate(new))
        req.reserved_pages = reserve
        req.tree_len = req.computed_len = req.admit_len = m.length
        req.last_node = m.last_node

    # ---- the tree hand-over ----------------------------------------------------------
    def _insert(self, req: Request, kv_len: int) -> InsertResult:
        """Insert ``req``'s first ``kv_len`` tokens (full pages only) and free ``req``'s
        pages that duplicate the tree's."""
        P = self.page_size
        n = (kv_len // P) * P
        t0 = time.perf_counter()
        done = self.tree.insert_prefix(req.key_slice(0, n), req.pages[: n // P])
        self.tree_seconds += time.perf_counter() - t0
        if done.cached < done.length:
            self.tree_version += 1  # new tokens in the tree: waiting matches may lengthen
        # our pages for [tree_len, cached) duplicate KV the tree already holds
        dup = req.pages[req.tree_len // P : done.cached // P]
        if dup:
            self.alloc.free(dup)
        return done

    def cache_prefix(self, req: Request) -> None:
        """Hand ``req``'s computed full pages to the tree and lock them for ``req``."""
        done = self._insert(req, req.computed_len)
        if done.length <= req.tree_len:
            return
        req.pages[: done.length // self.page_size] = done.pages
        assert req.last_node is not None  # set at admission (assign), the request runs
        self.tree.inc_lock_ref(done.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = done.last_node
        req.tree_len = done.length

    def release(self, req: Request, holds: Holds | None = None) -> None:
        """``req`` ends or waits again: its computed KV goes to the tree, its other pages
        to the pool, its lock and reservation are dropped. With ``holds`` (a held request
        that finished) the tree node of its computed KV is locked there under
        ``req.hold`` first (:mod:`.holds`)."""
        keep = 0
        if req.last_node is not None:
            done = self._insert(req, req.computed_len)
            keep = done.length // self.page_size
            if req.write_through and self.tiers is not None and done.length:
                self._write_through(done.last_node)
            if holds is not None:
                holds.take(req.hold, done.last_node, done.length)
            self.tree.dec_lock_ref(req.last_node)
        rest = req.pages[keep:]
        if rest:
            self.alloc.free(rest)
        req.pages.reset()
        req.reserved_pages = 0
        req.last_node = None

    def _write_through(self, node: TreeNode) -> None:
        """Queue the pages from the root to ``node`` (locked) for the disk tier."""
        assert self.tiers is not None
        keys: list[bytes] = []
        pages: list[int] = []
        while node is not None and node.parent is not None:  # up to the root (excluded)
            keys[:0] = self.tree.page_keys(node)
            pages[:0] = list(node.pages)
            node = node.parent
        self.tiers.write_through(keys, pages)

    def flush(self) -> int:
        """Drop every tree page (no request may hold a lock); returns pages freed."""
        before = self.alloc.num_free
        self.tree.reset()
        self.tree_version += 1
        return self.alloc.num_free - before

    # ---- tiers -----------------------------------------------------------------------
    def poll_tiers(self) -> None:
        """Take in the tiers' finished disk loads (no-op without tiers)."""
        if self.tiers is not None:
            self.tiers.poll()

    def is_loading(self, req: Request) -> bool:
        """Whether ``req``'s pages or features are being read from disk."""
        return self.tiers is not None and self.tiers.is_loading(req.rid)

    def forget(self, req: Request) -> None:
        """Drop ``req``'s carried match and the tiers' state for it (a load in flight,
        staged pages): it was admitted, or left."""
        self._carried.pop(req.rid, None)
        if self.tiers is not None:
            self.tiers.forget(req.rid)

    def wait_for_loads(self) -> None:
        """Sleep briefly when only disk loads are pending (instead of spinning)."""
        if self.tiers is not None and self.tiers.pending():
            self.tiers.wait(0.02)

    def load_from_tiers(self, req: Request, m: MatchResult) -> MatchResult | None:
        """Extend ``req``'s locked device match ``m`` with pages from the tiers.

        Host (and already staged disk) pages are copied into new pool pages, inserted into
        the tree and locked in place of ``m`` (whose lock is dropped); disk pages, and the
        features of images that reach past the cached pages when the disk has them, start
        a load instead, on the first attempt since the request's last admission.

        Returns:
            The new match (locked), ``m`` itself when nothing was loaded (or no tiers), or
            None when a disk load started (``m`` stays locked; the caller unlocks it).
        """
        if self.tiers is None:
            return m
        P = self.page_size
        ids = req.key_slice(0, req.seq_len)
        limit = len(ids) - 1  # one token is always computed
        t0 = time.perf_counter()
        parent = self.tree.last_page_key(m.last_node)
        tm = self.tiers.lookup(parent, ids[m.length : limit])
        # images with positions past the cached pages need features: the tower, unless the
        # disk holds them (a restart, or features the embedding cache dropped)
        covered = m.length + len(tm.keys) * P
        feats = self.tiers.features_to_load(
            (s.image.key, s.length)
            for s in req.spans
            if s.end > covered and s.image.features is None
        )
        self.tree_seconds += time.perf_counter() - t0
        if (tm.disk_pages or feats) and self.tiers.start_load(req.rid, tm.keys, feats):
            return None
        pages = self.tiers.take(tm.keys)
        if not pages:
            return m
        new = self.allocate(len(pages))  # fits: counted in the admission check
        self.pool.write_pages(new, self.tiers.stack_pages(pages))
        end = m.length + len(pages) * P
        t0 = time.perf_counter()
        done = self.tree.insert_prefix(ids[:end], list(m.pages) + new)
        self.tree_version += 1
        # the match was locked, so the tree held exactly m.length tokens of this prefix
        dup = new[: max(0, done.cached - m.length) // P]
        if dup:
            self.alloc.free(dup)
        self.tree_seconds += time.perf_counter() - t0
        self.tree.inc_lock_ref(done.last_node)
        self.tree.dec_lock_ref(m.last_node)
        return MatchResult(done.length, done.pages, done.last_node)

    def flush_tiers(self, timeout: float = 60.0) -> int:
        """Write every tree page (and the host tier) to the disk tier and wait for it
        (shutdown; seconds: at most ``timeout``). Returns pages queued."""
        if self.tiers is None:
            return 0
        return self.tiers.flush_tree(self.tree.iter_pages(), timeout)

    def accounting(self, active: list[Request]) -> dict[str, int]:
        """``{"free", "tree", "running", "total"}`` in pages, where running counts the
        pages of ``active`` requests not in the tree.

        Raises:
            AssertionError: if free + tree + running != pool size.
        """
        P = self.page_size
        running = sum(len(r.pages) - r.tree_len // P for r in active)
        out = {
            "free": self.alloc.num_free,
            "tree": self.tree.num_pages(),
            "running": running,
            "total": self.pool.num_pages,
        }
        assert out["free"] + out["tree"] + out["running"] == out["total"], out
        return out
