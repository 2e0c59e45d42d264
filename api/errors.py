"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Scope, Send
from starlette.websockets import WebSocket

from mmserve.cancel import Cancelled
from mmserve.frontend.engine_client import EngineTimeout, EngineUnavailable

log = logging.getLogger(__name__)


class ClientDisconnected(Cancelled):
    """The HTTP client went away before the answer was ready (answered 499, which no
    one reads: the handler only ends the route). A :class:`~mmserve.cancel.Cancelled`
    raised by the work of a request whose client left is answered the same way."""


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-shaped body.

    Args:
        status: HTTP status code.
        message: what went wrong and, where it helps, how to fix it.
        type_: OpenAI error type ("invalid_request_error", "not_found_error", ...).
        param: the request field at fault, if any.
        code: a short machine-readable code, if any.
        headers: extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers

    def body(self) -> dict:
        """This error's OpenAI-shaped body (:func:`error_body`)."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error response."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def deny_websocket(
    scope: Scope,
    send: Send,
    status: int,
    body: dict,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Refuse a WebSocket handshake with an HTTP error response and a JSON body (``body``,
    :func:`error_body`'s shape), through the ASGI WebSocket Denial Response extension
    (uvicorn's ``websockets`` protocols and Starlette's test client offer it). A server
    without the extension gets a close before the handshake completes, which its clients
    see as HTTP 403 with no body.

    Args:
        scope: the WebSocket's ASGI scope (not yet accepted).
        send: its ASGI send.
        status: the HTTP status (4xx).
        body: the JSON body.
        headers: extra response headers (``WWW-Authenticate``).
    """
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        await send(
            {"type": "websocket.close", "code": 1008, "reason": body["error"]["message"][:120]}
        )
        return
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send(
        {"type": "websocket.http.response.start", "status": status, "headers": [*hdrs, *headers]}
    )
    await send({"type": "websocket.http.response.body", "body": raw})


async def no_such_websocket(websocket: WebSocket) -> None:
    """The app's last WebSocket route: a path no WebSocket route serves is refused at the
    handshake with 404 and the JSON error body (Starlette's own refusal is a bare 403)."""
    path = websocket.url.path
    shown = path if len(path) <= 100 else path[:100] + "..."
    body = error_body(
        f"no WebSocket route at {shown!r}; live video streams take WebSockets at "
        "/v1/streams/{id}/ws",
        "not_found_error",
        None,
        "not_found",
    )
    await deny_websocket(websocket.scope, websocket.send, 404, body)


class DeniedHandshakeNoise(logging.Filter):
    """Drops uvicorn's "ASGI callable returned without completing handshake." record,
    which its sansio and wsproto WebSocket protocols (uvicorn 0.54) log after every
    denial response of :func:`deny_websocket` although the client got its answer. The
    app's one WebSocket route always accepts or denies, so the record says nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "ASGI callable returned without completing handshake."


def quiet_denied_handshakes_in_logs() -> None:
    """Install :class:`DeniedHandshakeNoise` on ``uvicorn.error`` (once)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DeniedHandshakeNoise) for f in logger.filters):
        logger.addFilter(DeniedHandshakeNoise())


