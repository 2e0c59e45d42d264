"""Uploads of images and videos: reading the body (multipart field ``file``, or JSON
``{"data": "<base64>"}``) and what the two upload stores share (:class:`UploadStore`)."""

from __future__ import annotations

import base64
import binascii
import unicodedata
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

from fastapi import Request
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.errors import APIError
from api.json_body import json_media_type, read_json_object
from mmserve.lru import LRU

E = TypeVar("E")


class UploadStore(Generic[E]):
    """The LRU of an upload store (:class:`~api.image_store.ImageStore`,
    :class:`~api.video_store.VideoStore`): entries by id, bounded by count and bytes.

    The newest entry stays even when it alone is over ``max_bytes`` (it was accepted).

    Args:
        max_items: most entries kept.
        max_bytes: most bytes kept, as ``size`` measures an entry (bytes).
        size: bytes one entry holds in memory.
    """

    def __init__(self, max_items: int, max_bytes: int, size: Callable[[E], int]) -> None:
        self.max_bytes = max_bytes
        self._entries: LRU[str, E] = LRU(max_items, max_bytes, size=size, keep_newest=True)

    def list(self) -> list[E]:
        """Every entry, most recently used first (does not change the order)."""
        return self._entries.values()[::-1]

    @property
    def total_bytes(self) -> int:
        """Bytes the entries hold in memory (bytes)."""
        return self._entries.nbytes

    def __len__(self) -> int:
        return len(self._entries)


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


#: Most characters of an upload's name (longer names are cut).
MAX_NAME_CHARS = 255


def clean_name(raw: str) -> str:
    """An upload's client-supplied name made safe to show: its last path component
    (after ``/`` or ``\\``), without control or format characters (Unicode category C:
    newlines, NUL, bidirectional overrides), stripped, at most :data:`MAX_NAME_CHARS`
    characters. A label only: never used as a path."""
    base = raw.replace("\\", "/").rsplit("/", 1)[-1]
    kept = "".join(c for c in base if not unicodedata.category(c).startswith("C"))
    return kept.strip()[:MAX_NAME_CHARS]


class Upload(NamedTuple):
    """An upload's bytes, the request field they came from, and its name ("" if none)."""

    data: bytes
    param: str
    name: str


async def multipart_form(request: Request, **limits: int) -> FormData:
    """The request's multipart form, each field given at most once.

    Args:
        limits: starlette's ``max_files`` / ``max_fields`` bounds.

    Raises:
        APIError: 400 naming ``file`` for a malformed body or one over the bounds, naming
            the field when one is repeated (the server would act on one of them only).
    """
    try:
        form = await request.form(**limits)
    # ValueError: bad boundaries; HTTPException: starlette's MultiPartException (too many
    # files or fields, a part too large) as the app sees it
    except (ValueError, StarletteHTTPException) as e:
        detail = getattr(e, "detail", e)
        raise APIError(400, f"malformed multipart body: {detail}", param="file") from None
    repeated = next((k for k in form.keys() if len(form.getlist(k)) > 1), None)
    if repeated is not None:
        await form.close()
        raise APIError(
            400,
            f"{repeated}: given more than once; send each field once",
            param=repeated,
        )
    return form


async def read_file_field(file: UploadFile, limit: int, flag: str) -> bytes:
    """The bytes of multipart ``file``, read at most ``limit + 1`` of them.

    Raises:
        APIError: 400 ``file_too_large`` naming ``file`` (and the bound's ``flag``) when
            it holds more than ``limit`` bytes.
    """
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise APIError(
            400, f"file: larger than {limit} bytes ({flag})", param="file", code="file_too_large"
        )
    return data


async def read_upload(request: Request, max_bytes: int, what: str = "image") -> Upload:
    """The uploaded file's bytes (at most ``max_bytes + 1`` of a multipart file), the
    request field they came from, and its name: the optional field ``name``, else a
    multipart file's file name (:func:`clean_name`).

    Raises:
        APIError: 400 for a malformed body (a JSON body goes through
            :func:`api.json_body.read_json_object`) or unknown JSON fields, 415 for
            another content type.
    """
    ctype = request.headers.get("content-type", "")
    if ctype.lower().startswith("multipart/form-data"):
        form = await multipart_form(request)
        try:  # closing the form deletes its spooled files
            file = form.get("file")
            if not isinstance(file, UploadFile):
                msg = "multipart upload needs a file field named 'file'"
                raise APIError(400, msg, param="file")
            keys = list(form.keys())
            shape = f"the {what} as the field 'file' (and an optional 'name')"
            _refuse_other_fields(keys, "file", shape)
            name = _name_field(form.get("name"))
            return Upload(
                await file.read(max_bytes + 1), "file", name or clean_name(file.filename or "")
            )
        finally:
            await form.close()
    if json_media_type(ctype) or ctype.lower().startswith("application/json"):
        _, body = await read_json_object(request)  # 400 for any body that is not an object
        usage = f'JSON upload must be {{"data": "<base64 {what} bytes>"}}'
        shape = f'{{"data": "<base64 {what} bytes>", "name": "<optional name>"}}'
        _refuse_other_fields(list(body), "data", shape)
        name = _name_field(body.get("name"))
        data = body.get("data")
        if not isinstance(data, str):
            raise APIError(400, f"data: expected a base64 string; {usage}", param="data")
        try:
            return Upload(base64.b64decode(data, validate=True), "data", name)
        except (ValueError, binascii.Error):
            raise APIError(400, f"data: not valid base64; {usage}", param="data") from None
    raise APIError(
        415,
        'send multipart/form-data (field \'file\') or application/json ({"data": "<base64>"})',
        code="unsupported_media_type",
    )


def _name_field(value: object) -> str:
    """The optional ``name`` field of an upload, cleaned (:func:`clean_name`).

    Raises:
        APIError: 400 naming ``name`` when it is not a string (or a multipart file).
    """
    if value is None:
        return ""
    if not isinstance(value, str):
        raise APIError(400, "name: expected a string (the upload's display name)", param="name")
    return clean_name(value)


def _refuse_other_fields(names: list[str], expected: str, shape: str) -> None:
    """Refuse upload fields other than ``expected`` and ``name`` (each given once);
    ``shape`` says what to send.

    Raises:
        APIError: 400 naming the first other (or repeated) field.
    """
    other = [n for n in names if n not in (expected, "name")]
    repeated = [n for n in (expected, "name") if names.count(n) > 1]
    if other or repeated:
        name = other[0] if other else repeated[0]
        what = "unknown field" if other else "repeated upload field"
        raise APIError(
            400,
            f"{name}: {what}; the server does not act on it, so it "
            f"is refused rather than ignored: send only {shape}",
            param=name,
        )
