"""The web page: ``GET /`` and its files under ``/static/`` (no API key needed).

The page (``api/static/``: index.html, app.js, style.css; no build step, nothing
loaded from elsewhere) uploads images and videos, asks several questions at
once, streams the browser's camera or a shared screen to ``/v1/streams`` and asks
about it, and shows ``/v1/cache/stats``; it sends the API key the user types as a
Bearer header on its API calls.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from api.errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"
# only these names are served: no path from the request ever reaches the file system
_FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    """The page."""
    return FileResponse(
        STATIC_DIR / "index.html",
        media_type="text/html; charset=utf-8",
        headers={"Cache-Control": "no-cache"},
    )


@router.get("/static/{name}")
async def static_file(name: str) -> FileResponse:
    """One of the page's files; 404 for any other name."""
    if name not in _FILES:
        raise APIError(404, f"no static file {name!r}", "not_found_error", code="not_found")
    return FileResponse(
        STATIC_DIR / name, media_type=_FILES[name], headers={"Cache-Control": "no-cache"}
    )
