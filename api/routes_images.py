"""``/v1/images``: upload, list, get, delete, and ask several questions about one image."""

from __future__ import annotations

import io
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from PIL import Image

from api.cache_fields import effective_salt
from api.errors import APIError
from api.generation import check_questions, make_requests, sampling_params
from api.ids import IMAGE
from api.image_store import StoredImage
from api.json_body import JSONBodyRoute
from api.openai_format import usage
from api.schemas import AskRequest
from api.state import ServerState, State
from api.thumbnails import THUMBNAIL_HEADERS, thumbnail_jpeg
from api.uploads import read_upload, upload_body
from mmserve.model.families.base import DETAILS

router = APIRouter(route_class=JSONBodyRoute)

_UPLOAD_BODY = upload_body("image")


@router.post("/v1/images", openapi_extra=_UPLOAD_BODY)
async def upload_image(request: Request, st: State) -> dict:
    """Upload an image: multipart field ``file``, or JSON ``{"data": "<base64>"}``; an
    optional field ``name`` (else the multipart file name) is its display ``name``.

    Identical pixels give the same id, whatever the file name or container, and a
    second upload of them changes nothing (idempotent; the first name given stays).
    """
    data, param, name = await read_upload(request, st.engine.config.image_limits.max_bytes)
    image = await st.media.store_bytes(data, param, name=name)
    # (under heavy churn a tiny store may already have evicted it again)
    entry = st.store.info(image.id) or StoredImage(image, 0, len(data), time.time())
    return _info(st, entry)


@router.get("/v1/images")
async def list_images(st: State) -> dict:
    """Stored images, most recently used first."""
    return {"object": "list", "data": [_info(st, e) for e in st.store.list()]}


@router.get("/v1/images/{image_id}")
async def get_image(image_id: str, st: State) -> dict:
    """Metadata of a stored image; 404 if unknown, deleted or evicted."""
    return _info(st, _entry(st, image_id))


@router.get("/v1/images/{image_id}/thumbnail")
async def image_thumbnail(image_id: str, st: State) -> Response:
    """A JPEG of the stored image at most 256 pixels on its longer edge; 404 if unknown
    (or kept without its file)."""
    entry = _entry(st, image_id)
    source = entry.image.source
    if not isinstance(source, bytes):
        raise APIError(404, f"image_id: {image_id!r} has no stored file", param="image_id")

    def make() -> bytes:
        with Image.open(io.BytesIO(source)) as im:
            return thumbnail_jpeg(im)

    data = await run_in_threadpool(st.thumbnails.get, image_id, make)
    return Response(data, media_type="image/jpeg", headers=THUMBNAIL_HEADERS)


@router.delete("/v1/images/{image_id}")
async def delete_image(image_id: str, st: State) -> dict:
    """Remove an image from the store (and its directory); 404 if unknown. Runs in a
    worker thread: it waits while an upload of the same image commits."""
    deleted = await run_in_threadpool(st.store.delete, image_id)
    return IMAGE.deleted(image_id, deleted, "image_id")


@router.post("/v1/images/{image_id}/ask", response_model=None)
async def ask(image_id: str, body: AskRequest, request: Request, st: State) -> dict | Response:
    """Answer every question about one stored image in one call.

    All questions are submitted together; the scheduler prefills the image once
    (one question's request) and runs the others right after, as cache hits.
    """
    st.check_model(body.model)
    _entry(st, image_id)
    check_questions(body.questions, st.settings.max_questions, st.engine.processor, body.system)
    # prepared once (decoded again only if its features are not cached), used by each question
    processor = st.engine.processor
    detail = body.detail or "auto"
    image = await st.media.resolve(image_id, "image_id", processor.image_mode(1, detail))
    params = sampling_params(body)
    system = [{"role": "system", "content": body.system}] if body.system else []
    salt = effective_salt(body.cache_salt, st.settings.shared_cache)
    reqs = []
    for q in body.questions:
        content = [{"type": "image"}, {"type": "text", "text": q}]
        msgs = [*system, {"role": "user", "content": content}]
        reqs += await make_requests(
            processor,
            msgs,
            [image],
            params,
            1,
            st.settings.default_max_tokens,
            details=[detail],
            cache_salt=salt,
        )
    sub = st.client.submit(reqs, final_only=True)  # answers are not streamed
    results = await sub.answers(request)
    answers = [
        {
            "index": i,
            "question": q,
            "answer": r.text,
            "finish_reason": r.finish_reason,
            "usage": usage([r]),
        }
        for i, (q, r) in enumerate(zip(body.questions, results, strict=True))
    ]
    total = {
        k: sum(a["usage"][k] for a in answers)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    total["prompt_tokens_details"] = {
        k: sum(a["usage"]["prompt_tokens_details"][k] for a in answers)
        for k in ("cached_tokens", "image_tokens", "video_tokens")
    }
    return {
        "id": f"ask-{uuid.uuid4().hex}",
        "object": "image.answers",
        "created": int(time.time()),
        "model": st.model_name,
        "image_id": image_id,
        "answers": answers,
        "usage": total,
    }


def _entry(st: ServerState, image_id: str) -> StoredImage:
    return IMAGE.find(image_id, "image_id", lambda i: st.store.info(i, touch=True), 404)


def _info(st: ServerState, entry: StoredImage) -> dict:
    im = entry.image
    return {
        "id": entry.image.id,
        "object": "image",
        "name": entry.filename,
        "thumbnail_url": f"/v1/images/{entry.image.id}/thumbnail",
        "created_at": int(entry.created),
        "width": im.width,
        "height": im.height,
        "mode": entry.color_mode,
        "bytes": entry.file_bytes,
        "num_image_tokens": st.engine.processor.image_tokens(entry.image),
        "num_image_tokens_by_detail": {
            d: st.engine.processor.image_tokens(entry.image, d) for d in DETAILS
        },
    }
