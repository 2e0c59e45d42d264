"""Drives an :class:`~mmserve.frontend.frontend.Engine` from a background thread for
asyncio callers.

Requests from many HTTP handlers land in one inbox; the engine thread drains it
before every step, so their tokens share batches. After each step the engine thread
hands the step's :class:`~mmserve.types.TokenDelta` s of every request to the event
loop in one ``loop.call_soon_threadsafe`` (the engine's ``on_outputs``); there each
goes into its request's :class:`Slot`, where an
:class:`~mmserve.frontend.output.OutputCollector` builds text, stop strings and the
result (never on the engine thread) and updates merge until the consumer takes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from mmserve import cancel
from mmserve.engine.process import CONTROL_CALLS
from mmserve.frontend.frontend import Engine
from mmserve.frontend.output import OutputCollector, StreamUpdate
from mmserve.types import EngineRequest, GenerateResult, TokenDelta

T = TypeVar("T")

log = logging.getLogger(__name__)

__all__ = ["CONTROL_CALLS", "AsyncEngine", "Slot", "SlotStream", "StreamUpdate", "merge_updates"]


class AsyncEngine:
    """Thread-safe front of an engine.

    Args:
        engine: the engine to drive; only the engine thread touches it after :meth:`start`.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: list[Callable[[], object]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="mmserve-engine", daemon=True)
        self.error: BaseException | None = None
        self._slots: dict[str, Slot] = {}  # rid -> its slot, touched on the event loop
        self._loops: set[asyncio.AbstractEventLoop] = set()
        engine.on_outputs = self._post  # one batch of deltas per step

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread and wait for it (seconds: up to 30)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def call(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the engine thread before its next step."""
        with self._cv:
            self._inbox.append(fn)
            self._cv.notify()

    async def run_on_engine(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and await its return value (or exception)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def task() -> None:
            try:
                value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(_set_exc, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, value)

        self.call(task)
        return await fut

    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                while not self._inbox and not self._stop and not eng.has_work():
                    self._cv.wait()
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
            for fn in inbox:
                fn()
            if eng.has_work():
                try:
                    eng.step()  # a failing batch is contained inside step
                except Exception as e:  # a scheduler bug must not hang clients
                    log.exception("engine step failed outside a batch; ending every request")
                    self.error = e
                    eng.stats.failed_steps += 1
                    eng.stats.consecutive_failed_steps += 1
                    self._abort_all(f"{type(e).__name__} in the engine")

    def _abort_all(self, message: str) -> None:
        try:
            self.engine.abort_all("error", message)
        except Exception:  # state may be broken; still answer every client
            log.exception("abort_all failed")
            now = time.perf_counter()
            self._post(
                [
                    TokenDelta(req.rid, (), None, now, finish_reason="error", error=message)
                    for req in self.engine.live_requests()
                ]
            )

    def consecutive_failures(self) -> int:
        """Engine steps that failed in a row (0 after any step succeeds)."""
        return self.engine.stats.consecutive_failed_steps

    def fatal_error(self) -> str | None:
        """Why the engine can serve nothing any more (a tensor-parallel rank died), else None."""
        return self.engine.fatal_error()

    def not_serving(self) -> str | None:
        """Why a new request cannot start now (as :meth:`fatal_error`), else None."""
        return self.engine.fatal_error()

    async def control(self, name: str, *args: object) -> object:
        """Call the engine's control method ``name`` (one of :data:`CONTROL_CALLS`) on the
        engine thread and await its value: the same call the engine process answers as a
        message (:class:`~mmserve.frontend.engine_client.EngineProcessClient.control`).

        Raises:
            ValueError: ``name`` is not a control call; whatever the method raises.
        """
        if name not in CONTROL_CALLS:
            raise ValueError(f"unknown control call {name!r}")
        fn = getattr(self.engine, name)
        return await self.run_on_engine(lambda: fn(*args))

    # ---- output path: one post per step, one merging slot per request -----------
    def _post(self, deltas: list[TokenDelta]) -> None:
        """The engine's :attr:`~mmserve.engine.engine.EngineCore.on_outputs` (engine
        thread): one ``call_soon_threadsafe`` per step and event loop, whatever the batch."""
        for loop in list(self._loops):
            try:
                loop.call_soon_threadsafe(self._dispatch, deltas)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                self._loops.discard(loop)

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        """Each delta into its request's slot (on the event loop)."""
        slots = self._slots
        for d in deltas:
            slot = slots.get(d.rid)
            if slot is not None:
                slot.deliver(d)

    def _open(self, req: EngineRequest, slot: Slot) -> Callable[[], None] | None:
        """Register ``slot`` and queue ``req`` on the engine thread; returns the cancel
        token's unhook (None without a token)."""
        self._loops.add(asyncio.get_running_loop())
        self._slots[req.rid] = slot
        token = cancel.current()

        def add() -> None:  # on the engine thread, between steps
            self.engine.add_request(req)
            if token is not None and token.cancelled:
                self.engine.abort(req.rid)  # its client left on the way: it never runs

        self.call(add)
        if token is None:
            return None
        return token.on_cancel(lambda: self.call(lambda: self.engine.abort(req.rid)))

    def _close(self, rid: str, slot: Slot, unhook: Callable[[], None] | None) -> None:
        if unhook is not None:
            unhook()
        if self._slots.get(rid) is slot:
            del self._slots[rid]
        if not slot.engine_done:  # consumer gone early, or a stop string: abort (KV kept)
            self.call(lambda: self.engine.abort(rid))

    async def deltas(self, req: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        """Submit ``req`` and yield its :class:`TokenDelta` messages, the last with its
        finish reason. Closing the iterator early aborts the request (its KV is kept).

        Under a :class:`~mmserve.cancel.CancelToken` (the current one: the HTTP request's)
        the request is aborted on the engine thread as soon as the token is cancelled,
        before the engine's next step, and one whose token is cancelled by the time the
        engine thread takes it in is aborted before any step: never scheduled, no tower
        run, no token."""
        slot = Slot(None)
        unhook = self._open(req, slot)
        try:
            while True:
                for delta in await slot.take_deltas():
                    yield delta
                    if delta.finished:
                        return
        finally:
            self._close(req.rid, slot, unhook)

    def stream(self, req: EngineRequest, final_only: bool = False) -> SlotStream:
        """Submit ``req`` and yield its updates (new text and ids); the last one carries
        the result. Updates that arrive while the consumer is busy are merged into one
        (:func:`merge_updates`); with ``final_only`` only the last (merged) one is yielded.

        The request is submitted when the stream is first iterated (or
        :meth:`SlotStream.start` is called: a reader told of each update instead of
        awaiting it, as :class:`api.submit.Submission` is).

        A stop string found in the text ends the request in the engine (an abort that
        keeps its KV). If the consumer stops early (client disconnect), the request is
        aborted. Cancellation under a token as :meth:`deltas`.
        """
        slot = Slot(collector_for(self.engine, req, final_only), final_only)

        def open_() -> Callable[[], None]:
            unhook = self._open(req, slot)
            return lambda: self._close(req.rid, slot, unhook)

        return SlotStream(slot, open_)

    async def generate(self, req: EngineRequest, final_only: bool = True) -> GenerateResult:
        """Submit ``req`` and wait for its result (final-only by default: no per-token
        text work)."""
        result = None
        async for upd in self.stream(req, final_only):
            result = upd.result
        assert result is not None
        return result


def collector_for(front, req: EngineRequest, final_only: bool) -> OutputCollector:
    """``front.collector(req)``, final-only when asked (one update, with the result)."""
    return front.collector(req, final_only)


def merge_updates(a: StreamUpdate, b: StreamUpdate) -> StreamUpdate:
    """Two consecutive updates of one request as one (:meth:`StreamUpdate.merged`)."""
    return a.merged(b)


class Slot:
    """One request's mailbox on the event loop: deltas (or, with a collector, the updates
    they make) merge here until the consumer takes them, so a slow consumer wakes once
    for everything since its last look (no per-token queue).

    Args:
        collector: turns deltas into updates (None: raw deltas are kept, for replicas).
        final_only: wake the consumer only for the result.

    Attributes:
        engine_done: the engine has finished the request (its last delta arrived).
    """

    def __init__(self, collector: OutputCollector | None, final_only: bool = False) -> None:
        self.collector = collector
        self.final_only = final_only
        self.engine_done = False
        #: called (on the event loop, instead of waking an awaiting :meth:`take`) each
        #: time an update is ready to be taken with :meth:`poll`
        self.listener: Callable[[], None] | None = None
        self._update: StreamUpdate | None = None
        self._deltas: list[TokenDelta] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, delta: TokenDelta) -> None:
        """Take ``delta`` (on the event loop)."""
        if delta.finished:
            self.engine_done = True
        col = self.collector
        if col is None:
            self._deltas.append(delta)
            ready = True
        else:
            upd = col.add(delta)
            if upd is None:
                return
            held = self._update
            self._update = upd if held is None else held.merged(upd)
            ready = upd.result is not None or not self.final_only
        if ready:
            if self.listener is not None:
                self.listener()
            elif self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    def deliver(self, delta: TokenDelta) -> None:
        """:meth:`push`, and if taking ``delta`` raises (detokenizing, a stop string, the
        listener's metrics), end this request with that error and not the step's other
        requests, whose deltas come in the same loop."""
        try:
            self.push(delta)
        except Exception as e:
            log.exception("request %s: its output could not be processed", delta.rid)
            running = not delta.finished
            with contextlib.suppress(Exception):
                self.fail(f"its output could not be processed: {type(e).__name__}: {e}")
            self.engine_done = not running  # still running: closing it aborts it

    def fail(self, error: str) -> None:
        """End the request with an error (the engine is gone)."""
        self.engine_done = True
        if self.collector is None:
            return
        if self.collector.result is None:
            upd = self.collector.fail(error)
            self._update = upd if self._update is None else merge_updates(self._update, upd)
        if self.listener is not None:
            self.listener()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def pending_ids(self) -> int:
        """Output ids merged here and not yet taken (raw deltas: how many are held)."""
        upd = self._update
        return len(upd.delta_ids) if upd is not None else len(self._deltas)

    def poll(self) -> StreamUpdate | None:
        """Everything merged since the last call, or None when nothing is ready (with
        ``final_only``: until the result); never waits."""
        upd = self._update
        if upd is None or (self.final_only and upd.result is None):
            return None
        self._update = None
        return upd

    async def take(self) -> StreamUpdate:
        """Everything merged since the last call (waits for at least one update)."""
        while self._update is None or (self.final_only and self._update.result is None):
            await self._wait()
        upd, self._update = self._update, None
        return upd

    async def updates(self) -> AsyncIterator[StreamUpdate]:
        """:meth:`take` until the update that carries the result (that one included)."""
        while True:
            upd = await self.take()
            yield upd
            if upd.result is not None:
                return

    async def take_deltas(self) -> list[TokenDelta]:
        """Every delta since the last call (waits for at least one)."""
        while not self._deltas:
            await self._wait()
        out, self._deltas = self._deltas, []
        return out


