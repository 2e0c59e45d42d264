"""FastAPI app: image and video uploads, OpenAI-compatible chat completions, metrics.

:func:`create_app` builds the app around an :class:`~mmserve.frontend.frontend.Engine`;
``mmserve serve`` (:mod:`api.cli`) runs it with uvicorn. Routes live in
``api/routes_*.py``.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI

from api import (
    routes_batches,
    routes_cache,
    routes_chat,
    routes_conversations,
    routes_images,
    routes_page,
    routes_responses,
    routes_streams,
    routes_videos,
)
from api.auth import APIKeyMiddleware, TenantMiddleware, redact_query_keys_in_logs
from api.batch.runner import BatchManager
from api.batch.store import FileStore
from api.body_limit import BodyLimitMiddleware
from api.disconnect import DisconnectMiddleware
from api.errors import (
    APIError,
    install_error_handlers,
    no_such_websocket,
    quiet_denied_handshakes_in_logs,
)
from api.image_store import ImageStore
from api.json_body import JSONBodyRoute
from api.media import MediaResolver
from api.metrics import Metrics
from api.settings import ServerSettings
from api.sse import FastSendApp
from api.state import ServerState
from api.stored_responses import ResponseStores
from api.submit import EngineClient
from api.tenant_stores import split_by_tenant
from api.video_store import VideoStore
from mmserve.config import EngineConfig
from mmserve.frontend.async_engine import AsyncEngine
from mmserve.frontend.engine_client import CALL_TIMEOUT, EngineProcessClient
from mmserve.frontend.frontend import Engine, FrontEnd, load_frontend_model

if TYPE_CHECKING:  # api.tracing imports opentelemetry: only when tracing is on
    from api.tracing import RequestTracing

__all__ = [
    "ServerSettings",
    "assemble_app",
    "create_app",
    "freeze_startup_objects",
    "server_state",
    "start_engine_process",
]


def server_state(
    engine: Engine | FrontEnd,
    aengine: AsyncEngine | EngineProcessClient,
    client: EngineClient,
    metrics: Metrics,
    settings: ServerSettings,
    model_name: str,
) -> ServerState:
    """What every route needs (``app.state.mm``), with the image and video stores and the
    media resolver built from ``settings``; shared by :func:`create_app` and the replica
    ingress (whose ``engine`` is a weightless front end and ``aengine`` a replica client).
    With ``settings.otlp_traces_endpoint`` set, ``client`` gets OTLP tracing unless it
    has its own.
    """
    if settings.otlp_traces_endpoint is not None and client.tracing is None:
        from api.tracing import otlp_tracing

        client.tracing = otlp_tracing(settings.otlp_traces_endpoint)
    store = ImageStore(
        engine.processor.prepare_image,
        max_images=settings.max_stored_images,
        max_bytes=settings.max_stored_image_bytes,
        directory=settings.image_store_dir,
    )
    return ServerState(
        engine=engine,
        aengine=aengine,
        client=client,
        store=store,
        media=MediaResolver(
            store, engine.config.image_limits, settings, processor=engine.processor
        ),
        metrics=metrics,
        settings=settings,
        model_name=model_name,
        videos=VideoStore(settings.max_stored_videos, settings.max_stored_video_bytes),
        responses=ResponseStores.from_settings(settings),
    )


def assemble_app(
    state: ServerState,
    routers: Sequence[APIRouter],
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    middleware: Sequence[type] = (),
) -> FastAPI:
    """One FastAPI app around ``state``: every route parses JSON with
    :class:`~api.json_body.JSONBodyRoute`, errors answer in OpenAI's shape
    (:func:`~api.errors.install_error_handlers`), the body limit and (when set) the API
    key apply to every route, and each request's work stops when its client hangs up
    (:mod:`api.disconnect`); with tracing on (``state.client.tracing``) FastAPI's own
    OpenTelemetry support makes each ``/v1/`` request's server span (:mod:`api.tracing`).

    Args:
        state: what the routes read (``app.state.mm``).
        routers: included in order (an earlier router's route wins a path both serve).
        lifespan: the app's startup and shutdown.
        middleware: extra middleware classes (no arguments), innermost first.
    """
    tracing = state.client.tracing
    telemetry = tracing.fastapi_telemetry() if tracing is not None else None
    # streamed answers' body messages skip the send wrappers while tracing is off (api/sse.py)
    app = FastSendApp(
        title="mmserve",
        version="0.1.0",
        lifespan=lifespan,
        telemetry=telemetry,
        fast_send=tracing is None,
    )
    app.router.route_class = JSONBodyRoute  # the routes' one JSON body parser
    app.state.mm = state
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    # last: a WebSocket to a path no route serves gets 404 with the JSON body
    app.add_api_websocket_route("/{path:path}", no_such_websocket)
    # innermost: each request's cancel token, cancelled when its client hangs up
    app.add_middleware(DisconnectMiddleware)
    for cls in middleware:
        app.add_middleware(cls)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.settings.max_request_bytes)
    keys = state.settings.tenant_keys()
    app.state.tenant_keys = keys  # the SIGHUP reload replaces its keys in place
    if keys is not None:
        state.metrics.tenants.set_function(lambda: keys.tenants)
    quiet_denied_handshakes_in_logs()  # a refused WebSocket is answered, not an error
    if keys is not None:
        app.add_middleware(APIKeyMiddleware, keys=keys)
        redact_query_keys_in_logs()  # a browser's WebSocket sends its key in the query
    else:
        app.add_middleware(TenantMiddleware)
    if tracing is not None:
        from api.tracing import TracingMiddleware

        app.add_middleware(TracingMiddleware)
    return app


def freeze_startup_objects() -> None:
    """Take every object alive now out of the cyclic garbage collector's reach
    (``gc.collect`` then ``gc.freeze``): called by ``mmserve serve`` once the app is
    built, before it serves. After start-up the API process holds ~400k objects
    (modules, the tokenizer, the front end's model parts) that live until it exits; a full
    collection, which the objects of requests trigger now and then, scanned them all
    (~320 ms of the event loop on the tiny model) and now scans only what serving made.
    vLLM's and SGLang's servers do the same after start-up.
    """
    gc.collect()
    gc.freeze()


def start_engine_process(
    config: EngineConfig,
    restarts: int = 3,
    log_level: str = "info",
    call_timeout: float = CALL_TIMEOUT,
    **options: Any,
) -> tuple[FrontEnd, EngineProcessClient]:
    """Start the engine core in its own process (model, ``--tp`` ranks and kernel warm-up
    there; blocks until it is ready) and build this process's weightless front end over
    the checkpoint (:func:`~mmserve.frontend.frontend.load_frontend_model`, as the replica
    ingress does), sized by the engine's KV pool. Pass both to :func:`create_app`.

    The front end's embedding cache is the engine's keys
    (:attr:`~mmserve.frontend.engine_client.EngineProcessClient.feature_keys`): an image
    whose features the engine holds crosses by key (not preprocessed here, no pixels
    sent); any other image's pixels are made here and cross in shared memory.
    ``call_timeout``: the control calls' deadline (seconds; ``--engine-call-timeout``);
    ``options``: more :class:`EngineProcessClient` arguments.

    Raises:
        EngineStartError: the engine process could not start (``bad_setting`` for a
            refused setting or checkpoint).
        ValueError: a ``--tp`` the model cannot be split by (before any process starts).
        CheckpointError: the checkpoint's front-end files are missing.
    """
    client = EngineProcessClient(
        config, restarts, log_level=log_level, call_timeout=call_timeout, **options
    )
    assert config.model_path is not None  # EngineProcessClient checked it
    model = load_frontend_model(config.model_path)
    if config.tp > 1:  # refused here, before any process starts
        from mmserve.distributed.layout import check_tp

        check_tp(model.decoder.shape, config.tp, config.device, config.deterministic)
    info = client.start()
    front = FrontEnd(config, model, info["pool_tokens"], client.feature_keys)
    client.front = front
    return front, client


def create_app(
    engine: Engine | FrontEnd,
    settings: ServerSettings | None = None,
    tracing: RequestTracing | None = None,
    process: EngineProcessClient | None = None,
) -> FastAPI:
    """Build the FastAPI app around ``engine``: an in-process :class:`Engine` (its thread
    starts and stops with the app), or with ``process`` (the engine core in its own
    process, :func:`start_engine_process`) the front end it returned; the app's shutdown
    stops that process.

    ``tracing`` makes the spans (tests pass one with an in-memory exporter); without it,
    ``settings.otlp_traces_endpoint`` (when set) gives OTLP tracing.

    Raises:
        ValueError: for settings out of range, or a ``FrontEnd`` without ``process``.
    """
    settings = settings or ServerSettings()
    settings.validate()
    model_name = settings.served_model_name or Path(engine.config.model_path or "mmserve").name
    aengine: AsyncEngine | EngineProcessClient
    if process is not None:
        aengine = process
    elif isinstance(engine, Engine):
        aengine = AsyncEngine(engine)
    else:
        raise ValueError("a front end without an engine process: pass process=")
    metrics = Metrics()
    client = EngineClient(
        aengine, metrics, settings.max_queued_requests, settings.retry_after_seconds, tracing
    )
    client.stream_interval = settings.stream_interval
    state = server_state(engine, aengine, client, metrics, settings, model_name)
    state.batches = BatchManager(
        state, FileStore(settings.resolved_data_dir(), settings.max_stored_file_bytes)
    )
    keys = settings.tenant_keys()
    if keys is not None and keys.path is not None:  # --api-keys: each tenant its own stores
        split_by_tenant(state, sorted({t for _, t in keys.keys}))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if isinstance(aengine, EngineProcessClient):
            # the engine process built its kernels before it said ready
            aengine.attach()
            state.kernels_ready = True
            state.batches.start()  # resumes unfinished batches
            yield
            await state.batches.stop()
            await routes_streams.close_streams(state)
            # live requests aborted, KV pages to the disk tier, TP ranks stopped there
            await asyncio.to_thread(aengine.stop)
        else:
            assert isinstance(engine, Engine)
            # every GPU kernel the model runs is built (first start on a host: FlashInfer's
            # JIT, minutes) or loaded before the engine thread starts and /health says ok
            await asyncio.to_thread(engine.warm_up_kernels)
            state.kernels_ready = True
            aengine.start()
            state.batches.start()  # resumes unfinished batches
            yield
            await state.batches.stop()
            await routes_streams.close_streams(state)
            # after uvicorn's grace period: whatever still runs is aborted, pages freed
            aengine.call(lambda: engine.abort_all("abort"))
            aengine.stop()
            # the engine thread is gone: KV pages to the disk tier (if on), TP workers stopped
            engine.close()
        if client.tracing is not None:  # export the spans still buffered
            client.tracing.shutdown()

    health_router = APIRouter(route_class=JSONBodyRoute)

    @health_router.get("/health")
    async def health() -> dict:
        """200 while the engine steps; 503 after ``unhealthy_after_failed_steps`` failed
        steps in a row, so a supervisor restarts the process (never needs the API key);
        503 ``warming_up`` while the start-up kernel warm-up runs; 503
        ``engine_unhealthy`` from the moment the engine process dies until a new one is
        ready."""
        if not state.kernels_ready:
            raise APIError(
                503, "warming up: building GPU kernels", "server_error", code="warming_up"
            )
        down = aengine.unavailable() if isinstance(aengine, EngineProcessClient) else None
        if down is not None:
            raise APIError(
                503, f"engine unavailable: {down}", "server_error", code="engine_unhealthy"
            )
        fatal = aengine.fatal_error()
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

    routers = [
        health_router,
        routes_chat.router,
        routes_responses.router,
        routes_conversations.router,
        routes_batches.router,
        routes_images.router,
        routes_videos.router,
        routes_streams.router,
        routes_cache.router,
        routes_page.router,
    ]
    return assemble_app(state, routers, lifespan=lifespan)
