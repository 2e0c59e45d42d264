"""Admission: the order of the waiting queue, a prefill batch's budget, chunk sizes and
decode reservations.

The waiting queue is ordered by priority class (interactive before batch jobs), then
by a policy inside each class (:mod:`mmserve.engine.policy`). Admission follows the
SGLang paper's Algorithm 1 (arXiv 2312.07104, Section 3): a request fits if the pages
of its uncached prompt plus a reservation for its future decode tokens fit in free
pages plus evictable tree pages, minus what running requests have reserved. A prompt
longer than the per-step token budget is prefilled in chunks. Nothing here changes a
queue or a page: the scheduler acts on what these checks say.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mmserve.cache.radix_cache import MatchResult
from mmserve.config import EngineConfig
from mmserve.engine.policy import order_waiting
from mmserve.engine.request import Request
from mmserve.engine.scheduler.kv_manager import ceil_div


@dataclass
class PrefillBudget:
    """What one prefill batch may still take.

    Attributes:
        tokens: new tokens the batch may still compute.
        background: of those, what background requests (``priority > 0``) may still
            compute (``background_prefill_tokens``: their chunks stay short).
        max_running: running slots (``max_running_requests``), prefilling ones included.
    """

    tokens: int
    background: int
    max_running: int

    @classmethod
    def for_step(cls, config: EngineConfig, tokens: int | None = None) -> PrefillBudget:
        """The budget of one step: ``tokens`` new tokens (default
        ``config.max_prefill_tokens``)."""
        if tokens is None:
            tokens = config.max_prefill_tokens
        return cls(tokens, config.background_prefill_tokens, config.max_running_requests)

    def cap(self, req: Request) -> int:
        """Tokens ``req`` may prefill now: the batch's tokens, and for a background
        request also what is left of the background share."""
        return min(self.tokens, self.background) if req.priority else self.tokens

    def take(self, n: int, req: Request | None = None) -> None:
        """Spend ``n`` tokens (of the background share too when ``req`` is background
        work; extends pass no ``req``: they count against the batch only)."""
        self.tokens -= n
        if req is not None and req.priority:
            self.background -= n

    def has_slot(self, running: int) -> bool:
        """Whether one more request may run beside ``running`` admitted ones."""
        return running < self.max_running


def chunk_len(req: Request, start: int, budget: int) -> int:
    """Tokens of ``req`` to prefill from ``start``: all of them, or up to ``budget``
    without ending inside an image when an earlier boundary exists."""
    fill = req.seq_len
    end = min(fill, start + max(budget, 1))
    if end < fill:
        for span in req.spans:
            if span.start < end < span.end and span.start > start:
                end = span.start
    return end - start


def decode_reserve(req: Request, page_size: int, ratio: float) -> int:
    """Pages to promise ``req``'s future decode tokens at admission.

    Args:
        req: the request (``seq_len`` tokens filled by its prefill).
        page_size: tokens per page.
        ratio: the share of the pages its ``max_tokens`` could reach
            (``decode_reserve_ratio``); a retracted request reserves all of them, which
            makes a second retraction unlikely (reservations are promises, not
            set-aside pages).
    """
    fill = req.seq_len
    remaining = req.params.max_tokens - len(req.output_ids)
    if req.admissions:
        ratio = 1.0
    last = fill + max(0, remaining - 1)  # tokens with KV when it finishes
    full = ceil_div(last, page_size) - ceil_div(fill, page_size)
    return min(full, math.ceil(full * ratio))


def shares_uncached_prefix(
    req: Request, cached: int, ahead: Iterable[Request], min_tokens: int
) -> bool:
    """Whether a request in ``ahead`` (admitted this batch, or prefilled chunk by chunk)
    computes the ``min_tokens`` tokens of ``req`` after its ``cached`` ones.

    Two requests about the same new image in one batch would both prefill it; the
    second waits a step and hits the tree instead. One slice compare per pair (C speed):
    this runs for every waiting request on every step.
    """
    end = cached + min_tokens
    head = req.input_ids[:end]
    if len(head) < end:
        return False
    # another salt's prefill is no cache hit for this one (and must not delay it)
    return any(other.cache_ns == req.cache_ns and other.input_ids[:end] == head for other in ahead)


def admission_order(
    waiting: Iterable[Request],
    match: Callable[[Request], MatchResult],
    config: EngineConfig,
    rng: random.Random,
) -> list[tuple[Request, MatchResult]]:
    """``(request, its prefix match)`` of the waiting requests, in admission order
    (:func:`~mmserve.engine.policy.order_waiting` with ``config.policy``).

    Cache-aware policies need no switch for a disabled cache: every match of the
    no-op cache is empty, which makes them FCFS, as ``order_waiting`` would.
    """
    items = [(r, match(r)) for r in waiting]
    return order_waiting(
        items, config.policy, time.perf_counter(), config.max_wait_seconds, rng, True
    )
