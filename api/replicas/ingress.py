"""The ingress deployment: the single-process routes in front of N engine replicas.

:func:`create_ingress_app` builds the same FastAPI app as :func:`api.app.create_app`
(chat completions, uploads, videos, the web page; the same errors, limits and
streaming) around a :class:`~mmserve.frontend.frontend.FrontEnd` and a
:class:`~mmserve.fleet.client.ReplicaClient` instead of an engine. Four routes cover
every replica, per replica and in total:

- ``GET /health``: 200 while at least one replica is healthy (``status`` "ok" when
  all expected replicas are, else "degraded"); 503 ``engine_unhealthy`` when none is.
- ``GET /v1/cache/stats``: the single-process figures summed over the replicas
  (hit rate recomputed from the sums), plus ``replicas`` (each one's figures, pid and
  node), ``router`` (requests per replica and reason, in flight, tree sizes) and the
  ingress's counters (``retries``, ``pixel_puts``).
- ``GET /metrics``: the single-process metrics with engine figures summed, plus
  ``mmserve_replica_*{replica=...}`` (each replica's hit rate, tokens, tower runs,
  pixel fetches, health) and ``mmserve_router_*`` (requests routed by reason).
- ``POST /v1/cache/flush``: flushes every replica and empties the router's trees;
  409 if any replica has requests running (the others are flushed).

:class:`Ingress` is the Ray Serve deployment class that serves this app;
:class:`CancelGuard` cancels the submissions of an HTTP request that Ray Serve cancels.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from ray import serve

from api import (
    routes_batches,
    routes_chat,
    routes_conversations,
    routes_images,
    routes_page,
    routes_responses,
    routes_videos,
)
from api.app import assemble_app, server_state
from api.batch.runner import BatchManager
from api.batch.store import FileStore
from api.errors import APIError
from api.json_body import JSONBodyRoute, refuse_body
from api.metrics import Metrics
from api.schemas import ChatCompletionRequest
from api.settings import ServerSettings
from api.state import State
from api.submit import EngineClient, Submission
from api.tenant_stores import split_by_tenant
from mmserve.config import EngineConfig
from mmserve.fleet.client import STREAMED, ReplicaClient
from mmserve.frontend.frontend import FrontEnd, load_frontend_model
from mmserve.types import EngineRequest

log = logging.getLogger(__name__)

#: The submissions made while handling the current HTTP request (cancelled with it).
SUBMISSIONS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mmserve_submissions", default=None
)


class ReplicaEngineClient(EngineClient):
    """:class:`EngineClient` that also remembers each HTTP request's submissions, so that
    a request cancelled by Ray Serve (client gone) cancels them (see :class:`CancelGuard`)."""

    def submit(
        self, reqs: Sequence[EngineRequest], background: bool = False, final_only: bool = False
    ) -> Submission:
        """As :meth:`EngineClient.submit` (``background``: batch-job lines;
        ``final_only``: an answer that is not streamed)."""
        sub = super().submit(reqs, background, final_only)
        subs = SUBMISSIONS.get()
        if subs is not None:
            subs.append(sub)
        return sub


class CancelGuard:
    """ASGI middleware: when Ray Serve cancels a request (its client disconnected), every
    submission the request made is cancelled, so its engine requests are aborted."""

    #: it passes every send through untouched (api.sse.BODY_PASSTHROUGH)
    mmserve_body_passthrough = True

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        """Run the app with a fresh list of submissions for this request."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        subs: list[Submission] = []
        token = SUBMISSIONS.set(subs)
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            for sub in subs:
                sub.cancel()
            raise
        finally:
            SUBMISSIONS.reset(token)


#: ``cache_stats`` keys that are not summed over replicas.
_NOT_SUMMED = {"page_size", "cache_hit_rate", "consecutive_failed_steps", "uptime_seconds"}
#: What the disk KV tier holds: replicas on one machine share its directory, so these
#: describe one store (the largest replica view), not one store per replica.
_SHARED_MAX = {
    "tier_disk_pages",
    "tier_disk_bytes",
    "tier_disk_capacity_bytes",
    "tier_disk_feature_files",
}
#: Flags that hold for the fleet only if they hold on every replica.
_ALL = {"tier_disk_on", "tier_disk_writable"}


