"""The scheduler: the queues of live requests and every transition between them.

A request waits (:attr:`Scheduler.waiting`), is admitted into a prefill batch (in chunks
while it sits in :attr:`Scheduler.prefilling`), runs (:attr:`Scheduler.running`; in
:attr:`Scheduler.extending` while a jump-forward's tokens await their K/V) and ends, or
waits again when decode runs out of pages (retraction: the newest running requests,
background ones first; their computed prefix stays in the tree and they resume with
identical output). Three rooms do the work: :mod:`.admission` (order, budget, chunks,
reservations), :mod:`.kv_manager` (pages, the prefix cache, the tiers) and
:mod:`.extend` (jump-forward extends); this class calls them and owns the queues.

After each prefill the computed full pages go into the tree, so followers hit before
the first request finishes; at finish the prompt and output go in and the request's
lock is dropped. With KV tiers, pages on disk are read by a loader thread while the
request waits ("loading", skipped by admission) and are taken from memory at its next
admission attempt; image features from an encoder service load the same way
(:mod:`.features`). A waiting request's prefix match is carried from step to step and
looked up again only when the tree changed (:meth:`.KVManager.match`).
"""

from __future__ import annotations

import random
import time
from collections import deque

from mmserve.cache.kv_pool import KVPool
from mmserve.cache.kv_tiers import KVTiers
from mmserve.cache.no_prefix_cache import PrefixCache
from mmserve.cache.radix_cache import MatchResult
from mmserve.config import EngineConfig
from mmserve.engine.request import Request
from mmserve.engine.scheduler.admission import (
    PrefillBudget,
    admission_order,
    chunk_len,
    decode_reserve,
    shares_uncached_prefix,
)
from mmserve.engine.scheduler.extend import schedule_extends
from mmserve.engine.scheduler.features import FeatureLoads
from mmserve.engine.scheduler.holds import Holds
from mmserve.engine.scheduler.kv_manager import KVManager, ceil_div


