"""Drives an :class:`~mmserve.frontend.frontend.Engine` from a background thread for
asyncio callers.

Requests from many HTTP handlers land in one inbox; the engine thread drains it
before every step, so their tokens share batches. The engine thread hands each
request's :class:`~mmserve.types.TokenDelta` to the caller's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``; text, stop strings and
results are built there, on the event loop, by an
:class:`~mmserve.frontend.output.OutputCollector`, never on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from mmserve import cancel
from mmserve.frontend.frontend import Engine
from mmserve.frontend.output import StreamUpdate
from mmserve.types import EngineRequest, GenerateResult, TokenDelta

T = TypeVar("T")

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "StreamUpdate"]


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
            for req in self.engine.live_requests():
                if req.on_update is not None:
                    req.on_update(
                        TokenDelta(
                            req.rid,
                            (),
                            None,
                            time.perf_counter(),
                            finish_reason="error",
                            error=message,
                        )
                    )

    def consecutive_failures(self) -> int:
        """Engine steps that failed in a row (0 after any step succeeds)."""
        return self.engine.stats.consecutive_failed_steps

    async def deltas(self, req: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        """Submit ``req`` and yield its :class:`TokenDelta` messages, the last with its
        finish reason. Closing the iterator early aborts the request (its KV is kept).

        Under a :class:`~mmserve.cancel.CancelToken` (the current one: the HTTP request's)
        the request is aborted on the engine thread as soon as the token is cancelled,
        before the engine's next step, and one whose token is cancelled by the time the
        engine thread takes it in is aborted before any step: never scheduled, no tower
        run, no token."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        token = cancel.current()

        def on_update(delta: TokenDelta) -> None:  # on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, delta)

        def add() -> None:  # on the engine thread, between steps
            self.engine.add_request(req, on_update)
            if token is not None and token.cancelled:
                self.engine.abort(req.rid)  # its client left on the way: it never runs

        self.call(add)
        unhook = (
            token.on_cancel(lambda: self.call(lambda: self.engine.abort(req.rid)))
            if token is not None
            else None
        )
        done = False
        try:
            while not done:
                delta = await queue.get()
                done = delta.finished
                yield delta
        finally:
            if unhook is not None:
                unhook()
            if not done:
                self.call(lambda: self.engine.abort(req.rid))

    async def stream(
        self, req: EngineRequest, final_only: bool = False
    ) -> AsyncIterator[StreamUpdate]:
        """Submit ``req`` and yield its updates (new text and ids); the last one carries
        the result. ``final_only``: only that one (its collector skips per-token text work).

        A stop string found in the text ends the request in the engine (an abort that
        keeps its KV). If the consumer stops early (client disconnect), the request is
        aborted.
        """
        col = self.engine.collector(req, final_only)
        deltas = self.deltas(req)
        try:
            async for delta in deltas:
                upd = col.add(delta)
                if upd is None:
                    continue
                yield upd
                if upd.result is not None:
                    return
        finally:
            await deltas.aclose()  # aborts the engine request unless it had finished

    async def generate(self, req: EngineRequest, final_only: bool = False) -> GenerateResult:
        """Submit ``req`` and wait for its result (``final_only``: as :meth:`stream`)."""
        result = None
        async for upd in self.stream(req, final_only):
            result = upd.result
        assert result is not None
        return result


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