def aggregate(stats: dict[str, dict]) -> dict:
    """Totals of the replicas' stats: numbers summed (the shared disk KV tier's contents:
    the largest; its on/writable flags: the smallest), hit rate recomputed, accounting ok
    only if every replica's is (None if any replica is busy)."""
    rows = list(stats.values())
    if not rows:
        return {}
    total: dict = {}
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if key in _SHARED_MAX:
                total[key] = max(r.get(key, 0) for r in rows)
            elif key in _ALL:
                total[key] = min(r.get(key, 0) for r in rows)
            elif key not in _NOT_SUMMED:
                total[key] = sum(r.get(key, 0) for r in rows)
    total["page_size"] = rows[0].get("page_size")
    total["consecutive_failed_steps"] = max(r.get("consecutive_failed_steps", 0) for r in rows)
    prompt = total.get("prompt_tokens", 0)
    total["cache_hit_rate"] = total.get("cached_tokens", 0) / prompt if prompt else 0.0
    accts = [r.get("accounting") for r in rows]
    if any(a is None for a in accts):
        total["accounting"] = None
    else:
        acct: dict = {"ok": all(a.get("ok") for a in accts)}
        for key in ("free", "tree", "running", "total"):
            if all(key in a for a in accts):
                acct[key] = sum(a[key] for a in accts)
        errors = [a["error"] for a in accts if "error" in a]
        if errors:
            acct["error"] = "; ".join(errors)
        total["accounting"] = acct
    return total