class SlotStream:
    """The updates of one submitted request, read from its :class:`Slot`: what
    :meth:`AsyncEngine.stream` and
    :meth:`~mmserve.frontend.engine_client.EngineProcessClient.stream` return.

    Iterate it (``async for``: each update, merged while the consumer was busy, until the
    one with the result), or :meth:`start` it with a listener and :meth:`poll` when told:
    the engine's output path then calls the listener (no task, no future per update), so
    a reader of many requests (:class:`api.submit.Submission`) wakes once per step.

    Args:
        slot: the request's slot.
        open_: registers the slot and submits the request; returns what ends it
            (unregister, and abort unless the engine has finished it).
    """

    def __init__(self, slot: Slot, open_: Callable[[], Callable[[], None]]) -> None:
        self.slot = slot
        self._open: Callable[[], Callable[[], None]] | None = open_
        self._close: Callable[[], None] | None = None
        self._done = False

    def start(self, listener: Callable[[], None] | None = None) -> None:
        """Submit the request (once); ``listener`` is called whenever an update is ready
        for :meth:`poll` (see :attr:`Slot.listener`)."""
        if self._open is None:
            return
        if listener is not None:
            self.slot.listener = listener
        opener, self._open = self._open, None
        self._close = opener()

    def poll(self) -> StreamUpdate | None:
        """The update ready now (:meth:`Slot.poll`); the request is closed once it is the
        one with the result."""
        upd = self.slot.poll()
        if upd is not None and upd.result is not None:
            self.close()
        return upd

    def close(self) -> None:
        """End the request: unregister its slot and abort it in the engine unless it
        finished there (its KV is kept). Later iteration ends; idempotent."""
        self._done = True
        self._open = None
        self.slot.listener = None  # the reader's callback: no cycle outlives the request
        close, self._close = self._close, None
        if close is not None:
            close()

    async def aclose(self) -> None:
        """:meth:`close` (the async generator's name for it)."""
        self.close()

    def __aiter__(self) -> SlotStream:
        return self

    async def __anext__(self) -> StreamUpdate:
        if self._done:
            raise StopAsyncIteration
        self.start()
        try:
            upd = await self.slot.take()
        except BaseException:  # cancelled where it waits: the request is aborted
            self.close()
            raise
        if upd.result is not None:
            self.close()
        return upd

    def __del__(self) -> None:  # dropped unfinished (a reader that broke out of a loop)
        if self._close is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - at collection: the loop may be closed
                pass


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
