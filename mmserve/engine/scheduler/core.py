"""Admission, page budgeting, retraction and radix-cache bookkeeping.

The waiting queue is ordered by priority class (interactive before batch jobs), then
by a policy inside each class (:mod:`mmserve.engine.policy`).
Admission follows the SGLang paper's Algorithm 1 (arXiv 2312.07104, Section 3):
a request fits if the pages of its uncached prompt plus a reservation for its
future decode tokens fit in free pages plus evictable tree pages, minus what
running requests have reserved; eviction is lazy (only the shortfall,
leaf-first LRU). A prompt longer than the per-step token budget is prefilled in
chunks. After each prefill the computed full pages go into the tree, so
followers hit before the first request finishes; at finish the prompt and
output go in and the request's lock is dropped. When decode runs out of pages,
the newest running requests are retracted, background ones first: their computed
prefix goes to the tree and they wait again, to resume with identical output. A
running request that got several tokens at once (structured output's jump-forward) leaves the
decode batch for :attr:`Scheduler.extending`, and the next prefill batch computes
those tokens the way a resumed request's are, before any new admission.

With KV tiers (:mod:`mmserve.cache.kv_tiers`), admission looks past the device
match: pages in host memory are copied into pool pages, inserted into the tree
and counted as cached; pages on disk are read by a loader thread while the
request waits ("loading", skipped by admission) and are taken from memory at
its next admission attempt.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque

import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.cache.kv_tiers import KVTiers, kv_namespace, model_fingerprint
from mmserve.cache.radix_cache import MatchResult, RadixCache
from mmserve.config import EngineConfig
from mmserve.engine.policy import order_waiting
from mmserve.engine.request import Request


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def make_kv_tiers(
    config: EngineConfig, model: object, pool: KVPool, feature_cache: object | None = None
) -> KVTiers | None:
    """The host/disk KV tiers ``config`` asks for, or None (both off, or no radix cache).

    Args:
        config: ``kv_host_bytes``, ``kv_disk_dir``, ``kv_disk_bytes``, ``page_size``.
        model: the loaded model (``config``, ``decoder``, ``vision``, ``quantization``),
            fingerprinted so that no two checkpoints (or quantizations of one) share a page
            key or file.
        pool: the KV pool.
        feature_cache: the engine's embedding cache, which image features read from the
            disk tier go into (None: no feature files).
    """
    if config.disable_radix_cache or (not config.kv_host_bytes and config.kv_disk_dir is None):
        return None
    named = list(model.decoder.named_parameters())
    vision = getattr(model, "vision", None)
    if hasattr(vision, "named_parameters"):
        named += [("vision." + n, t) for n, t in vision.named_parameters()]
    cfg = model.config
    text = cfg.to_json_string() if hasattr(cfg, "to_json_string") else repr(cfg)
    # int8 / fp8 weights give other KV than the checkpoint's own: another namespace
    text += f"|quantization={getattr(model, 'quantization', 'none')}"
    k = pool.k_buffers[0]
    namespace = kv_namespace(
        model_fingerprint(text, named),
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


def make_tree(config: EngineConfig, pool: KVPool, tiers: KVTiers | None) -> RadixCache:
    """The radix cache over ``pool``, with the tiers' page keys and eviction hook if any."""
    if tiers is None:
        return RadixCache(config.page_size, pool.allocator.free, disable=config.disable_radix_cache)
    return RadixCache(
        config.page_size,
        pool.allocator.free,
        disable=config.disable_radix_cache,
        page_hasher=tiers.chain.chain,
        root_key=tiers.chain.root,
        on_evict=tiers.on_evict,
    )


