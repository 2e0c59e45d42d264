"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


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


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error response."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def install_error_handlers(app: FastAPI) -> None:
    """Map our errors, validation errors and HTTP errors to OpenAI-shaped JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(
            error_body(e.message, e.type, e.param, e.code),
            status_code=e.status,
            headers=e.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}"
        elif param:
            msg = f"{param}: {msg}"
        return JSONResponse(error_body(msg, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(e.detail), type_), status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {e!r}", "server_error"), status_code=500)
