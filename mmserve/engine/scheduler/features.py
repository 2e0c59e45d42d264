"""Remote image features loaded off the engine step (an encoder service, ``--encoders``).

A waiting request with images whose features are neither on the request nor in the
embedding cache asks the feature source for them on a worker thread when admission
first reaches it; until the answer is in, the request is "loading", as one whose KV
pages are read from disk (:mod:`mmserve.cache.kv_tiers`): admission skips it and the
other requests go on decoding and being admitted. :meth:`FeatureLoads.poll` (at each
admission) takes the finished answers in; the model runner then reads them as its
feature source (:meth:`FeatureLoads.__call__`, a dictionary lookup that never waits). An
item the source did not answer (None, an error) is encoded by the runner's own tower.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mmserve.engine.request import Request

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: A feature source: the items' features (``[tokens, text_hidden]``) or None per item;
#: may block (a remote fetch of up to :data:`mmserve.fleet.encoder.ENCODE_SECONDS`).
FeatureSource = Callable[[list[Any]], Sequence["torch.Tensor | None"]]


class FeatureLoads:
    """Fetches of remote image features for waiting requests, on worker threads.

    Args:
        source: the blocking feature source (called on a worker thread, never on the
            engine's).
        cached: whether the engine's embedding cache holds an item's features (by key).
        workers: fetches at once.

    Attributes:
        started: fetches started (one per request and admission attempt that needed one).
        fetched: items whose features the source gave.
    """

    def __init__(
        self, source: FeatureSource, cached: Callable[[bytes], bool], workers: int = 4
    ) -> None:
        self.source = source
        self.cached = cached
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="feature-load")
        self._jobs: dict[str, tuple[list[Any], cf.Future]] = {}
        self._tried: set[str] = set()
        # key -> (features, ids of the live requests they are kept for)
        self._ready: dict[bytes, tuple[torch.Tensor, set[str]]] = {}
        self.started = 0
        self.fetched = 0

    def _missing(self, req: Request) -> list[Any]:
        """``req``'s items without features anywhere (request, cache, fetched), once each."""
        out: dict[bytes, Any] = {}
        for span in req.spans:
            im = span.image
            if im.features is None and im.key not in self._ready and not self.cached(im.key):
                out.setdefault(im.key, im)
        return list(out.values())

    def start(self, req: Request) -> bool:
        """Start fetching ``req``'s missing features (once per request until
        :meth:`forget`); True when a fetch started (``req`` is loading)."""
        if req.rid in self._tried or not req.spans:
            return False
        self._tried.add(req.rid)
        items = self._missing(req)
        if not items:
            return False
        self._jobs[req.rid] = (items, self._pool.submit(self.source, items))
        self.started += 1
        return True

    def is_loading(self, req: Request) -> bool:
        """Whether ``req`` waits for a fetch."""
        return req.rid in self._jobs

    def poll(self) -> int:
        """Take in the finished fetches (engine thread); returns how many finished."""
        done = [rid for rid, (_, fut) in self._jobs.items() if fut.done()]
        for rid in done:
            items, fut = self._jobs.pop(rid)
            try:
                got = list(fut.result())
            except Exception as e:  # noqa: BLE001 - the tower runs for these items
                log.warning("feature fetch for %s failed (%s); own tower", rid, e)
                continue
            for im, f in zip(items, got, strict=True):
                if f is None:
                    continue
                self.fetched += 1
                feats, owners = self._ready.setdefault(im.key, (f, set()))
                owners.add(rid)
        return len(done)

    def __call__(self, items: list[Any]) -> list[torch.Tensor | None]:
        """The model runner's feature source: the fetched features of ``items`` (None:
        not fetched, the tower runs). Never waits."""
        return [got[0] if (got := self._ready.get(im.key)) else None for im in items]

    def pending(self) -> int:
        """Fetches in flight."""
        return len(self._jobs)

    def wait(self, timeout: float) -> None:
        """Block until a fetch finishes or ``timeout`` seconds pass."""
        if self._jobs:
            cf.wait([f for _, f in self._jobs.values()], timeout, cf.FIRST_COMPLETED)

    def forget(self, req: Request) -> None:
        """``req`` was admitted (a later admission may fetch again)."""
        self._tried.discard(req.rid)

    def drop(self, req: Request) -> None:
        """``req`` left: its fetch (if in flight) is no longer waited for, and features
        kept only for it are released."""
        self._tried.discard(req.rid)
        self._jobs.pop(req.rid, None)
        for key in [k for k, (_, owners) in self._ready.items() if req.rid in owners]:
            owners = self._ready[key][1]
            owners.discard(req.rid)
            if not owners:
                del self._ready[key]

    def close(self) -> None:
        """Stop the workers (fetches in flight are not waited for)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
