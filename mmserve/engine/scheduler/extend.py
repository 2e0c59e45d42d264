"""Jump-forward extends (structured output).

A running request that got several tokens at once (a grammar's jump-forward,
:mod:`mmserve.structured.decode`) holds more than one token without K/V: it leaves the
decode batch for :attr:`Scheduler.extending`, and the next prefill batch computes those
tokens the way a resumed request's are, before any new admission.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mmserve.engine.request import Request
from mmserve.engine.scheduler.admission import PrefillBudget
from mmserve.engine.scheduler.kv_manager import KVManager, ceil_div


def needs_extend(req: Request) -> bool:
    """Whether ``req`` holds more than one token without K/V (a jump-forward appended
    them), so that one decode step cannot compute them."""
    return req.seq_len > req.computed_len + 1


def schedule_extends(
    extending: Sequence[Request],
    kv: KVManager,
    budget: PrefillBudget,
    reserved_pages: Callable[[], int],
    retract: Callable[[Request], None],
) -> list[tuple[Request, int]]:
    """The extends of this prefill batch, within ``budget`` (spent as they are taken).

    Args:
        extending: the requests awaiting an extend, in order.
        kv: the KV manager their pages come from: their decode reservation first, then
            free or evictable pages.
        budget: the batch's budget.
        reserved_pages: pages promised to every active request (called per request: a
            retraction or a taken reservation changes it).
        retract: puts a request the pages do not fit back in the waiting queue (it
            resumes later).

    Returns:
        ``(request, tokens)`` pairs: each request computes tokens
        ``[computed_len, computed_len + tokens)``.
    """
    P = kv.page_size
    batch: list[tuple[Request, int]] = []
    for req in list(extending):
        if budget.tokens <= 0:
            break
        fill = req.seq_len
        need = ceil_div(fill, P) - len(req.pages)
        if need > 0:
            if need > kv.available(reserved_pages() - req.reserved_pages):
                retract(req)
                continue
            kv.grow(req, need)
        n = min(fill - req.computed_len, budget.tokens)
        batch.append((req, n))
        budget.take(n)
    return batch