class FleetCollector(Collector):
    """Per-replica and router series from the latest snapshot (set before each scrape)."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict | str] = {}
        self.router: dict | None = None
        self.encoders: dict[str, dict | str] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "mmserve_replica_up", "1 if the replica answered its stats call.", labels=["replica"]
        )
        hit = GaugeMetricFamily(
            "mmserve_replica_cache_hit_rate",
            "Cached prompt tokens / prompt tokens of each replica since it started.",
            labels=["replica"],
        )
        counters = {
            key: CounterMetricFamily(name, help_, labels=["replica"])
            for key, name, help_ in (
                ("prompt_tokens", "mmserve_replica_prompt_tokens", "Prompt tokens per replica."),
                (
                    "cached_tokens",
                    "mmserve_replica_cached_prompt_tokens",
                    "Prompt tokens whose KV came from each replica's prefix cache.",
                ),
                (
                    "vision_tower_images",
                    "mmserve_replica_vision_tower_runs",
                    "Images encoded by each replica's vision tower.",
                ),
                (
                    "pixel_fetches",
                    "mmserve_replica_pixel_fetches",
                    "Images whose pixels each replica fetched from the object store.",
                ),
                (
                    "requests_finished",
                    "mmserve_replica_requests_finished",
                    "Requests each replica's engine finished.",
                ),
            )
        }
        live = GaugeMetricFamily(
            "mmserve_replica_live_requests", "Requests live in each replica.", labels=["replica"]
        )
        for uid, s in sorted(self.replicas.items()):
            up.add_metric([uid], 1.0 if isinstance(s, dict) else 0.0)
            if not isinstance(s, dict):
                continue
            hit.add_metric([uid], s.get("cache_hit_rate", 0.0))
            live.add_metric([uid], s.get("live_requests", 0))
            for key, fam in counters.items():
                fam.add_metric([uid], s.get(key, 0))
        yield up
        yield hit
        yield live
        yield from counters.values()
        yield from self._encoder_metrics()
        if self.router is None:
            return
        routed = CounterMetricFamily(
            "mmserve_router_requests",
            "Requests routed to each replica, by reason: prefix (longest cached prefix), "
            "disk (least loaded: the prompt is on the shared disk KV tier), "
            "no_match (least loaded: no replica held enough of the prompt), load (least "
            "loaded: the load was uneven), pow2, round_robin.",
            labels=["replica", "reason"],
        )
        inflight = GaugeMetricFamily(
            "mmserve_router_in_flight_requests",
            "Requests this ingress has in flight on each replica.",
            labels=["replica"],
        )
        predicted = GaugeMetricFamily(
            "mmserve_router_predicted_hit_rate",
            "Tokens the router's tree of each replica held / tokens routed to it.",
            labels=["replica"],
        )
        tree = GaugeMetricFamily(
            "mmserve_router_tree_tokens",
            "Tokens in the router's approximate radix tree of each replica.",
            labels=["replica"],
        )
        for uid, info in sorted(self.router["replicas"].items()):
            for reason, n in sorted(info["routed"].items()):
                routed.add_metric([uid, reason], n)
            inflight.add_metric([uid], info["in_flight"])
            predicted.add_metric([uid], info["predicted_hit_rate"])
            tree.add_metric([uid], info["tree_tokens"])
        yield routed
        yield inflight
        yield predicted
        yield tree

    def _encoder_metrics(self) -> Iterator[Metric]:
        if not self.encoders:
            return
        fams = {
            key: cls(name, help_, labels=["encoder"])
            for key, cls, name, help_ in (
                ("runs", CounterMetricFamily, "mmserve_encoder_runs", "Images encoded."),
                (
                    "fetches",
                    CounterMetricFamily,
                    "mmserve_encoder_fetches",
                    "Feature requests from replicas (store hits and tower runs).",
                ),
                ("queue", GaugeMetricFamily, "mmserve_encoder_queue", "Images being encoded."),
                (
                    "bytes",
                    GaugeMetricFamily,
                    "mmserve_encoder_features_bytes",
                    "Feature bytes kept in the object store.",
                ),
            )
        }
        for uid, e in sorted(self.encoders.items()):
            if isinstance(e, dict):
                for key, fam in fams.items():
                    fam.add_metric([uid], e.get(key, 0))
        yield from fams.values()


def create_ingress_app(
    front: FrontEnd,
    replicas: ReplicaClient,
    settings: ServerSettings,
    model_name: str,
    num_replicas: int,
    encoders: ReplicaClient | None = None,
) -> FastAPI:
    """The single-process app's routes, served by ``replicas`` (see the module docstring);
    ``encoders`` (control calls only) reports the encoder deployment's figures.

    Raises:
        ValueError: for settings out of range.
    """
    settings.validate()
    metrics = Metrics()
    fleet = FleetCollector()
    metrics.registry.register(fleet)
    client = ReplicaEngineClient(
        replicas, metrics, settings.max_queued_requests, settings.retry_after_seconds
    )
    client.stream_interval = settings.stream_interval
    state = server_state(front, replicas, client, metrics, settings, model_name)  # type: ignore[arg-type]
    store = state.store
    fleet_routes = APIRouter(route_class=JSONBodyRoute)

    @fleet_routes.get("/health")
    async def health() -> dict:
        """200 while a replica is healthy ("degraded" when fewer than expected are);
        503 when none is (never needs the API key)."""
        got = await replicas.broadcast("health", timeout=5.0)
        ok = [u for u, r in got.items() if isinstance(r, dict) and r.get("healthy")]
        body = {
            "status": "ok" if len(ok) >= num_replicas else "degraded",
            "healthy_replicas": len(ok),
            "expected_replicas": num_replicas,
            "replicas": got,
        }
        if not ok:
            raise APIError(
                503,
                f"no healthy replica ({len(got)} running of {num_replicas}); Ray Serve "
                "replaces failed replicas, retry shortly",
                "server_error",
                code="engine_unhealthy",
            )
        return body

    @fleet_routes.post("/v1/chat/completions", response_model=None, include_in_schema=False)
    async def chat_completions(body: ChatCompletionRequest, request: Request, st: State):
        """The single-process route; a streamed answer is marked as such for retries."""
        STREAMED.set(bool(body.stream))
        return await routes_chat.chat_completions(body, request, st)

    async def snapshot() -> tuple[dict, dict[str, dict | str]]:
        got = await replicas.broadcast("stats")
        fine = {u: r for u, r in got.items() if isinstance(r, dict)}
        return aggregate(fine), got

    async def encoder_snapshot() -> dict[str, dict | str]:
        return await encoders.broadcast("stats") if encoders is not None else {}

    @fleet_routes.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text: totals under the single-process names, plus per replica and
        router series."""
        total, got = await snapshot()
        fleet.replicas = got
        fleet.router = replicas.router_snapshot()
        fleet.encoders = await encoder_snapshot()
        return Response(metrics.render(total), media_type=CONTENT_TYPE_LATEST)

    @fleet_routes.get("/v1/cache/stats")
    async def cache_stats() -> dict:
        """Totals over the replicas (the single-process keys), each replica's figures and
        the router's counters."""
        total, got = await snapshot()
        enc = await encoder_snapshot()
        runs = total.get("vision_tower_images", 0) + sum(
            e.get("runs", 0) for e in enc.values() if isinstance(e, dict)
        )
        return {
            **total,
            "tower_runs": runs,
            "tower_runs_per_image": runs / replicas.pixel_puts if replicas.pixel_puts else 0.0,
            "encoders": enc,
            **metrics.summary(),
            "stored_images": len(store),
            "num_replicas": len(got),
            "expected_replicas": num_replicas,
            "retries": replicas.retries,
            "replica_failures": replicas.replica_failures,
            "pixel_puts": replicas.pixel_puts,
            "replicas": got,
            "router": replicas.router_snapshot(),
        }

    @fleet_routes.post("/v1/cache/flush")
    async def flush_cache(request: Request) -> dict:
        """Flush every replica's prefix and embedding caches and the router's trees;
        409 if any replica has requests running (the idle ones are flushed); it takes
        no body (400 for one)."""
        await refuse_body(request)
        got = await replicas.broadcast("flush")
        for uid, res in got.items():
            if isinstance(res, dict) and res.get("flushed"):
                replicas.forget(uid)
        busy = sorted(u for u, r in got.items() if isinstance(r, dict) and r.get("busy"))
        if busy:
            raise APIError(
                409,
                f"cannot flush the cache while requests are running (replicas {busy}); "
                "retry when idle",
                code="requests_running",
            )
        freed = sum(r.get("freed_pages", 0) for r in got.values() if isinstance(r, dict))
        return {"flushed": True, "freed_pages": freed, "replicas": got}

    async def a_replica_is_up() -> None:
        """Return once a replica answers healthy (a batch has a day: no bound here). The
        ingress starts in seconds, replicas load weights for longer than a request may
        wait to be started (``ACCEPT_SECONDS``)."""
        waited = False
        while True:
            got = await replicas.broadcast("health", timeout=5.0)
            if any(isinstance(r, dict) and r.get("healthy") for r in got.values()):
                if waited:
                    log.info("a replica is up: batches run")
                return
            if not waited:
                log.info("batches wait for a healthy replica")
                waited = True
            await asyncio.sleep(1.0)

    # the ingress owns --data-dir and the batch runner: lines go through the router like
    # any request (a line in flight on a replica that dies is sent once more)
    state.batches = BatchManager(
        state,
        FileStore(settings.resolved_data_dir(), settings.max_stored_file_bytes),
        ready=a_replica_is_up,
    )
    keys = settings.tenant_keys()
    if keys is not None and keys.path is not None:  # --api-keys: each tenant its own stores
        split_by_tenant(state, sorted({t for _, t in keys.keys}))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.batches.start()  # resumes unfinished batches
        yield
        await state.batches.stop()

    # no cache routes of a single engine: the fleet routes above stand in
    routers = [
        fleet_routes,
        routes_chat.router,
        routes_responses.router,
        routes_conversations.router,
        routes_batches.router,
        routes_images.router,
        routes_videos.router,
        routes_page.router,
    ]
    return assemble_app(state, routers, lifespan=lifespan, middleware=[CancelGuard])


