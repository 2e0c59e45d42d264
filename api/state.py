"""What every route needs, built once per app: engine, store, media resolver, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from api.errors import APIError
from api.image_store import ImageStore
from api.media import MediaResolver
from api.metrics import Metrics
from api.settings import ServerSettings
from api.submit import EngineClient
from api.thumbnails import Thumbnails
from api.video_store import VideoStore
from mmserve.frontend.async_engine import AsyncEngine
from mmserve.frontend.engine_client import EngineProcessClient
from mmserve.frontend.frontend import Engine, FrontEnd


@dataclass
class ServerState:
    """The objects behind one app (``app.state.mm``).

    Attributes:
        engine: the engine (touched only on its thread, or through ``aengine``), or the
            front end alone when the engine runs in its own process (or on replicas).
        aengine: the thread that drives it, or the engine process's client.
        client: submission with the queue limit and metrics.
        store: uploaded images.
        media: turns ``image_url`` values into images.
        metrics: Prometheus collectors.
        settings: HTTP-level settings.
        model_name: the served model's name.
        videos: uploaded videos.
        batches: the :class:`~api.batch.runner.BatchManager` (files and batch jobs).
        kernels_ready: False until the start-up kernel warm-up has finished
            (``/health`` answers 503 ``warming_up`` before).
        thumbnails: the stored images' and videos' thumbnails (:mod:`api.thumbnails`).
        responses: the stored responses and conversations
            (:class:`~api.stored_responses.ResponseStores`), None with
            ``--responses-store off``.
        streams: the live video streams (:class:`~api.streams.StreamRegistry`, made on
            first use).
    """

    engine: Engine | FrontEnd
    aengine: AsyncEngine | EngineProcessClient
    client: EngineClient
    store: ImageStore
    media: MediaResolver
    metrics: Metrics
    settings: ServerSettings
    model_name: str
    videos: VideoStore = field(default_factory=VideoStore)
    batches: Any = None
    kernels_ready: bool = False
    thumbnails: Thumbnails = field(default_factory=Thumbnails)
    responses: Any = None
    streams: Any = None

    def check_model(self, name: str | None) -> None:
        """Accept ``None`` (the served model) or the served model's name.

        Raises:
            APIError: 404 ``model_not_found`` for any other name.
        """
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )


def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's :class:`ServerState`."""
    return request.app.state.mm


#: Route parameter type that injects the app's :class:`ServerState`.
State = Annotated[ServerState, Depends(get_state)]