class Scheduler:
    """Owns the waiting, prefilling, running and extending requests; its KV manager owns
    every page they hold.

    Args:
        config: engine settings (page size, budgets, policy).
        pool: the KV pool whose allocator both the tree and requests draw from.
        tree: the prefix cache over that pool (a radix cache, or the no-op cache).
        tiers: host/disk KV tiers behind the tree (None: off); the tree must have been
            built with their page keys (:func:`~.kv_manager.make_tree`).

    Attributes:
        kv: the KV manager (pages, prefix cache, tiers).
        prefilling: the request whose prompt is being prefilled in chunks, if any.
        extending: running requests whose newest tokens (jump-forward) await an extend.
        extend_batches: prefill batches that carried at least one extend.
        retractions: requests put back in the queue for lack of pages.
        holds: prefixes kept locked under hold ids after their held request ended
            (:mod:`.holds`; live video streams).
    """

    def __init__(
        self, config: EngineConfig, pool: KVPool, tree: PrefixCache, tiers: KVTiers | None = None
    ) -> None:
        self.config = config
        self.kv = KVManager(pool, tree, tiers)
        self.pool = pool
        self.tree = tree
        self.tiers = self.kv.tiers
        self.page_size = pool.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: Request | None = None
        self.extending: list[Request] = []
        # the one registry of live requests (added, not yet finished or aborted)
        self.live: dict[str, Request] = {}
        self.extend_batches = 0
        self.retractions = 0
        self._rng = random.Random(config.policy_seed)
        #: remote image features fetched off the step (None: no feature source)
        self.features: FeatureLoads | None = None
        self.holds = Holds(tree)

    @property
    def tree_seconds(self) -> float:
        """Wall time spent inside prefix-cache calls (seconds)."""
        return self.kv.tree_seconds

    #: tokens to prefill from a start: see :func:`~.admission.chunk_len`
    _chunk = staticmethod(chunk_len)

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

    # ---- admission --------------------------------------------------------
    def schedule_prefill(self, budget: int | None = None) -> list[tuple[Request, int]]:
        """Pick this step's prefill batch: extends first, then the next chunk of the
        request prefilled in chunks, then admissions from the waiting queue.

        Args:
            budget: new tokens this batch may compute (default
                ``config.max_prefill_tokens``; a mixed step passes what its decode
                tokens leave of the step's budget).

        Returns:
            ``(request, extend_len)`` pairs: each request computes tokens
            ``[computed_len, computed_len + extend_len)``; a request whose prompt is
            not finished after that stays in :attr:`prefilling`. Empty if nothing fits.
        """
        left = PrefillBudget.for_step(self.config, budget)
        if left.tokens <= 0:
            return []
        self.kv.poll_tiers()
        if self.features is not None:
            self.features.poll()
        batch: list[tuple[Request, int]] = []
        if self.extending:
            batch += schedule_extends(
                self.extending, self.kv, left, self.reserved_pages, self.retract
            )
            self.extend_batches += bool(batch)
        if self.prefilling is not None:
            req = self.prefilling
            n = chunk_len(req, req.computed_len, left.cap(req))
            batch.append((req, n))
            left.take(n, req)
        if not self.waiting or left.tokens <= 0 or not left.has_slot(len(self.active())):
            return batch  # nothing to admit: skip matching every waiting request
        self._admit(batch, left)
        if not batch and not self.running:
            # only disk loads or feature fetches are left: sleep instead of spinning
            self.kv.wait_for_loads()
            if self.features is not None and self.features.pending():
                self.features.wait(0.02)
        return batch

    def _admit(self, batch: list[tuple[Request, int]], left: PrefillBudget) -> None:
        """Admit waiting requests in policy order into ``batch`` while they fit ``left``
        and the pool (Algorithm 1); the first that does not fit stops admission, so that
        a big request is not overtaken forever."""
        P = self.page_size
        admitted: list[Request] = []
        active = self.active()
        n_active, promised = len(active), sum(r.reserved_pages for r in active)
        top = None  # the class of the first admitted request (classes come in order)
        for req, _ in admission_order(self.waiting, self.kv.match, self.config, self._rng):
            if not left.has_slot(n_active + len(admitted)):
                break
            if top is not None and req.priority > top:
                # a lower class never shares a prefill with a higher one: its prompt
                # would lengthen the step that gives the interactive request its TTFT
                break
            if self.kv.is_loading(req):
                continue  # its disk pages are being read; others go on
            if self.features is not None and (
                self.features.is_loading(req) or self.features.start(req)
            ):
                continue  # its image features are being fetched; others go on
            cap = left.cap(req)
            if cap <= 0:
                continue  # background chunks used up this step's share; others go on
            # the match made for the order, carried: looked up again only when an
            # earlier admission's eviction (or insert) changed the tree since
            m = self.kv.match(req)
            extend = req.seq_len - m.length  # before any tier load, as admission has it
            if extend > cap and (admitted or self.prefilling or batch):
                break
            # a request whose uncached part another one is computing (in this batch, or
            # chunk by chunk across steps) waits, to hit the tree once that is done
            ahead = admitted + ([self.prefilling] if self.prefilling is not None else [])
            if self.tree.reuses_prefixes and shares_uncached_prefix(
                req, m.length, ahead, self.config.dedup_min_tokens
            ):
                continue
            self.kv.lock(m.last_node)
            reserve = decode_reserve(req, P, self.config.decode_reserve_ratio)
            if ceil_div(req.seq_len, P) - len(m.pages) + reserve > self.kv.available(promised):
                self.kv.unlock(m.last_node)
                break  # keep order: a big request is not overtaken forever
            loaded = self.kv.load_from_tiers(req, m)
            if loaded is None:  # reading its pages from disk: admit it later
                self.kv.unlock(m.last_node)
                continue
            self._forget(req)
            self._start(req, loaded, reserve)
            promised += req.reserved_pages
            top = req.priority if top is None else min(top, req.priority)
            n = chunk_len(req, loaded.length, cap)
            if n < extend:
                self.prefilling = req
            left.take(n, req)
            admitted.append(req)
            batch.append((req, n))
            if self.prefilling is req or left.tokens <= 0:
                break
        if admitted:  # one pass over the queue, not one search per admitted request
            gone = {id(r) for r in admitted}
            kept = [r for r in self.waiting if id(r) not in gone]
            self.waiting.clear()
            self.waiting.extend(kept)

    def _forget(self, req: Request, left: bool = False) -> None:
        """Drop the loads' state of ``req``: admitted, or ``left`` (its fetched features
        too)."""
        self.kv.forget(req)
        if self.features is not None:
            (self.features.drop if left else self.features.forget)(req)

    def _start(self, req: Request, m: MatchResult, reserve: int) -> None:
        """Give admitted ``req`` its pages (match ``m`` plus new ones) and count the
        admission."""
        self.kv.assign(req, m, reserve)
        if req.admissions == 0:
            req.cached_len = m.length
        req.admissions += 1
        req.admitted_at = time.perf_counter()

    # ---- decode and retraction -----------------------------------------------
    def prepare_decode(self) -> list[Request]:
        """Give every running request a page for its next token, retracting if needed.

        Returns:
            Requests retracted this step (already back in the waiting queue).
        """
        P = self.page_size
        retracted: list[Request] = []
        # one pass over the batch; the pages come in one allocation (kv.grow_each)
        short = [r for r in self.running if r.computed_len // P >= len(r.pages)]
        while len(short) > self.kv.available(0):
            candidates = self.active()
            if len(candidates) <= 1:
                break
            # background work first, then the newest admitted
            victim = max(candidates, key=lambda r: (r.priority, r.admitted_at, r.arrival))
            self.retract(victim)
            retracted.append(victim)
            short = [r for r in short if r is not victim]
        if short:
            self.kv.grow_each(short)
        return retracted

    def retract(self, req: Request) -> None:
        """Put a running request back in the queue; its computed KV stays in the tree."""
        self.release(req)
        req.tree_len = req.computed_len = 0
        self.retractions += 1
        self.waiting.appendleft(req)

    # ---- progress -----------------------------------------------------------
    def on_prefilled(self, req: Request, extend_len: int) -> bool:
        """Record ``extend_len`` newly computed tokens of ``req``'s prefill.

        The computed full pages go to the tree (locked for ``req``). When the whole
        prompt is computed the request leaves :attr:`prefilling` and starts running.

        Returns:
            True when the prompt is complete (its last logits give the next token).
        """
        req.computed_len += extend_len
        self.kv.cache_prefix(req)
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

    def extend(self, req: Request) -> None:
        """``req`` (running) holds more than one token without K/V (a jump-forward
        appended them): it leaves the decode batch, and the next prefill batch computes
        ``[computed_len, len(all_ids()))``, the path a retracted request resumes by
        (:mod:`.extend`)."""
        self.running.remove(req)
        self.extending.append(req)

    # ---- endings --------------------------------------------------------------
    def finish(self, req: Request) -> None:
        """``req`` is done: its prompt and output KV go to the tree, the rest is freed."""
        self.live.pop(req.rid, None)
        if self.features is not None:
            self.features.drop(req)
        self.release(req, self.holds if req.hold else None)

    def abort(self, req: Request, cache: bool = True) -> None:
        """Remove ``req`` wherever it is (waiting, prefilling or running).

        Args:
            cache: hand its computed KV to the tree (False after a failed batch, whose
                writes are not trusted: only pages already in the tree stay there).
        """
        self.live.pop(req.rid, None)
        self._forget(req, left=True)
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
        for req in reqs:
            self._forget(req, left=True)
        self.waiting.clear()
        for req in self.active():
            self.release(req)
        return reqs

    def release(self, req: Request, holds: Holds | None = None) -> None:
        """Finish, abort or retract ``req``: cache its computed KV (locked in ``holds``
        under its hold id when given), free the rest, unlock, and take it out of the
        running, extending and prefilling places."""
        self.kv.release(req, holds)
        if req in self.running:
            self.running.remove(req)
        if req in self.extending:
            self.extending.remove(req)
        if self.prefilling is req:
            self.prefilling = None

    # ---- cache --------------------------------------------------------------------
    def flush_cache(self) -> int:
        """Drop every tree page (only while no request holds pages; held prefixes are
        released); returns pages freed.

        Raises:
            RuntimeError: while a request is waiting, prefilling or running.
        """
        if self.has_work():
            raise RuntimeError("cannot flush the cache while requests are live")
        self.holds.release_all()  # a held prefix is cache too: its holder prefills again
        return self.kv.flush()

    def flush_tiers(self, timeout: float = 60.0) -> int:
        """Write every tree page (and the host tier) to the disk tier and wait for it
        (shutdown; seconds: at most ``timeout``). Returns pages queued."""
        return self.kv.flush_tiers(timeout)

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
        return self.kv.accounting(self.active())