def served_name(settings: ServerSettings, model_path: str | None) -> str:
    """The model name clients pass, as the single-process server derives it."""
    if settings.served_model_name:
        return settings.served_model_name
    if model_path is None:
        from mmserve.testing.checkpoints import ensure_model

        model_path = str(ensure_model("tiny"))
    return Path(model_path).name


@serve.ingress()
class Ingress:
    """Ray Serve deployment class of the ingress (one per application).

    Args:
        replicas: handle of the engine replica deployment.
        config: the replicas' engine settings (the front end applies their limits).
        settings: HTTP settings.
        num_replicas: replicas the deployment asks for.
        encoders: handle of the encoder deployment (``--encoders``), or None.
    """

    def __init__(
        self,
        replicas,
        config: EngineConfig,
        settings: ServerSettings,
        num_replicas: int,
        encoders=None,
    ) -> None:
        import torch

        from mmserve.model.identity import checkpoint_identity
        from mmserve.model.weights import CheckpointError
        from mmserve.testing.checkpoints import ensure_model

        torch.set_num_threads(1)
        model_dir = config.model_path or str(ensure_model("tiny"))
        front = FrontEnd(config, load_frontend_model(model_dir))
        app_name = serve.get_replica_context().app_name
        # the router keys prefixes on the model the ids were made for
        try:
            ident = checkpoint_identity(model_dir, config.torch_dtype(), config.quantization)
        except (CheckpointError, OSError) as exc:  # weights not on the ingress's node
            log.warning("router prefixes not keyed on the model identity: %s", exc)
            ident = b""
        self.replicas = ReplicaClient(replicas, app_name, front.model.tokenizer, model=ident)
        name = served_name(settings, model_dir)
        enc = ReplicaClient(encoders, app_name, None) if encoders is not None else None
        self._app = create_ingress_app(front, self.replicas, settings, name, num_replicas, enc)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The app Ray Serve runs for this deployment."""
        return self._app
