"""Watching for a client that hangs up, from the first byte of its request to the last
of the answer.

:class:`DisconnectMiddleware` gives every HTTP request a
:class:`~mmserve.cancel.CancelToken` (the current one while the route runs, see
:mod:`mmserve.cancel`) and cancels it the moment the ASGI server reports
``http.disconnect``:

- while the body is read, through the app's own ``receive`` calls (Starlette then raises
  ``ClientDisconnect``, answered 499);
- once the body is read (the last ``http.request`` message), a watcher task waits on the
  server's ``receive`` for the rest of the request (a disconnect reported after the whole
  response was sent is not a hang-up: the token stays as it is). From then on the app's own
  ``receive`` calls (a ``StreamingResponse`` listening for a disconnect) wait on that
  watcher, so the body is never consumed by anyone but the app and only one task waits
  on the server's channel.

Work for the request checks the token between items (media fetch, decode, hash,
preprocess, template, tokenize: :func:`mmserve.cancel.check_cancelled`) and stops with
:class:`~mmserve.cancel.Cancelled` (answered 499); a submitted request's engine work is
aborted at once (:class:`api.submit.Submission`), and one that reaches the engine after its
client left is never scheduled (:meth:`mmserve.frontend.async_engine.AsyncEngine.deltas`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmserve.cancel import Cancelled, CancelToken, using

#: The scope key holding the request's token.
SCOPE_KEY = "mmserve.cancel"

T = TypeVar("T")


class DisconnectMiddleware:
    """One :class:`~mmserve.cancel.CancelToken` per HTTP request, cancelled when its
    client disconnects (see the module docstring).

    Args:
        app: the wrapped app.
    """

    #: its send wrapper looks only at the last body message (api.sse.BODY_PASSTHROUGH)
    mmserve_body_passthrough = True

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = CancelToken()
        scope[SCOPE_KEY] = token
        watcher: asyncio.Future[Message] | None = None
        answered = False  # the whole response is sent: a disconnect now is no hang-up

        async def watch() -> Message:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    if not answered:  # (a task the route left behind keeps running)
                        token.cancel()
                    return msg

        async def app_receive() -> Message:
            nonlocal watcher
            if watcher is not None:  # the body is read: only the disconnect is left
                return await asyncio.shield(watcher)
            msg = await receive()
            if msg["type"] == "http.disconnect":
                token.cancel()
            elif msg["type"] == "http.request" and not msg.get("more_body", False):
                watcher = asyncio.ensure_future(watch())
            return msg

        async def app_send(msg: Message) -> None:
            nonlocal answered
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                answered = True  # before the send, which wakes the watcher
            await send(msg)

        try:
            with using(token):
                await self.app(scope, app_receive, app_send)
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()


def request_token(http: Request | None) -> CancelToken | None:
    """The :class:`~mmserve.cancel.CancelToken` of ``http`` (None without the middleware
    or without a request)."""
    if http is None:
        return None
    token = http.scope.get(SCOPE_KEY)
    return token if isinstance(token, CancelToken) else None


def cancelled_future(token: CancelToken) -> tuple[asyncio.Future[None], Callable[[], None]]:
    """A future of the running loop resolved when ``token`` is cancelled (at once if it
    is), and the function that unhooks it (call it when done waiting)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def resolve() -> None:
        if not fut.done():
            fut.set_result(None)

    unhook = token.on_cancel(lambda: loop.call_soon_threadsafe(resolve))
    return fut, unhook


async def until_cancelled(events: AsyncIterator[T], token: CancelToken | None) -> AsyncIterator[T]:
    """``events`` until ``token`` is cancelled (the client hung up): then the iterator is
    closed where it waits (a submission's requests are aborted) and the stream ends
    quietly, whether or not the server also stops the response."""
    if token is None:
        async for item in events:
            yield item
        return
    gone, unhook = cancelled_future(token)
    nxt: asyncio.Future[T] | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(events))
            either: set[asyncio.Future[Any]] = {nxt, gone}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return  # the client left: ``finally`` stops ``events`` where it waits
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            except Cancelled:
                if token.cancelled:  # the hang-up reached ``events`` first: as quiet
                    return
                raise
            nxt = None
            yield item
    finally:
        unhook()
        gone.cancel()
        # no await that can suspend here: the response's task may be cancelled already
        if nxt is not None and not nxt.done():
            nxt.cancel()  # thrown into ``events`` where it waits: its ``finally`` runs
        elif nxt is None and (aclose := getattr(events, "aclose", None)) is not None:
            await aclose()  # ``events`` is suspended at a yield: closing runs its finally