class Scheduler:
    """Owns the waiting, prefilling and running requests and every page they hold.

    Args:
        config: engine settings (page size, budgets, policy, cache switch).
        pool: the KV pool whose allocator both the tree and requests draw from.
        tree: the radix cache over that pool.
        tiers: host/disk KV tiers behind the tree (None: off); the tree must have been
            built with their page keys (:func:`make_tree`).

    Attributes:
        prefilling: the request whose prompt is being prefilled in chunks, if any.
        extending: running requests whose newest tokens (jump-forward) await an extend.
        extend_batches: prefill batches that carried at least one extend.
        tree_seconds: wall time spent inside radix-tree calls (seconds).
        retractions: requests put back in the queue for lack of pages.
    """

    def __init__(
        self, config: EngineConfig, pool: KVPool, tree: RadixCache, tiers: KVTiers | None = None
    ) -> None:
        self.config = config
        self.tiers = tiers if not tree.disable else None
        self.pool = pool
        self.alloc = pool.allocator
        self.tree = tree
        self.page_size = pool.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: Request | None = None
        self.extending: list[Request] = []
        # the one registry of live requests (added, not yet finished or aborted)
        self.live: dict[str, Request] = {}
        self.extend_batches = 0
        self.tree_seconds = 0.0
        self.retractions = 0
        self._rng = random.Random(config.policy_seed)

    # ---- queue ------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request for admission."""
        self.live[req.rid] = req
        self.waiting.append(req)

    def get(self, rid: str) -> Request | None:
        """The live request with id ``rid``, or None."""
        return self.live.get(rid)

    def has_work(self) -> bool:
        """Whether any request is waiting, running or between prefill chunks.

        Every state a live request can be in counts: the engine must keep stepping
        until each one ends, with no other traffic to wake it.
        """
        return bool(self.waiting or self.running or self.extending or self.prefilling is not None)

    def active(self) -> list[Request]:
        """Running requests (extending ones included) plus the one prefilled in chunks."""
        return self.running + self.extending + ([self.prefilling] if self.prefilling else [])

    def reserved_pages(self) -> int:
        """Pages promised to admitted requests' future decode steps."""
        return sum(r.reserved_pages for r in self.active())

    def _match(self, req: Request):  # noqa: ANN202
        t0 = time.perf_counter()
        ids = req.all_ids()
        # keep one token to compute: its logits give the next output token
        m = self.tree.match_prefix(ids[: len(ids) - 1])
        self.tree_seconds += time.perf_counter() - t0
        return m

    # ---- admission --------------------------------------------------------
    def schedule_prefill(self, budget: int | None = None) -> list[tuple[Request, int]]:
        """Pick this step's prefill batch.

        Args:
            budget: new tokens this batch may compute (default
                ``config.max_prefill_tokens``; a mixed step passes what its decode
                tokens leave of the step's budget).

        Returns:
            ``(request, extend_len)`` pairs: each request computes tokens
            ``[computed_len, computed_len + extend_len)``; a request whose prompt is
            not finished after that stays in :attr:`prefilling`. Empty if nothing fits.
        """
        batch: list[tuple[Request, int]] = []
        if budget is None:
            budget = self.config.max_prefill_tokens
        if budget <= 0:
            return batch
        if self.tiers is not None:
            self.tiers.poll()
        if self.extending:
            budget = self._schedule_extends(batch, budget)
        background = self.config.background_prefill_tokens  # left for background chunks
        if self.prefilling is not None:
            req = self.prefilling
            n = self._chunk(req, req.computed_len, self._cap(req, budget, background))
            batch.append((req, n))
            budget -= n
            background -= n if req.priority else 0
        if (
            not self.waiting
            or budget <= 0
            or len(self.active()) >= self.config.max_running_requests
        ):
            return batch  # nothing to admit: skip matching every waiting request
        P = self.page_size
        items = [(r, self._match(r)) for r in self.waiting]
        order = order_waiting(
            items,
            self.config.policy,
            time.perf_counter(),
            self.config.max_wait_seconds,
            self._rng,
            not self.tree.disable,
        )
        admitted: list[Request] = []
        for req, _ in order:
            if len(self.active()) + len(admitted) >= self.config.max_running_requests:
                break
            if admitted and req.priority > min(r.priority for r in admitted):
                # a lower class never shares a prefill with a higher one: its prompt
                # would lengthen the step that gives the interactive request its TTFT
                break
            if self.tiers is not None and self.tiers.is_loading(req.rid):
                continue  # its disk pages are being read; others go on
            cap = self._cap(req, budget, background)
            if cap <= 0:
                continue  # background chunks used up this step's share; others go on
            # match again: an eviction for an earlier admission may have cut the old match
            m = self._match(req)
            fill = req.seq_len
            extend = fill - m.length
            if extend > cap and (admitted or self.prefilling or batch):
                break
            # a request whose uncached part another one is computing (in this batch, or
            # chunk by chunk across steps) waits, to hit the tree once that is done
            ahead = admitted + ([self.prefilling] if self.prefilling is not None else [])
            if self._shares_uncached_prefix(req, m.length, ahead):
                continue
            self._lock(m.last_node)
            prompt_pages = _ceil_div(fill, P) - len(m.pages)
            reserve = self._decode_reserve(req, fill)
            available = (
                self.alloc.num_free
                + self.tree.evictable_size() // P
                - self.reserved_pages()
                - sum(r.reserved_pages for r in admitted)
            )
            if prompt_pages + reserve > available:
                self._unlock(m.last_node)
                break  # keep order: a big request is not overtaken forever
            if self.tiers is not None:
                loaded = self._load_from_tiers(req, m)
                if loaded is None:  # reading its pages from disk: admit it later
                    self._unlock(m.last_node)
                    continue
                m = loaded
                prompt_pages = _ceil_div(fill, P) - len(m.pages)
                self.tiers.forget(req.rid)
            req.pages.reset(list(m.pages) + self._alloc(prompt_pages))
            req.reserved_pages = reserve
            req.tree_len = req.computed_len = req.admit_len = m.length
            if req.admissions == 0:
                req.cached_len = m.length
            req.admissions += 1
            req.admitted_at = time.perf_counter()
            req.last_node = m.last_node
            n = self._chunk(req, m.length, cap)
            if n < extend:
                self.prefilling = req
            budget -= n
            background -= n if req.priority else 0
            admitted.append(req)
            batch.append((req, n))
            if self.prefilling is req or budget <= 0:
                break
        for req in admitted:
            self.waiting.remove(req)
        if not batch and not self.running and self.tiers is not None and self.tiers.pending():
            self.tiers.wait(0.02)  # only disk loads are left: sleep instead of spinning
        return batch

    def _load_from_tiers(self, req: Request, m: MatchResult) -> MatchResult | None:
        """Extend ``req``'s locked device match ``m`` with pages from the tiers.

        Host (and already staged disk) pages are copied into new pool pages, inserted into
        the tree and locked in place of ``m`` (whose lock is dropped); disk pages, and the
        features of images that reach past the cached pages when the disk has them, start
        a load instead, on the first attempt since the request's last admission.

        Returns:
            The new match (locked), ``m`` itself when nothing was loaded, or None when a
            disk load started (``m`` stays locked; the caller unlocks it).
        """
        P = self.page_size
        ids = req.all_ids()
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
        new = self._alloc(len(pages))  # fits: counted in the admission check
        self.pool.write_pages(new, torch.stack(pages))
        end = m.length + len(pages) * P
        t0 = time.perf_counter()
        prev = self.tree.insert(ids[:end], list(m.pages) + new)
        # the match was locked, so the tree held exactly m.length tokens of this prefix
        dup = new[: max(0, prev - m.length) // P]
        if dup:
            self.alloc.free(dup)
        loaded = self.tree.match_prefix(ids[:end])
        self.tree_seconds += time.perf_counter() - t0
        self.tree.inc_lock_ref(loaded.last_node)
        self.tree.dec_lock_ref(m.last_node)
        return loaded

    def _cap(self, req: Request, budget: int, background: int) -> int:
        """Tokens ``req`` may prefill this step: the step's ``budget``, and for a
        background request also what is left of ``background_prefill_tokens``."""
        return min(budget, background) if req.priority else budget

    def _decode_reserve(self, req: Request, fill: int) -> int:
        # a retracted request reserves all its remaining pages, which makes a second
        # retraction unlikely (reservations are promises, not set-aside pages)
        remaining = req.params.max_tokens - len(req.output_ids)
        ratio = 1.0 if req.admissions else self.config.decode_reserve_ratio
        last = fill + max(0, remaining - 1)  # tokens with KV when it finishes
        full = _ceil_div(last, self.page_size) - _ceil_div(fill, self.page_size)
        return min(full, math.ceil(full * ratio))

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens to prefill from ``start``: all of them, or up to ``budget`` without
        ending inside an image when an earlier boundary exists."""
        fill = req.seq_len
        end = min(fill, start + max(budget, 1))
        if end < fill:
            for span in req.spans:
                if span.start < end < span.end and span.start > start:
                    end = span.start
        return end - start

    def _shares_uncached_prefix(self, req: Request, cached: int, batch: list[Request]) -> bool:
        # Two requests about the same new image in one batch would both prefill it;
        # let the second wait a step and hit the tree instead. One slice compare per
        # pair (C speed): this runs for every waiting request on every step.
        if self.tree.disable:
            return False
        end = cached + self.config.dedup_min_tokens
        head = req.input_ids[:end]
        if len(head) < end:
            return False
        return any(other.input_ids[:end] == head for other in batch)

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

    def prepare_decode(self) -> list[Request]:
        """Give every running request a page for its next token, retracting if needed.

        Returns:
            Requests retracted this step (already back in the waiting queue).
        """
        P = self.page_size
        retracted: list[Request] = []

        def needs(r: Request) -> bool:
            return r.computed_len // P >= len(r.pages)

        while True:
            short = sum(needs(r) for r in self.running)
            have = self.alloc.num_free + self.tree.evictable_size() // P
            candidates = self.active()
            if short <= have or len(candidates) <= 1:
                break
            # background work first, then the newest admitted
            victim = max(candidates, key=lambda r: (r.priority, r.admitted_at, r.arrival))
            self.retract(victim)
            retracted.append(victim)
        for r in self.running:
            if needs(r):
                r.pages.extend(self._alloc(1))
                r.reserved_pages = max(0, r.reserved_pages - 1)
        return retracted

    def retract(self, req: Request) -> None:
        """Put a running request back in the queue; its computed KV stays in the tree."""
        self.release(req)
        req.tree_len = req.computed_len = 0
        self.retractions += 1
        self.waiting.appendleft(req)

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

    def on_prefilled(self, req: Request, extend_len: int) -> bool:
        """Record ``extend_len`` newly computed tokens of ``req``'s prefill.

        The computed full pages go to the tree (locked for ``req``). When the whole
        prompt is computed the request leaves :attr:`prefilling` and starts running.

        Returns:
            True when the prompt is complete (its last logits give the next token).
        """
        req.computed_len += extend_len
        self._cache_prefix(req)
        if req.computed_len < req.seq_len:
            return False  # more chunks to come
        if self.prefilling is req:
            self.prefilling = None
        if req in self.extending:
            self.extending.remove(req)
        self.running.append(req)
        return True

    def on_decoded(self, reqs: list[Request]) -> None:
        """Each of ``reqs`` has the K/V of one more token."""
        for req in reqs:
            req.computed_len += 1

    def finish(self, req: Request) -> None:
        """``req`` is done: its prompt and output KV go to the tree, the rest is freed."""
        self.live.pop(req.rid, None)
        self.release(req)

    def abort(self, req: Request, cache: bool = True) -> None:
        """Remove ``req`` wherever it is (waiting, prefilling or running).

        Args:
            cache: hand its computed KV to the tree (False after a failed batch, whose
                writes are not trusted: only pages already in the tree stay there).
        """
        self.live.pop(req.rid, None)
        if self.tiers is not None:
            self.tiers.forget(req.rid)
        if req in self.waiting:
            self.waiting.remove(req)
            return
        if not cache:
            req.computed_len = req.tree_len
        self.release(req)

    def abort_all(self) -> list[Request]:
        """Remove every live request (waiting, loading, prefilling or running); returns
        them."""
        reqs = list(self.live.values())
        self.live.clear()
        if self.tiers is not None:
            for req in reqs:
                self.tiers.forget(req.rid)
        self.waiting.clear()
        for req in self.active():
            self.release(req)
        return reqs

    def flush_cache(self) -> int:
        """Drop every tree page (only while no request holds pages); returns pages freed.

        Raises:
            RuntimeError: while a request is waiting, prefilling or running.
        """
        if self.has_work():
            raise RuntimeError("cannot flush the cache while requests are live")
        before = self.alloc.num_free
        self.tree.reset()
        return self.alloc.num_free - before

    def _cache_prefix(self, req: Request) -> None:
        """Hand the computed full pages to the tree and lock them for ``req``."""
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
        """Finish, abort or retract ``req``: cache its computed KV, free the rest, unlock."""
        keep = 0
        if req.last_node is not None and not self.tree.disable:
            keep = self._insert(req, req.computed_len) // self.page_size
            self.tree.dec_lock_ref(req.last_node)
        rest = req.pages[keep:]
        if rest:
            self.alloc.free(rest)
        req.pages.reset()
        req.reserved_pages = 0
        req.last_node = None
        if req in self.running:
            self.running.remove(req)
        if req in self.extending:
            self.extending.remove(req)
        if self.prefilling is req:
            self.prefilling = None

    # ---- jump-forward extends ------------------------------------------------
    def extend(self, req: Request) -> None:
        """``req`` (running) holds more than one token without K/V (a jump-forward
        appended them): it leaves the decode batch, and the next prefill batch computes
        ``[computed_len, len(all_ids()))``, the path a retracted request resumes by."""
        self.running.remove(req)
        self.extending.append(req)

    def _schedule_extends(self, batch: list[tuple[Request, int]], budget: int) -> int:
        """Add the extending requests to ``batch`` (within ``budget`` tokens); returns the
        budget left. Their pages come from their decode reservation, then from free or
        evictable pages; a request they do not fit is retracted (it resumes later)."""
        P = self.page_size
        scheduled = False
        for req in list(self.extending):
            if budget <= 0:
                break
            fill = req.seq_len
            need = _ceil_div(fill, P) - len(req.pages)
            if need > 0:
                others = self.reserved_pages() - req.reserved_pages
                have = self.alloc.num_free + self.tree.evictable_size() // P - others
                if need > have:
                    self.retract(req)
                    continue
                req.pages.extend(self._alloc(need))
                req.reserved_pages = max(0, req.reserved_pages - need)
            n = min(fill - req.computed_len, budget)
            batch.append((req, n))
            budget -= n
            scheduled = True
        self.extend_batches += scheduled
        return budget

    # ---- tiers ------------------------------------------------------------------
    def flush_tiers(self, timeout: float = 60.0) -> int:
        """Write every tree page (and the host tier) to the disk tier and wait for it
        (shutdown; seconds: at most ``timeout``). Returns pages queued."""
        if self.tiers is None:
            return 0
        return self.tiers.flush_tree(self.tree.iter_pages(), timeout)

    def check_accounting(self) -> dict[str, int]:
        """Pool accounting at a quiescent point (docs/architecture.md, invariants).

        Returns:
            ``{"free", "tree", "running", "total"}`` in pages, where
            running counts request-owned pages not in the tree.

        Raises:
            AssertionError: if free + tree + running != pool size, or the live
                registry is not exactly the waiting and active requests.
        """
        queued = {r.rid for r in self.waiting} | {r.rid for r in self.active()}
        assert queued == set(self.live), (sorted(queued), sorted(self.live))
        P = self.page_size
        running = sum(len(r.pages) - r.tree_len // P for r in self.active())
        out = {
            "free": self.alloc.num_free,
            "tree": self.tree.num_pages() if not self.tree.disable else 0,
            "running": running,
            "total": self.pool.num_pages,
        }
        assert out["free"] + out["tree"] + out["running"] == out["total"], out
        return out
