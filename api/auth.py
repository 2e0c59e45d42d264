"""API-key check: ``Authorization: Bearer <key>`` on every route but the open ones
(``/health`` and the web page's files: the page sends the key the user types). A
WebSocket (``/v1/streams/{id}/ws``) may send the key as its ``api_key`` query parameter
instead, since a browser cannot set a WebSocket's headers.

The key names the caller's tenant (:mod:`api.tenants`): it is set on
``request.state.tenant`` and in :data:`api.tenants.CURRENT_TENANT` for every request
(``default`` with one key or none, :class:`TenantMiddleware`)."""

from __future__ import annotations

import json
import logging
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import deny_websocket, error_body
from api.tenants import CURRENT_TENANT, DEFAULT_TENANT, TenantKeys

# the web page (api/routes_page.py) holds no data: it asks for the key itself
OPEN_PATHS = ("/health", "/", "/static/app.js", "/static/style.css")


class APIKeyMiddleware:
    """Pure ASGI middleware (streaming and disconnects pass through untouched).

    Args:
        app: the wrapped app.
        api_key: the key clients must send (one tenant, ``default``); or
        keys: the tenants' keys (``--api-keys``; reloaded in place on SIGHUP).
        open_paths: paths answered without a key (``/health``, the page and its files).
    """

    #: it passes every send through untouched (api.sse.BODY_PASSTHROUGH)
    mmserve_body_passthrough = True

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None = None,
        keys: TenantKeys | None = None,
        open_paths: tuple[str, ...] = OPEN_PATHS,
    ):
        self.app = app
        if keys is None:
            assert api_key, "give api_key or keys"
            keys = TenantKeys.single(api_key)
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in self.open_paths:
            await _with_tenant(self.app, DEFAULT_TENANT, scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = got.strip().partition(b" ")
        if kind == "websocket" and not got:  # a browser cannot set a WebSocket's headers
            token, scheme = _query_key(scope), b"bearer"
        # the scheme name is case-insensitive (RFC 9110, Section 11.1)
        tenant = self.keys.lookup(token.strip()) if scheme.lower() == b"bearer" else None
        if tenant is not None:
            await _with_tenant(self.app, tenant, scope, receive, send)
            return
        missing = not got and not (kind == "websocket" and token)
        msg = (
            "missing API key: send 'Authorization: Bearer <key>'" if missing else "invalid API key"
        )
        err = error_body(msg, "invalid_request_error", None, "invalid_api_key")
        if kind == "websocket":  # refused at the handshake: HTTP 401 with the JSON body
            await deny_websocket(scope, send, 401, err, [(b"www-authenticate", b"Bearer")])
            return
        body = json.dumps(err)
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


def _query_key(scope: Scope) -> bytes:
    """The ``api_key`` query parameter of a WebSocket request (b"" if none)."""
    from urllib.parse import parse_qs

    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return query.get("api_key", [""])[0].encode("latin-1")


class TenantMiddleware:
    """Without keys: every request is the ``default`` tenant's (``request.state.tenant``
    set, as the routes that record an owner read it)."""

    #: it passes every send through untouched (api.sse.BODY_PASSTHROUGH)
    mmserve_body_passthrough = True

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _with_tenant(self.app, DEFAULT_TENANT, scope, receive, send)


async def _with_tenant(app: ASGIApp, tenant: str, scope: Scope, receive: Receive, send: Send):
    """Run ``app`` with ``tenant`` on ``request.state`` and in :data:`CURRENT_TENANT`."""
    if scope["type"] in ("http", "websocket"):
        scope.setdefault("state", {})["tenant"] = tenant
    token = CURRENT_TENANT.set(tenant)
    try:
        await app(scope, receive, send)
    finally:
        CURRENT_TENANT.reset(token)


_QUERY_KEY = re.compile(r"(api_key=)[^&\s\"']*")


class RedactQueryKeys(logging.Filter):
    """Replaces the value of an ``api_key`` query parameter with ``***`` in a log record
    (uvicorn logs a WebSocket's path with its query string, where a browser sends its
    key); installed on uvicorn's loggers by :func:`redact_query_keys_in_logs`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "api_key=" in record.msg:
            record.msg = _QUERY_KEY.sub(r"\1***", record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(
                _QUERY_KEY.sub(r"\1***", a) if isinstance(a, str) and "api_key=" in a else a
                for a in record.args
            )
        return True


def redact_query_keys_in_logs() -> None:
    """Install :class:`RedactQueryKeys` on ``uvicorn.error`` and ``uvicorn.access`` (once)."""
    for name in ("uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactQueryKeys) for f in logger.filters):
            logger.addFilter(RedactQueryKeys())
