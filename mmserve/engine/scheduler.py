"""Admission, page budgeting and radix-cache bookkeeping for running requests.

Waiting requests are ordered longest-prefix-match first (SGLang paper,
arXiv 2312.07104, Section 3, "cache-aware scheduling") or FCFS. Admission
reserves pages for the prompt plus ``max_tokens`` (so an admitted request always
finishes) against free pages plus evictable tree pages; eviction is lazy, only
the shortfall, leaf-first LRU. After prefill the prompt's full pages go into the
tree so that followers hit before the first request finishes; at finish the
prompt and output go in and the request's lock is dropped.
"""

from __future__ import annotations

import time
from collections import deque

from mmserve.cache.kv_pool import KVPool
from mmserve.cache.radix_cache import RadixCache
from mmserve.config import EngineConfig
from mmserve.engine.request import Request


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _common_prefix(a: list[int], b: list[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """Owns the waiting and running sets and every page a request holds.

    Args:
        config: engine settings (page size, budgets, policy, cache switch).
        pool: the KV pool whose allocator both the tree and requests draw from.
        tree: the radix cache over that pool.

    Attributes:
        tree_seconds: wall time spent inside radix-tree calls (seconds).
    """

    def __init__(self, config: EngineConfig, pool: KVPool, tree: RadixCache) -> None:
        self.config = config
        self.pool = pool
        self.alloc = pool.allocator
        self.tree = tree
        self.page_size = pool.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.tree_seconds = 0.0

    # ---- queue ------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request for admission."""
        self.waiting.append(req)

    def pages_for(self, req: Request) -> int:
        """Pages a request needs over its whole life (prompt + max_tokens)."""
        return _ceil_div(req.prompt_len + req.params.max_tokens, self.page_size)

    def reserved_pages(self) -> int:
        """Pages promised to running requests' future decode steps."""
        return sum(r.reserved_pages for r in self.running)

    def _ordered_waiting(self) -> list[tuple[Request, object]]:
        t0 = time.perf_counter()
        matched = []
        for req in self.waiting:
            # keep one prompt token to compute: its logits give the first output token
            m = self.tree.match_prefix(req.input_ids[: req.prompt_len - 1])
            matched.append((req, m))
        self.tree_seconds += time.perf_counter() - t0
        if self.config.policy == "lpm" and not self.tree.disable:
            matched.sort(key=lambda rm: -rm[1].length)  # stable: FCFS among equals
        return matched

    # ---- admission --------------------------------------------------------
    def schedule_prefill(self) -> list[Request]:
        """Admit waiting requests into one prefill batch.

        Returns:
            Admitted requests with ``pages`` covering their prompt and
            ``cached_len`` set; empty if nothing fits.
        """
        if not self.waiting:
            return []
        batch: list[Request] = []
        budget = self.config.max_prefill_tokens
        P = self.page_size
        for req, _ in self._ordered_waiting():
            if len(self.running) + len(batch) >= self.config.max_running_requests:
                break
            # match again: an eviction for an earlier admission may have cut the old match
            m = self.tree.match_prefix(req.input_ids[: req.prompt_len - 1])
            extend = req.prompt_len - m.length
            if batch and extend > budget:
                break
            if self._shares_uncached_prefix(req, m.length, batch):
                continue
            self._lock(m.last_node)
            need = self.pages_for(req) - len(m.pages)
            available = (
                self.alloc.num_free
                + self.tree.evictable_size() // P
                - self.reserved_pages()
                - sum(r.reserved_pages for r in batch)
            )
            if need > available:
                self._unlock(m.last_node)
                break  # keep order: a big request is not overtaken forever
            prompt_pages = _ceil_div(req.prompt_len, P) - len(m.pages)
            new_pages = self._alloc(prompt_pages)
            req.pages = list(m.pages) + new_pages
            req.reserved_pages = need - prompt_pages
            req.cached_len = req.tree_len = req.computed_len = m.length
            req.last_node = m.last_node
            budget -= extend
            batch.append(req)
        for req in batch:
            self.waiting.remove(req)
        return batch

    def _shares_uncached_prefix(self, req: Request, cached: int, batch: list[Request]) -> bool:
        # Two requests about the same new image in one batch would both prefill it;
        # let the second wait a step and hit the tree instead.
        if self.tree.disable:
            return False
        for other in batch:
            if _common_prefix(req.input_ids, other.input_ids, cached) - cached >= (
                self.config.dedup_min_tokens
            ):
                return True
        return False

    # ---- pages ------------------------------------------------------------
    def _alloc(self, n: int) -> list[int]:
        if n <= 0:
            return []
        short = n - self.alloc.num_free
        if short > 0:
            t0 = time.perf_counter()
            self.tree.evict(short * self.page_size)
            self.tree_seconds += time.perf_counter() - t0
        pages = self.alloc.alloc(n)
        if pages is None:
            raise RuntimeError(f"KV pool exhausted: needed {n} pages (accounting bug)")
        return pages

    def ensure_decode_page(self, req: Request) -> None:
        """Give ``req`` a page for its next token if the current one is full."""
        pos = req.computed_len
        if pos // self.page_size >= len(req.pages):
            req.pages.extend(self._alloc(1))
            req.reserved_pages = max(0, req.reserved_pages - 1)

    def _lock(self, node: object) -> None:
        if not self.tree.disable:
            self.tree.inc_lock_ref(node)

    def _unlock(self, node: object) -> None:
        if not self.tree.disable:
            self.tree.dec_lock_ref(node)

    # ---- tree hand-over ---------------------------------------------------
    def _insert(self, req: Request, kv_len: int) -> int:
        """Insert ``req``'s first ``kv_len`` tokens (full pages only); returns tokens inserted."""
        P = self.page_size
        n = (kv_len // P) * P
        t0 = time.perf_counter()
        key = req.all_ids()[:n]
        prev = self.tree.insert(key, req.pages[: n // P])
        self.tree_seconds += time.perf_counter() - t0
        # our pages for [tree_len, prev) duplicate KV the tree already holds
        dup = req.pages[req.tree_len // P : prev // P]
        if dup:
            self.alloc.free(dup)
        return n

    def on_prefilled(self, req: Request) -> None:
        """Hand the prompt's full pages to the tree and lock them for ``req``."""
        if self.tree.disable:
            return
        n = self._insert(req, req.computed_len)
        if n <= req.tree_len:
            return
        t0 = time.perf_counter()
        m = self.tree.match_prefix(req.all_ids()[:n])
        self.tree_seconds += time.perf_counter() - t0
        req.pages[: n // self.page_size] = m.pages
        self.tree.inc_lock_ref(m.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = m.last_node
        req.tree_len = n

    def release(self, req: Request) -> None:
        """Finish or abort ``req``: cache its computed KV, free the rest, unlock.

        Removes ``req`` from the running set if it is there.
        """
        keep = 0
        if not self.tree.disable:
            keep = self._insert(req, req.computed_len) // self.page_size
            self.tree.dec_lock_ref(req.last_node)
        rest = req.pages[keep:]
        if rest:
            self.alloc.free(rest)
        req.pages = []
        req.reserved_pages = 0
        req.last_node = None
        if req in self.running:
            self.running.remove(req)

    def check_accounting(self) -> dict[str, int]:
        """Pool accounting at a quiescent point (DESIGN.md invariant 3).

        Returns:
            ``{"free", "tree", "running", "total"}`` in pages, where
            running counts request-owned pages not in the tree.

        Raises:
            AssertionError: if free + tree + running != pool size.
        """
        P = self.page_size
        running = sum(len(r.pages) - r.tree_len // P for r in self.running)
        out = {
            "free": self.alloc.num_free,
            "tree": self.tree.num_pages() if not self.tree.disable else 0,
            "running": running,
            "total": self.pool.num_pages,
        }
        assert out["free"] + out["tree"] + out["running"] == out["total"], out
        return out
