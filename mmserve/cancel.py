"""Cancellation of a request's work once whoever asked for it has gone away.

The HTTP layer makes one :class:`CancelToken` per request and cancels it the moment the
client disconnects (``api/disconnect.py``). Work done for the request checks it between
items (each image fetched, decoded, hashed and preprocessed, each video frame, the chat
template and tokenizing, each engine request built) and stops with :class:`Cancelled`,
which releases what the work held (decoded-image budget, pixel buffers) on the way out.
The token reaches that work through a context variable (:func:`using`,
:func:`check_cancelled`): asyncio tasks and ``run_in_threadpool`` workers copy the context
of their caller, so the checks need no extra argument through every layer. Work without
a token (batch lines, tests, the engine's own callers) is never cancelled.

Thread-safe: a token is cancelled on the event loop and checked on worker threads and the
engine thread.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Cancelled(Exception):
    """The work's requester went away; whatever was built for it is dropped."""


class CancelToken:
    """Set once when the requester of some work goes away.

    Attributes:
        reason: why it was cancelled ("" until it is).
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] = []
        self.reason = ""

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._event.is_set()

    def cancel(self, reason: str = "client disconnected") -> None:
        """Cancel (idempotent): later checks raise, and each callback runs once, here."""
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Run ``callback`` when the token is cancelled (at once if it already is).

        Returns:
            A function that removes the callback (nothing once it has run).
        """
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return lambda: self._remove(callback)
        callback()
        return lambda: None

    def _remove(self, callback: Callable[[], object]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def check(self) -> None:
        """Raise :class:`Cancelled` if the token is cancelled."""
        if self._event.is_set():
            raise Cancelled(self.reason)


_current: contextvars.ContextVar[CancelToken | None] = contextvars.ContextVar(
    "mmserve_cancel", default=None
)


def current() -> CancelToken | None:
    """The token of the work running in this context (None: not cancellable)."""
    return _current.get()


def check_cancelled() -> None:
    """Raise :class:`Cancelled` if the work running in this context was cancelled; a
    no-op without a token. Called between items of a request's preparation.

    Raises:
        Cancelled: the requester went away.
    """
    token = _current.get()
    if token is not None:
        token.check()


@contextmanager
def using(token: CancelToken | None) -> Iterator[CancelToken | None]:
    """Make ``token`` the current one in this context for the ``with`` block (tasks
    and worker threads started inside it inherit it)."""
    reset = _current.set(token)
    try:
        yield token
    finally:
        _current.reset(reset)
