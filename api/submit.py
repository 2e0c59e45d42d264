"""Submitting requests to the engine: the queue limit, metrics, disconnects.

The requests of one :class:`Submission` (``n`` choices, or the questions of one
``/ask``) are read as one stream, and cancelling the submission (client gone) aborts
every request in it: the engine hands their KV to the tree and frees the rest. Each
request's updates wait in its slot, at most one :class:`StreamUpdate`: updates that
arrive while the reader is busy are merged into it (:meth:`StreamUpdate.merged`), so a
slow reader costs no queue of updates and reads all that is new in one update. The
engine's output path tells the submission which slots filled (no task per request), and
the reader takes everything ready at once (:meth:`Submission.batches`): one wake-up per
engine step at most. A submission for an answer that is not streamed (``final_only``:
plain chat and Responses answers, ``/ask``, ``/qa``, batch lines) gets only each
request's last update.

A submission made for an HTTP request whose client has already left is refused
(:class:`~api.errors.ClientDisconnected`, nothing is queued); one whose client leaves
later is cancelled at once by the request's :class:`~mmserve.cancel.CancelToken`
(:mod:`api.disconnect`), whether or not its route is waiting on it.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from fastapi import Request as HTTPRequest

from api.disconnect import cancelled_future, request_token
from api.errors import APIError, ClientDisconnected
from api.metrics import Metrics
from mmserve import cancel
from mmserve.frontend.async_engine import AsyncEngine, SlotStream, StreamUpdate
from mmserve.types import BACKGROUND, EngineRequest, GenerateResult

if TYPE_CHECKING:  # api.tracing imports opentelemetry: only when tracing is on
    from api.tracing import RequestTracing


class EngineClient:
    """Front of the async engine for the routes.

    Args:
        aengine: the running async engine.
        metrics: where finished requests are counted.
        max_queued: most requests waiting for their first token (beyond: 503).
        retry_after: ``Retry-After`` seconds sent with the 503.
        tracing: spans of the submitted requests (:mod:`api.tracing`), None when off.
    """

    def __init__(
        self,
        aengine: AsyncEngine,
        metrics: Metrics,
        max_queued: int,
        retry_after: int,
        tracing: RequestTracing | None = None,
    ) -> None:
        self.aengine = aengine
        self.metrics = metrics
        self.tracing = tracing
        self.max_queued = max_queued
        self.retry_after = retry_after
        self.queued = 0
        #: online (not batch-job) requests submitted and not yet finished; batch jobs
        #: (:mod:`api.batch.runner`) shrink their in-flight window while it is above zero
        self.online = 0
        #: tokens per streamed chunk (``--stream-interval``; :class:`Submission`)
        self.stream_interval = 1
        self._freed: list[asyncio.Future[None]] = []

    def submit(
        self, reqs: Sequence[EngineRequest], background: bool = False, final_only: bool = False
    ) -> Submission:
        """Start ``reqs`` (all or none).

        One call is always admitted into an empty queue, so a large ``n`` or many
        questions cannot be refused forever. ``background`` marks batch-job work: it runs
        at the engine's :data:`~mmserve.types.BACKGROUND` priority (admitted
        after waiting interactive requests) and is not counted in :attr:`online`.
        ``final_only``: the answer is not streamed; each request yields only its last
        update (:class:`Submission`), and its text is not built token by token.

        Runs under the current :class:`~mmserve.cancel.CancelToken` (the HTTP request's):
        cancelling it aborts the submission's requests.

        Raises:
            ClientDisconnected: the token is already cancelled (the client left while
                the request was prepared): nothing is submitted.
            APIError: 503 with ``Retry-After`` when the queue is full, or
                ``engine_unhealthy`` while no engine can take requests (the engine process
                died and a new one is not ready yet, or none is left).
        """
        token = cancel.current()
        if token is not None and token.cancelled:
            raise ClientDisconnected(token.reason)
        not_serving = getattr(self.aengine, "not_serving", None)  # a replica client has none
        down = not_serving() if not_serving is not None else None
        if down is not None:
            raise APIError(
                503,
                f"engine unavailable: {down}; retry after {self.retry_after} s",
                "server_error",
                code="engine_unhealthy",
                headers={"Retry-After": str(self.retry_after)},
            )
        if self.queued and self.queued + len(reqs) > self.max_queued:
            self.metrics.rejected.inc()
            raise APIError(
                503,
                f"server busy: {self.queued} requests are waiting (limit "
                f"{self.max_queued}); retry after {self.retry_after} s",
                "server_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after)},
            )
        if background:
            reqs = [dataclasses.replace(r, priority=max(r.priority, BACKGROUND)) for r in reqs]
        self._set_queued(self.queued + len(reqs))
        if self.tracing is not None:
            self.tracing.submitted(reqs)
        return Submission(self, reqs, background, final_only)

    def capacity_freed(self) -> asyncio.Future[None]:
        """A future resolved the next time capacity frees: a queued request starts or
        ends, or an online request ends. The batch runner awaits it (instead of polling)
        for room in its window or in the queue; cancelling it is fine."""
        fut = asyncio.get_running_loop().create_future()
        self._freed = [f for f in self._freed if not f.done()]
        self._freed.append(fut)
        return fut

    def _capacity_freed(self) -> None:
        waiters, self._freed = self._freed, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def _set_queued(self, n: int) -> None:
        freed = n < self.queued
        self.queued = n
        self.metrics.queue_length.set(n)
        if freed:
            self._capacity_freed()

    def failure(self, result: GenerateResult) -> APIError | None:
        """The 500 answered for a request whose batch failed (names the request id), or
        None when ``result`` was not cut short by a failed engine step."""
        if result.finish_reason != "error":
            return None
        return APIError(
            500,
            f"request {result.rid} failed: {result.error or 'engine error'}; the server log "
            "has the traceback",
            "server_error",
            code="engine_error",
        )


class Submission:
    """Requests running together; their updates arrive as ``(index, StreamUpdate)``.

    A request whose engine stream is a :class:`~mmserve.frontend.async_engine.SlotStream`
    (the in-process engine's and the engine process's) is read straight from its slot:
    the engine's output path tells the submission when a slot has an update (no task
    per request, no future per update), so a reader wakes at most once per engine step
    for all of its requests, and a reader that is behind finds each request's updates
    merged into one. Any other stream (a replica client's) is pumped by a task of its own
    into a slot here, merged the same way.

    A streamed submission whose client has ``stream_interval`` N > 1 lists a request for
    its reader at its first update, its last, and whenever N or more new output ids have
    merged since its last read; so a chunk carries N tokens (more when its reader is
    behind), the same text in fewer chunks.

    Args:
        client: the engine client that admitted them.
        reqs: the engine requests (one per choice or question).
        background: batch-job work (not counted as online).
        final_only: yield only each request's last update (the answer is not streamed;
            its collector skips per-token text work).
    """

    def __init__(
        self,
        client: EngineClient,
        reqs: Sequence[EngineRequest],
        background: bool = False,
        final_only: bool = False,
    ) -> None:
        self.client = client
        self.background = background
        self.final_only = final_only
        if not background:
            client.online += len(reqs)
        self.reqs = list(reqs)
        n = len(reqs)
        self.results: list[GenerateResult | None] = [None] * n
        # pumped streams' updates not yet read, merged; _ready: requests with an update
        # to read, in the order they got one (each at most once: _listed)
        self._slots: list[StreamUpdate | None] = [None] * n
        self._ready: deque[int] = deque()
        self._listed = [False] * n
        self._waiting = [True] * n  # no update yet (counted in the client's queue)
        self._ended = [False] * n  # finished or cancelled: counted out of the client
        self._streams: list[SlotStream | None] = [None] * n
        # --stream-interval: a request's reader wakes every `_interval` ids (_read: it
        # has been listed once, so its first token went out at once)
        self._interval = 1 if final_only else client.stream_interval
        self._read = [False] * n
        self._tasks: list[asyncio.Future[None]] = []
        self._error: BaseException | None = None
        self._cancelled = False
        self._wake: asyncio.Future[None] | None = None
        self._context = contextvars.copy_context()
        self._unhook: Callable[[], None] | None = None
        for i, r in enumerate(reqs):
            try:
                stream = client.aengine.stream(r, final_only)
                if isinstance(stream, SlotStream):
                    self._streams[i] = stream
                    stream.start(functools.partial(self._slot_ready, i))
                else:
                    self._tasks.append(asyncio.ensure_future(self._pump(i, stream)))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                self._error = self._error or e
                self._end(i)
        token = cancel.current()
        if token is not None and not all(self._ended):  # the client leaves: abort every
            # request now; removed once all have ended (a WebSocket's token outlives
            # many submissions, which the hook would otherwise keep alive)
            loop = asyncio.get_running_loop()
            self._unhook = token.on_cancel(lambda: loop.call_soon_threadsafe(self.cancel))

    # ---- bookkeeping, once per request --------------------------------------------
    def _started(self, index: int) -> None:
        if self._waiting[index]:
            self._waiting[index] = False
            self.client._set_queued(self.client.queued - 1)

    def _finished(self, index: int, result: GenerateResult) -> None:
        if self.results[index] is None:
            self.results[index] = result
            self.client.metrics.observe(result)
            if self.client.tracing is not None:  # in the HTTP request's context (its span):
                # a slot's listener runs in the engine output path's
                self._context.run(self.client.tracing.finished, self.reqs[index], result)
        self._end(index)

    def _end(self, index: int) -> None:
        if self._ended[index]:
            return
        self._ended[index] = True
        if not self.background:
            self.client.online -= 1
            self.client._capacity_freed()
        if self._waiting[index]:
            self._waiting[index] = False
            self.client._set_queued(self.client.queued - 1)
        if self.results[index] is None:  # cancelled: the engine aborts it
            self.client.metrics.requests.labels("abort").inc()
        if self._unhook is not None and all(self._ended):
            self._unhook()
            self._unhook = None

    def _list(self, index: int, pending: int = 0) -> None:
        """Put request ``index`` on the reader's list (once until read), unless
        ``pending`` (its new ids not yet read) is under the stream interval and it has
        neither its first update nor its result to give."""
        if 0 < pending < self._interval and self._read[index] and self.results[index] is None:
            return
        self._read[index] = True
        if not self._listed[index]:
            self._listed[index] = True
            self._ready.append(index)
            self._notify()

    def _slot_ready(self, index: int) -> None:
        """A :class:`SlotStream`'s slot has an update (called by the engine's output path)."""
        self._started(index)
        stream = self._streams[index]
        assert stream is not None
        col = stream.slot.collector
        if col is not None and col.result is not None and self.results[index] is None:
            self._finished(index, col.result)
            stream.close()  # unregistered; a stop string's request is aborted now
        self._list(index, stream.slot.pending_ids() if self._interval > 1 else 0)

    def _put(self, index: int, upd: StreamUpdate) -> None:
        held = self._slots[index]
        upd = self._slots[index] = upd if held is None else held.merged(upd)
        self._list(index, len(upd.delta_ids) if self._interval > 1 else 0)

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _pump(self, index: int, stream: AsyncIterator[StreamUpdate]) -> None:
        try:
            async for upd in stream:
                self._started(index)
                if upd.result is not None:
                    self._finished(index, upd.result)
                self._put(index, upd)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            if self._error is None:
                self._error = e
            self._notify()
        finally:
            self._end(index)

    def _take(self, index: int) -> StreamUpdate | None:
        self._listed[index] = False
        stream = self._streams[index]
        if stream is not None:
            return stream.poll()
        upd, self._slots[index] = self._slots[index], None
        return upd

    # ---- reading ------------------------------------------------------------------
    async def batches(self) -> AsyncIterator[list[tuple[int, StreamUpdate]]]:
        """Every request's updates until all have finished, as lists: each list is
        everything ready when this reader looked (requests in the order their slots
        filled, each request's updates since its last look merged into one), so a
        reader writes once per wake-up (the last update read of a request carries its
        result).

        Closing the iterator early cancels the submission. Raises
        :class:`~api.errors.ClientDisconnected` once the submission is cancelled (its
        client left) while requests are unfinished.
        """
        remaining = len(self.reqs)
        ready = self._ready
        try:
            while remaining:
                if self._error is not None:
                    raise self._error
                if self._cancelled:
                    raise ClientDisconnected("the submission was cancelled")
                if not ready:
                    self._wake = asyncio.get_running_loop().create_future()
                    try:
                        await self._wake
                    finally:
                        self._wake = None
                    continue
                batch = []
                while ready:
                    index = ready.popleft()
                    upd = self._take(index)
                    if upd is None:
                        continue
                    if upd.result is not None:
                        remaining -= 1
                    batch.append((index, upd))
                if batch:
                    yield batch
        finally:
            if remaining:
                self.cancel()

    async def updates(self) -> AsyncIterator[tuple[int, StreamUpdate]]:
        """Every request's updates until all have finished, one at a time (as
        :meth:`batches` gives them): requests in the order their slots filled, each
        slot's updates merged into one while this reader was busy (the last one read
        from a slot carries its result).

        Closing the iterator early cancels the submission.
        """
        batches = self.batches()
        try:
            async for batch in batches:
                for item in batch:
                    yield item
        finally:
            await batches.aclose()

    async def wait(self, http: HTTPRequest | None = None) -> list[GenerateResult]:
        """All results, in request order; cancels everything if ``http``'s client disconnects
        (its :class:`~mmserve.cancel.CancelToken` when :mod:`api.disconnect` gave it one).

        Raises:
            ClientDisconnected: the client went away first.
        """

        async def collect() -> None:
            async for _ in self.updates():
                pass

        gather = asyncio.ensure_future(collect())
        try:
            if http is None:
                await gather
            else:
                token = request_token(http)
                if token is not None:
                    gone, unhook = cancelled_future(token)
                else:
                    gone, unhook = asyncio.ensure_future(_disconnected(http)), lambda: None
                try:
                    await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    unhook()
                    gone.cancel()
                if not gather.done():
                    self.cancel()
                    raise ClientDisconnected
                gather.result()
        finally:
            # cancelled from outside (the HTTP request was): the collector must not
            # outlive this call, waiting on its queue until garbage-collected mid-await
            if not gather.done():
                gather.cancel()
        return [r for r in self.results if r is not None]

    async def answers(self, http: HTTPRequest | None = None) -> list[GenerateResult]:
        """All results, in request order, as a route answers them (:meth:`wait`).

        Raises:
            ClientDisconnected: ``http``'s client went away first (the app answers 499).
            APIError: 500 ``engine_error`` for the first request whose batch failed.
        """
        results = await self.wait(http)
        for r in results:
            if (err := self.client.failure(r)) is not None:
                raise err
        return results

    def cancel(self) -> None:
        """Abort every request still running (their pages go to the tree or the free list);
        a reader waiting in :meth:`batches` raises
        :class:`~api.errors.ClientDisconnected`."""
        self._cancelled = True
        for i, stream in enumerate(self._streams):
            if stream is not None:
                stream.close()
                self._end(i)
        for t in self._tasks:
            t.cancel()
        self._notify()


async def _disconnected(http: HTTPRequest) -> None:
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return
