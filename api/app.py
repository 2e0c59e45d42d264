"""FastAPI app: image and video uploads, OpenAI-compatible chat completions, metrics.

:func:`create_app` builds the app around an :class:`~mmserve.engine.engine.Engine`;
``mmserve serve`` (:mod:`api.cli`) runs it with uvicorn. Routes live in
``api/routes_*.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from api import (
    routes_batches,
    routes_cache,
    routes_chat,
    routes_images,
    routes_page,
    routes_responses,
    routes_videos,
)
from api.auth import APIKeyMiddleware
from api.batch_store import FileStore
from api.batches import BatchManager
from api.body_limit import BodyLimitMiddleware
from api.errors import APIError, install_error_handlers
from api.image_store import ImageStore
from api.json_body import JSONBodyRoute
from api.media import MediaResolver
from api.metrics import Metrics
from api.settings import ServerSettings
from api.state import ServerState
from api.submit import EngineClient
from api.video_store import VideoStore
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.engine import Engine

__all__ = ["ServerSettings", "create_app"]


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    """Build the FastAPI app around ``engine`` (its thread starts and stops with the app).

    Raises:
        ValueError: for settings out of range.
    """
    settings = settings or ServerSettings()
    settings.validate()
    model_name = settings.served_model_name or Path(engine.config.model_path or "mmserve").name
    aengine = AsyncEngine(engine)
    metrics = Metrics()
    store = ImageStore(
        engine.processor.prepare_image,
        max_images=settings.max_stored_images,
        max_bytes=settings.max_stored_image_bytes,
        directory=settings.image_store_dir,
    )
    state = ServerState(
        engine=engine,
        aengine=aengine,
        client=EngineClient(
            aengine, metrics, settings.max_queued_requests, settings.retry_after_seconds
        ),
        store=store,
        media=MediaResolver(
            store, engine.config.image_limits, settings, processor=engine.processor
        ),
        metrics=metrics,
        settings=settings,
        model_name=model_name,
        videos=VideoStore(settings.max_stored_videos, settings.max_stored_video_bytes),
    )

    state.batches = BatchManager(
        state, FileStore(settings.resolved_data_dir(), settings.max_stored_file_bytes)
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        state.batches.start()  # resumes unfinished batches
        yield
        await state.batches.stop()
        # after uvicorn's grace period: whatever still runs is aborted, pages freed
        aengine.call(lambda: engine.abort_all("abort"))
        aengine.stop()
        # the engine thread is gone: KV pages to the disk tier (if on), TP workers stopped
        engine.close()

    app = FastAPI(title="mmserve", version="0.1.0", lifespan=lifespan)
    app.router.route_class = JSONBodyRoute  # the routes' one JSON body parser
    app.state.mm = state
    app.state.engine = engine
    app.state.async_engine = aengine
    app.state.image_store = store
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        """200 while the engine steps; 503 after ``unhealthy_after_failed_steps`` failed
        steps in a row, so a supervisor restarts the process (never needs the API key)."""
        fatal = engine.fatal_error()
        if fatal is not None:  # a tensor-parallel rank died or hung: nothing can run
            raise APIError(
                503, f"engine unhealthy: {fatal}", "server_error", code="engine_unhealthy"
            )
        failed = aengine.consecutive_failures()
        if failed >= settings.unhealthy_after_failed_steps:
            raise APIError(
                503,
                f"engine unhealthy: its last {failed} steps failed; restart the server",
                "server_error",
                code="engine_unhealthy",
            )
        return {"status": "ok"}

    app.include_router(routes_chat.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_batches.router)
    app.include_router(routes_images.router)
    app.include_router(routes_videos.router)
    app.include_router(routes_cache.router)
    app.include_router(routes_page.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    key = settings.resolved_api_key()
    if key:
        app.add_middleware(APIKeyMiddleware, api_key=key)
    return app
