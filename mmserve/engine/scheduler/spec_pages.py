"""Pages of speculative decoding's verify step (:mod:`mmserve.engine.spec_decode`).

A verify writes K/V for a request's last token and its drafted tokens: the pages for
them are grown before the forward (as far as pages not promised to other requests
allow) and, after acceptance, the ones past the request's sequence go straight back to
the pool (they held only rejected K/V and were never in the tree); the request's decode
reservation gets back what the kept pages did not use, so the accounting is as if it
had decoded those tokens one at a time.
"""

from __future__ import annotations

from collections.abc import Callable

from mmserve.engine.request import Request
from mmserve.engine.scheduler.kv_manager import KVManager, ceil_div


def grow_for_draft(kv: KVManager, req: Request, k: int, reserved_pages: Callable[[], int]) -> int:
    """Give running ``req`` pages for its last token and ``k`` drafted ones.

    Args:
        kv: the KV manager.
        req: a decode request (``computed_len`` tokens have K/V, one more is pending).
        k: drafted tokens wanted.
        reserved_pages: pages promised to every active request (``req``'s own included,
            which it may use).

    Returns:
        The drafted tokens whose K/V has room now (``<= k``; 0 when no page is free).
    """
    P = kv.page_size
    c, have = req.computed_len, len(req.pages)
    need = ceil_div(c + 1 + k, P) - have
    if need > 0:
        avail = max(0, kv.available(reserved_pages() - req.reserved_pages))
        if need > avail:
            k = max(0, (have + avail) * P - c - 1)
            need = ceil_div(c + 1 + k, P) - have
        if need > 0:
            kv.grow(req, need)
    return k


def trim_after_verify(kv: KVManager, req: Request, pages_before: int, reserved_before: int) -> None:
    """Free ``req``'s pages past its sequence (prompt and output) that a verify grew, and
    restore its reservation less the pages it keeps.

    Args:
        kv: the KV manager.
        req: the request (a finished one was released already: nothing to do).
        pages_before: its page count before :func:`grow_for_draft`.
        reserved_before: its ``reserved_pages`` then.
    """
    if req.finished:
        return
    keep = max(pages_before, ceil_div(req.seq_len, kv.page_size))
    dropped = req.pages.truncate(keep)
    if dropped:
        kv.alloc.free(dropped)
    req.reserved_pages = max(0, reserved_before - (len(req.pages) - pages_before))
