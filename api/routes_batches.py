"""``/v1/files`` and ``/v1/batches`` in OpenAI's shapes (see :mod:`api.batch.runner`);
``purpose="vision"`` files are images (:mod:`api.vision_files`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from starlette.datastructures import UploadFile

from api.batch.lines import check_lines
from api.batch.runner import BatchManager
from api.batch.store import UPLOAD_PURPOSES
from api.errors import APIError
from api.json_body import JSONBodyRoute
from api.schemas import STRICT, _refuse_unless_default
from api.state import State
from api.uploads import multipart_form, read_file_field
from api.vision_files import (
    VISION,
    delete_vision_file,
    is_vision_id,
    upload_vision_file,
    vision_content,
    vision_entry,
    vision_files,
    vision_object,
)

router = APIRouter(route_class=JSONBodyRoute)

#: Most ``metadata`` keys on a batch (OpenAI's limit), and their lengths.
MAX_METADATA_KEYS = 16


class BatchCreateRequest(BaseModel):
    """``POST /v1/batches`` body."""

    model_config = STRICT
    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=MAX_METADATA_KEYS
    )
    output_expires_after: Any = None

    @field_validator("output_expires_after")
    @classmethod
    def _expiry(cls, value: Any, info: ValidationInfo) -> Any:
        why = "files are kept until deleted"
        return _refuse_unless_default(value, info, {"output_expires_after": (None,)}, why)


def _manager(st: State) -> BatchManager:
    assert st.batches is not None
    return st.batches


def _page(items: list[dict], limit: int, after: str | None) -> dict:
    """OpenAI's cursor page: items after the one with id ``after``, at most ``limit``."""
    if after is not None:
        ids = [o["id"] for o in items]
        if after not in ids:
            raise APIError(400, f"after: no object with id {after!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


# ---- files ------------------------------------------------------------------------------
@router.post("/v1/files")
async def upload_file(request: Request, st: State) -> dict:
    """Upload a file: multipart fields ``file`` and ``purpose``: ``batch`` (a JSONL batch
    input, bounded by ``--max-batch-file-bytes`` and ``--max-batch-lines``) or ``vision``
    (an image, stored as ``POST /v1/images`` stores it; its id is the image id)."""
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise APIError(
            415,
            "send multipart/form-data with fields 'file' and 'purpose'",
            code="unsupported_media_type",
        )
    form = await multipart_form(request, max_files=1, max_fields=8)
    try:
        stray = sorted(set(form.keys()) - {"file", "purpose"})
        if stray:
            raise APIError(
                400,
                f"{stray[0]}: unknown field; the server does not act on it, so it is "
                "refused rather than ignored",
                param=stray[0],
            )
        purpose = form.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            got = "field required" if purpose is None else f"{purpose!r} is not supported"
            raise APIError(
                400,
                f"purpose: {got}; use one of {list(UPLOAD_PURPOSES)}",
                param="purpose",
            )
        file = form.get("file")
        if not isinstance(file, UploadFile):
            raise APIError(400, "file: a file field named 'file' is required", param="file")
        if purpose == VISION:
            return await upload_vision_file(st, file)
        limit = st.settings.max_batch_file_bytes
        data = await read_file_field(file, limit, "--max-batch-file-bytes")
        if not data.strip():
            msg = "file: empty; a batch file has one JSON request per line"
            raise APIError(400, msg, param="file")
        check_lines(data, st.settings.max_batch_lines, "file")
        name = (file.filename or "batch.jsonl")[:255]
        return await run_in_threadpool(_manager(st).files.add, data, name, purpose)
    finally:
        await form.close()


@router.get("/v1/files")
async def list_files(
    st: State,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict:
    """Stored files (uploads, batch outputs and, as ``vision`` files, the stored images),
    newest first unless ``order=asc``."""
    items = [] if purpose == VISION else _manager(st).files.list(purpose)
    if purpose in (None, VISION):
        items = sorted(
            items + vision_files(st), key=lambda o: (o["created_at"], o["id"]), reverse=True
        )
    if order == "asc":
        items.reverse()
    return _page(items, limit, after)


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, st: State) -> dict:
    """A file object; 404 if unknown or deleted."""
    if is_vision_id(file_id):
        return vision_object(vision_entry(st, file_id))
    return _manager(st).files.get(file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, st: State) -> Response:
    """A file's bytes (JSONL; a vision file's image as uploaded)."""
    if is_vision_id(file_id):
        data, media = vision_content(vision_entry(st, file_id))
        return Response(data, media_type=media)
    data = await run_in_threadpool(_manager(st).files.read, file_id)
    return Response(data, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, st: State) -> dict:
    """Delete a file (a vision file: its image); 409 while an unfinished batch reads it."""
    if is_vision_id(file_id):
        # the image store's per-id lock may wait: off the event loop
        return await run_in_threadpool(delete_vision_file, st, file_id)
    await _manager(st).delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


# ---- batches ----------------------------------------------------------------------------
@router.post("/v1/batches")
async def create_batch(body: BatchCreateRequest, st: State) -> dict:
    """Create a batch over an uploaded file (``endpoint`` ``/v1/chat/completions`` or
    ``/v1/responses``, ``completion_window`` ``24h``); it starts ``validating``."""
    return await _manager(st).create(body.input_file_id, body.endpoint, body.metadata)


@router.get("/v1/batches")
async def list_batches(
    st: State, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
) -> dict:
    """Batches, newest first (cursor pages: ``limit``, ``after``)."""
    return _page(_manager(st).list(), limit, after)


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, st: State) -> dict:
    """A batch object (status, request counts, usage with cached tokens, file ids)."""
    return _manager(st).get(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, st: State) -> dict:
    """Cancel a batch: ``cancelling`` at once, ``cancelled`` when its requests stop."""
    return await _manager(st).cancel(batch_id)
