"""Small JPEG thumbnails of stored images and videos (``GET /v1/images/{id}/thumbnail``,
``GET /v1/videos/{id}/thumbnail``), so a page can show what it stored after a reload.

Ids are content keys, so a thumbnail never goes stale: the cache keeps the latest
:data:`MAX_THUMBNAILS` by id and needs no invalidation (a route checks that the id is
still stored before it answers).
"""

from __future__ import annotations

import io
from collections.abc import Callable

from PIL import Image, ImageOps

from mmserve.lru import LRU

#: The longest edge of a thumbnail (pixels).
THUMBNAIL_EDGE = 256
#: Thumbnails kept in memory (each a few KB).
MAX_THUMBNAILS = 512
#: A thumbnail's id is its content's key: browsers may keep it (this client only).
THUMBNAIL_HEADERS = {"Cache-Control": "private, max-age=86400"}


def thumbnail_jpeg(im: Image.Image) -> bytes:
    """``im`` shrunk to fit :data:`THUMBNAIL_EDGE` (aspect kept, never enlarged), EXIF
    orientation applied, transparency over white, as JPEG bytes (quality 80)."""
    im = ImageOps.exif_transpose(im)
    im.thumbnail((THUMBNAIL_EDGE, THUMBNAIL_EDGE))
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        im = Image.new("RGB", rgba.size, "white")
        im.paste(rgba, mask=rgba.getchannel("A"))
    im = im.convert("RGB")
    out = io.BytesIO()
    im.save(out, "JPEG", quality=80)
    return out.getvalue()


class Thumbnails:
    """A bounded cache of thumbnails by id (thread-safe: the LRU locks itself;
    :data:`MAX_THUMBNAILS` kept)."""

    def __init__(self, max_items: int = MAX_THUMBNAILS) -> None:
        self._cache: LRU[str, bytes] = LRU(max_items, size=len)

    def get(self, key: str, make: Callable[[], bytes]) -> bytes:
        """The cached thumbnail of ``key``, else ``make()`` (two callers may both make
        it; the result is the same)."""
        got = self._cache.get(key)
        if got is None:
            got = make()
            self._cache.put(key, got)
        return got
