"""API-key check: ``Authorization: Bearer <key>`` on every route but the open ones
(``/health`` and the web page's files: the page sends the key the user types)."""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import error_body

# the web page (api/routes_page.py) holds no data: it asks for the key itself
OPEN_PATHS = ("/health", "/", "/static/app.js", "/static/style.css")


class APIKeyMiddleware:
    """Pure ASGI middleware (streaming and disconnects pass through untouched).

    Args:
        app: the wrapped app.
        api_key: the key clients must send.
        open_paths: paths answered without a key (``/health``, the page and its files).
    """

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = got.strip().partition(b" ")
        # the scheme name is case-insensitive (RFC 9110, Section 11.1)
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        msg = (
            "missing API key: send 'Authorization: Bearer <key>'" if not got else "invalid API key"
        )
        body = json.dumps(error_body(msg, "invalid_request_error", None, "invalid_api_key"))
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
