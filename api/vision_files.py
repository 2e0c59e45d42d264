"""``/v1/files`` with ``purpose="vision"``: OpenAI's way to upload an image for later
requests (``client.files.create(file=..., purpose="vision")``).

A vision file is an uploaded image: its bytes go to the image store as ``POST
/v1/images`` puts them (same bounds: ``--max-image-bytes``, the pixel limits, the store's
count and byte bounds; the same pixels give the same entry), and its file id is the image
id (``img-`` + 32 hex), usable as chat's ``image_url.url`` and as Responses'
``input_image.file_id`` or ``image_url``. Every stored image is listed as a vision file;
``GET``/``DELETE /v1/files/img-...`` read and delete the image. Batch files keep their
``file-`` ids (:mod:`api.batch.store`).
"""

from __future__ import annotations

from starlette.datastructures import UploadFile

from api.errors import APIError
from api.ids import IMAGE
from api.image_store import StoredImage
from api.state import ServerState
from api.uploads import clean_name, read_file_field

#: The ``purpose`` of an image uploaded through ``/v1/files``.
VISION = "vision"

# leading bytes -> media type, for GET /v1/files/img-.../content
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"BM", "image/bmp"),
)


def is_vision_id(file_id: str) -> bool:
    """Whether ``file_id`` is written as an image id (a vision file), not a batch file's."""
    return IMAGE.claims(file_id)


async def upload_vision_file(st: ServerState, file: UploadFile) -> dict:
    """Store an uploaded image file and return its OpenAI file object.

    Raises:
        APIError: 400 naming ``file``: over ``--max-image-bytes`` (``file_too_large``),
            empty, or not an image the server accepts (``invalid_image``, or the pixel
            limits' code).
    """
    limit = st.engine.config.image_limits.max_bytes
    data = await read_file_field(file, limit, "--max-image-bytes")
    if not data:
        raise APIError(400, "file: empty; purpose vision needs an image file", param="file")
    name = clean_name(file.filename or "") or "image"
    image = await st.media.store_bytes(data, "file", name=name)  # named in its id's section
    entry = st.store.info(image.id)
    if entry is None:  # a tiny store under churn may have evicted it already
        entry = StoredImage(image, 0, len(data), 0.0)
    return {**vision_object(entry), "filename": entry.filename or name}


def vision_object(entry: StoredImage) -> dict:
    """The OpenAI file object of a stored image."""
    return {
        "id": entry.image.id,
        "object": "file",
        "bytes": entry.file_bytes,
        "created_at": int(entry.created),
        "filename": entry.filename or f"{entry.image.id}.img",
        "purpose": VISION,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def vision_files(st: ServerState) -> list[dict]:
    """Every stored image as a vision file object, newest first."""
    objs = [vision_object(e) for e in st.store.list()]
    return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)


def vision_entry(st: ServerState, file_id: str) -> StoredImage:
    """The stored image of a vision file id (path parameter ``file_id``).

    Raises:
        APIError: 404 for a malformed or unknown id.
    """
    return IMAGE.find(file_id, "file_id", st.store.info, 404)


def vision_content(entry: StoredImage) -> tuple[bytes, str]:
    """A vision file's bytes as uploaded and their media type.

    Raises:
        APIError: 404 when the store keeps no bytes for it.
    """
    data = entry.image.source
    if data is None:
        raise APIError(
            404, f"file_id: the bytes of {entry.image.id} are not kept", "not_found_error"
        )
    media = next((m for magic, m in _MAGIC if data.startswith(magic)), None)
    if media is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        media = "image/webp"
    return data, media or "application/octet-stream"


def delete_vision_file(st: ServerState, file_id: str) -> dict:
    """Delete a vision file's image from the store (path parameter ``file_id``).

    Raises:
        APIError: 404 for a malformed or unknown id.
    """
    ident = IMAGE.check(file_id, "file_id", 404)
    if not st.store.delete(ident):
        raise IMAGE.not_found(ident, "file_id")
    return {"id": ident, "object": "file", "deleted": True}