def field_path(parts: Sequence[object]) -> str:
    """A request field as clients write it: ``messages[0].content[1].image_url.url``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# Union members pydantic names in an error's location; they are not request fields.
_BRANCH_TAG = re.compile(r"^(str|int|float|bool|bytes|dict|list|none|[A-Z]\w*)$|[\[\]-]")

_EXPECTED = {
    "string_type": "expected a string",
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected a boolean",
    "bool_parsing": "expected a boolean",
    "list_type": "expected an array",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "model_attributes_type": "expected an object",
    "missing": "field required",
    "extra_forbidden": "unknown field; the server does not act on it, so it is refused "
    "rather than ignored (remove it)",
}


def describe_validation_errors(errors: Sequence[dict]) -> tuple[str, str | None]:
    """One message and ``param`` for pydantic's errors: the deepest field that failed.

    A union (string or list of parts, object or string) makes pydantic report one
    error per branch; the branch that got furthest into the input names the real
    problem, so the error with the longest field path wins (first one on ties).

    Returns:
        ``(message, param)``: message like ``messages[0].content[1].image_url.url:
        expected a string``; param the field path, or None for a body-level error.
    """
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None

    def fields(err: dict) -> list[object]:
        loc = list(err.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        return [p for p in loc if isinstance(p, int) or not _BRANCH_TAG.search(str(p))]

    def branch(err: dict) -> tuple:
        """The error's location up to its innermost union branch tag."""
        loc = list(err.get("loc", ()))
        tags = [i for i, p in enumerate(loc) if _BRANCH_TAG.search(str(p))]
        return tuple(loc[: tags[-1] + 1]) if tags else ()

    # a union branch that refused the part's "type" is not the one the client meant
    refused = {
        branch(e)
        for e in errors
        if e.get("type") == "literal_error" and str(list(e.get("loc", ()))[-1:]) == "['type']"
    }
    meant = [e for e in errors if branch(e) not in refused] or errors
    # deepest first; at equal depth an error from a branch of the right type (an empty
    # list's "too short" rather than "expected a string")
    best = max(meant, key=lambda e: (len(fields(e)), not e.get("type", "").endswith("_type")))
    typed = [e for e in errors if branch(e) in refused and e.get("type") == "literal_error"]
    if typed and len(fields(typed[0])) > len(fields(best)):  # no branch takes this type
        best = max(typed, key=lambda err: len(fields(err)))
    path = field_path(fields(best)) or None
    kind = best.get("type", "")
    if kind == "literal_error":
        expected = (best.get("ctx") or {}).get("expected", "")
        what = f"unknown value {best.get('input')!r}; expected one of {expected}"
    elif kind == "missing" and path and path.endswith(".type"):
        what = "field required: give the part's type"
    else:
        what = _EXPECTED.get(kind) or _lower_first(best.get("msg", "invalid value"))
        if kind.endswith("_type") and kind in _EXPECTED:  # no union branch takes the value:
            alts = [  # name every branch's type (best's own among them)
                _EXPECTED[e["type"]].removeprefix("expected ")
                for e in errors
                if e.get("type", "").endswith("_type")
                and e["type"] in _EXPECTED
                and (field_path(fields(e)) or None) == path
            ]
            what = "expected " + " or ".join(dict.fromkeys(alts))
    if kind == "literal_error" and path and path.endswith(".type") and "content" in path:
        # every union branch refused the type: list what each of them accepts
        accepted = [
            (e.get("ctx") or {}).get("expected", "")
            for e in errors
            if e.get("type") == "literal_error" and field_path(fields(e)) == path
        ]
        expected = " or ".join(dict.fromkeys(a for a in accepted if a))
        what = f"unknown content part type {best.get('input')!r}; accepted types are {expected}"
    return (f"{path}: {what}" if path else what), path


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def install_error_handlers(app: FastAPI) -> None:
    """Map our errors, validation errors and HTTP errors to OpenAI-shaped JSON; a client
    that goes away (while we answer, or before its body is all sent) gets a 499 that no
    one reads."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(
            e.body(),
            status_code=e.status,
            headers=e.headers,
        )

    @app.exception_handler(Cancelled)  # ClientDisconnected too
    async def _gone(request: Request, _: Cancelled) -> Response:
        # the work for it stopped where it was (media, template, engine): one line
        log.info(
            "client disconnected before the answer of %s %s; its work was stopped",
            request.method,
            request.url.path,
        )
        return Response(status_code=499)

    @app.exception_handler(ClientDisconnect)
    async def _cut_short(request: Request, _: ClientDisconnect) -> Response:
        # the client closed before sending its whole body: nothing was stored or queued
        # (bodies are read before anything is done with them), so one line and no traceback
        log.info(
            "client disconnected while sending the body of %s %s",
            request.method,
            request.url.path,
        )
        return Response(status_code=499)

    @app.exception_handler(EngineUnavailable)
    async def _no_engine(_: Request, e: EngineUnavailable) -> JSONResponse:
        # a control call (/metrics, /v1/cache/*) while no engine process runs: at once,
        # the same 503 as /health, never a hang or an anonymous 500
        return JSONResponse(
            error_body(f"engine unavailable: {e}", "server_error", code="engine_unhealthy"),
            status_code=503,
        )

    @app.exception_handler(EngineTimeout)
    async def _engine_silent(_: Request, e: EngineTimeout) -> JSONResponse:
        # the engine process lives but did not answer the control call in time (hung,
        # stopped): a 503 naming it and the call, never a route that waits forever
        return JSONResponse(
            error_body(f"engine not answering: {e}", "server_error", code="engine_timeout"),
            status_code=503,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        msg, param = describe_validation_errors(e.errors())
        return JSONResponse(error_body(msg, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(e.detail), type_), status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        # the traceback (with server paths) goes to the log, never to the client
        log.exception("unhandled error")
        msg = f"internal error ({type(e).__name__}); the server log has the details"
        return JSONResponse(error_body(msg, "server_error"), status_code=500)
