"""Reading an upload body: multipart field ``file``, or JSON ``{"data": "<base64>"}``."""

from __future__ import annotations

import base64
import binascii
import json

from fastapi import Request
from starlette.datastructures import UploadFile

from api.errors import APIError


def upload_body(what: str) -> dict:
    """``openapi_extra`` describing the two upload forms of ``what`` ("image", "video")."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {"file": {"type": "string", "format": "binary"}},
                        "required": ["file"],
                    }
                },
                "application/json": {
                    "schema": {
                        "type": "object",
                        "properties": {
                            "data": {"type": "string", "description": f"base64 {what} bytes"}
                        },
                        "required": ["data"],
                    }
                },
            },
        }
    }


async def read_upload(request: Request, max_bytes: int, what: str = "image") -> tuple[bytes, str]:
    """The uploaded file's bytes (at most ``max_bytes + 1`` of a multipart file) and the
    request field they came from.

    Raises:
        APIError: 400 for a malformed body, 415 for another content type.
    """
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        try:
            form = await request.form()
        except ValueError as e:  # starlette's MultiPartException, bad boundaries, ...
            raise APIError(400, f"malformed multipart body: {e}", param="file") from None
        file = form.get("file")
        if not isinstance(file, UploadFile):
            raise APIError(400, "multipart upload needs a file field named 'file'", param="file")
        _refuse_other_fields(list(form.keys()), "file", f"the {what} as the field 'file'")
        return await file.read(max_bytes + 1), "file"
    if ctype.startswith("application/json"):
        try:
            body = json.loads(await request.body())
            if isinstance(body, dict):
                _refuse_other_fields(list(body), "data", f'{{"data": "<base64 {what} bytes>"}}')
            return base64.b64decode(body["data"], validate=True), "data"
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise APIError(
                400, f'JSON upload must be {{"data": "<base64 {what} bytes>"}}', param="data"
            ) from None
    raise APIError(
        415,
        'send multipart/form-data (field \'file\') or application/json ({"data": "<base64>"})',
        code="unsupported_media_type",
    )


def _refuse_other_fields(names: list[str], expected: str, shape: str) -> None:
    """Refuse upload fields other than ``expected`` (given once); ``shape`` says what to send.

    Raises:
        APIError: 400 naming the first other (or repeated) field.
    """
    other = [n for n in names if n != expected]
    if other or names.count(expected) > 1:
        name = other[0] if other else expected
        raise APIError(
            400,
            f"{name}: unknown or repeated upload field; the server does not act on it, so it "
            f"is refused rather than ignored: send only {shape}",
            param=name,
        )
