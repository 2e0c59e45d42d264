"""``/metrics`` (Prometheus), ``/v1/cache/stats`` (JSON) and ``/v1/cache/flush``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.errors import APIError
from api.json_body import refuse_body
from api.metrics import media_stats
from api.state import State

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(st: State) -> Response:
    """Prometheus text format: requests, tokens, cache, vision tower, KV pool, latencies."""
    stats = await st.aengine.control("cache_stats")
    media = media_stats(st.engine.processor.decode_budget, st.store, st.media.transient)
    return Response(st.metrics.render(stats, media), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cache/stats")
async def cache_stats(st: State) -> dict:
    """Pool, tree, hit-rate and latency figures as JSON.

    ``accounting`` is the pool check of docs/architecture.md, invariants (free + tree + running
    pages = pool size) when no request is live, else null.
    """

    stats = await st.aengine.control("stats_snapshot")
    return {**stats, **st.metrics.summary(), "stored_images": len(st.store)}


@router.post("/v1/cache/flush")
async def flush_cache(request: Request, st: State) -> dict:
    """Drop the radix tree (all its KV pages) and the vision-embedding cache.

    Refused with 409 while any request waits or runs; it takes no body (400 for one).
    """
    await refuse_body(request)

    try:
        return {"flushed": True, "freed_pages": await st.aengine.control("flush_cache")}
    except RuntimeError:  # requests are live (the engine's refusal, here or over the pipe)
        raise APIError(
            409,
            "cannot flush the cache while requests are running; retry when idle",
            code="requests_running",
        ) from None
