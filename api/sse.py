"""Writing a server-sent-event answer with as little work per event as the ASGI stack
allows.

A streamed chat answer is hundreds of small body messages per response, each of which
Starlette's ``StreamingResponse`` would pass through every ``send`` wrapper of the
middleware stack (Starlette's error and exception middleware, FastAPI's route wrapper,
:class:`~api.disconnect.DisconnectMiddleware`) and through two more async generators.
Those wrappers only act on the first message (``http.response.start``: "a response has
begun") and the last one (``more_body`` false: "the answer is complete"), so
:class:`EventStreamResponse` sends those two through the stack as before and every body
message between them straight to the server's own ``send``, which :class:`FastSendApp`
keeps in the request's scope (:data:`RAW_SEND`) when no layer needs to see them
(tracing off, and every middleware class marked :data:`BODY_PASSTHROUGH`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mmserve.cancel import Cancelled, CancelToken

#: The scope key holding the ASGI server's own ``send`` (set by :class:`FastSendApp`).
RAW_SEND = "mmserve.raw_send"
#: A middleware class with this attribute set true passes every ``http.response.body``
#: message but the last through unchanged (it may look at the start and the last one).
BODY_PASSTHROUGH = "mmserve_body_passthrough"
#: Headers of a server-sent-event answer (no proxy buffering, no caching).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class FastSendApp(FastAPI):
    """FastAPI that hands :class:`EventStreamResponse` the server's ``send`` for the
    body messages between an answer's first and last, where nothing in between needs
    them: tracing off (FastAPI's telemetry wraps ``send``) and every user middleware
    class marked :data:`BODY_PASSTHROUGH`. Otherwise it is plain FastAPI.

    Args:
        fast_send: False turns the bypass off (tracing on).
        **kwargs: FastAPI's arguments.
    """

    def __init__(self, *, fast_send: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_send = fast_send
        self._bypass: bool | None = None  # decided at the first request

    def _can_bypass(self) -> bool:
        telemetry = getattr(self, "_native_telemetry", None)
        if telemetry is None or telemetry.enabled():
            return False
        return self.fast_send and all(
            getattr(m.cls, BODY_PASSTHROUGH, False) for m in self.user_middleware
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._bypass is None:
                self._bypass = self._can_bypass()
            if self._bypass:
                scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


class EventStreamResponse(Response):
    """A ``text/event-stream`` answer of ``events`` (each string one write, UTF-8).

    The start and the last (empty) body message go through the middleware stack's
    ``send``; the events go to the server's ``send`` when :class:`FastSendApp` left it
    in the scope (else through the stack too). The stream ends quietly when ``token`` is
    cancelled (the client hung up: checked before each write, and
    :class:`~mmserve.cancel.Cancelled` raised where ``events`` waits is the end), and
    ``events`` is closed in every case (a submission's reader cancels its requests). A
    write that fails with ``OSError`` is the client gone (``ClientDisconnect``, as
    Starlette's ``StreamingResponse`` answers it).

    Args:
        events: the events, already framed (``data: ...\\n\\n``).
        token: the request's cancel token (:func:`api.disconnect.request_token`), or None.
        headers: the response's headers beside its content type (default
            :data:`SSE_HEADERS`).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        token: CancelToken | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.events = events
        self.token = token
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS if headers is None else headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        write = scope.get(RAW_SEND) or send
        token, events = self.token, self.events
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for event in events:
                    if token is not None and token.cancelled:
                        break
                    await write(
                        {"type": "http.response.body", "body": event.encode(), "more_body": True}
                    )
            except Cancelled:
                if token is None or not token.cancelled:
                    raise
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError as e:
            raise ClientDisconnect() from e
