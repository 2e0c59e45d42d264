"""Request body size limit: a 413 before a huge body is read into memory."""

from __future__ import annotations

import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes``: by ``Content-Length`` up front, else while reading.

    Args:
        app: the wrapped app.
        max_bytes: largest accepted body (bytes).
    """

    #: it passes every send through untouched (api.sse.BODY_PASSTHROUGH)
    mmserve_body_passthrough = True

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:  # chunked upload without Content-Length
                    raise HTTPException(413, self._message())
            return msg

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body is over {self.max_bytes} bytes"

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(error_body(self._message(), "invalid_request_error", None, "too_large"))
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
