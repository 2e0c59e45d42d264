"""OpenTelemetry request tracing (``--otlp-traces-endpoint``; the ``tracing`` extra).

Imported only when tracing is on: a server without the flag never imports the
OpenTelemetry SDK or exporter (only the API, which FastAPI itself imports). The HTTP
side is FastAPI's own OpenTelemetry support, handed our tracer provider: every
``/v1/...`` request gets a server span named ``"{method} {route}"`` (a child of the
client's W3C ``traceparent`` when it sends one) with ``fastapi.*`` operation spans for
the route's dependencies, endpoint and serialization. The serving spans are added
under it, built after the fact on the event loop (never on the engine thread) from
timestamps the engine already reports in its
:class:`~mmserve.types.TokenDelta` messages and the
:class:`~mmserve.types.GenerateResult` (the same arrival, time to first token
and latency the Prometheus histograms observe)::

    POST /v1/chat/completions          server span: http.route, http.response.status_code
    ├── fastapi.endpoint               the route's handler (and fastapi.dependencies, ...)
    ├── mmserve.preprocess             request start -> submitted to the engine (body,
    │                                  image fetch/decode/preprocessing, tokenization)
    └── mmserve.request                one per engine request (n choices, /ask questions)
        ├── mmserve.queue              arrival at the engine -> first admission
        ├── mmserve.vision_tower       the tower calls that encoded its images
        ├── mmserve.prefill            first admission -> first token
        └── mmserve.decode             first token -> finish
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Status, StatusCode

from mmserve.types import EngineRequest, GenerateResult

__all__ = ["RequestTracing", "TracingMiddleware", "otlp_tracing", "traces_url"]

#: The OTLP/HTTP path appended to an endpoint given without one.
OTLP_TRACES_PATH = "/v1/traces"

_Scope = MutableMapping[str, Any]
_ASGIApp = Callable[[_Scope, Callable, Callable], Awaitable[None]]
#: The server span of the HTTP request being handled (set by :class:`TracingMiddleware`).
_SERVER_SPAN: contextvars.ContextVar[Span | None] = contextvars.ContextVar(
    "mmserve_server_span", default=None
)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: ``/v1/traces`` is appended when the URL
    has no path (``http://collector:4318`` -> ``http://collector:4318/v1/traces``).

    Raises:
        ValueError: not an ``http://`` or ``https://`` URL with a host (OTLP over gRPC is
            not supported: use the collector's OTLP/HTTP port, 4318 by default).
    """
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"otlp_traces_endpoint must be an http:// or https:// URL of an OTLP/HTTP "
            f"collector (e.g. http://localhost:4318/v1/traces), got {endpoint!r}"
        )
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + OTLP_TRACES_PATH
    return endpoint


def otlp_tracing(endpoint: str) -> RequestTracing:
    """Tracing that batches spans to the OTLP/HTTP (protobuf) collector at ``endpoint``
    (:func:`traces_url`). The service name is ``$OTEL_SERVICE_NAME``, else "mmserve".

    Raises:
        ValueError: for an endpoint :func:`traces_url` refuses.
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = traces_url(endpoint)
    name = os.environ.get("OTEL_SERVICE_NAME") or "mmserve"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return RequestTracing(provider)


class RequestTracing:
    """Makes a server's spans with ``provider``'s tracer (tests give one whose processor
    writes to the SDK's ``InMemorySpanExporter``).

    Args:
        provider: the tracer provider; :meth:`shutdown` flushes and stops it.
    """

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("mmserve")

    def fastapi_telemetry(self) -> dict[str, Any]:
        """FastAPI's ``telemetry`` setting: HTTP spans with our provider for ``/v1/``
        paths only (no ``/health``, ``/metrics`` or page spans); no OpenTelemetry
        metrics or logs (Prometheus has the figures)."""
        return {
            "tracer_provider": self.provider,
            "metrics": False,
            "logs": False,
            "exclude": lambda scope: not scope.get("path", "").startswith("/v1/"),
        }

    def shutdown(self) -> None:
        """Export the spans still buffered and stop the provider."""
        self.provider.shutdown()

    def submitted(self, reqs: Sequence[EngineRequest]) -> None:
        """Record ``mmserve.preprocess``: from the HTTP request's start to now, when
        ``reqs`` go to the engine. Nothing outside a traced HTTP request (batch jobs)."""
        parent = _SERVER_SPAN.get()
        start = getattr(parent, "start_time", None)
        if parent is None or start is None or not parent.is_recording():
            return
        keys = {s.image.key for r in reqs for s in r.spans}
        span = self.tracer.start_span(
            "mmserve.preprocess",
            trace.set_span_in_context(parent),
            start_time=start,
            attributes={"mmserve.engine_requests": len(reqs), "mmserve.distinct_images": len(keys)},
        )
        span.end()

    def finished(self, req: EngineRequest, result: GenerateResult) -> None:
        """Record ``req``'s ``mmserve.request`` span and its queue, vision tower, prefill
        and decode children from ``result``'s timings (seconds from ``req.arrival``,
        ``time.perf_counter()``), as children of the current HTTP request's span."""
        parent = _SERVER_SPAN.get()
        if parent is None or not parent.is_recording():
            return  # no traced HTTP request (a batch job), or its span has ended
        base = time.time_ns() - time.perf_counter_ns()  # perf_counter -> Unix time (ns)

        def at(offset: float) -> int:
            return base + round((req.arrival + offset) * 1e9)

        frames = sum(s.modality == "video" for s in req.spans)  # as usage counts them
        root = self.tracer.start_span(
            "mmserve.request",
            trace.set_span_in_context(parent),
            start_time=at(0.0),
            attributes={
                "mmserve.request_id": req.rid,
                "gen_ai.usage.input_tokens": result.prompt_tokens,
                "gen_ai.usage.output_tokens": result.completion_tokens,
                "gen_ai.response.finish_reasons": (result.finish_reason,),
                "mmserve.cached_tokens": result.cached_tokens,
                "mmserve.images": len(req.spans) - frames,
                "mmserve.video_frames": frames,
                "mmserve.image_tokens": result.image_tokens,
                "mmserve.video_tokens": result.video_tokens,
            },
        )
        if req.prompt_cache_key:  # the client's own routing key (never a tenant or salt)
            root.set_attribute("mmserve.prompt_cache_key", req.prompt_cache_key)
        if result.finish_reason == "error":
            root.set_status(Status(StatusCode.ERROR, result.error or "engine error"))
        ctx = trace.set_span_in_context(root)

        def child(name: str, start: float, end: float, **attrs: Any) -> None:
            attributes = {f"mmserve.{k}": v for k, v in attrs.items()}
            span = self.tracer.start_span(name, ctx, start_time=at(start), attributes=attributes)
            span.end(end_time=max(at(end), at(start)))

        admitted, vision = result.queue_time, result.vision_time
        if admitted is not None and not 0.0 <= admitted <= result.ttft:
            # the engine's clock is not this one (a replica on another host): no engine times
            admitted = vision = None
        else:
            child("mmserve.queue", 0.0, result.latency if admitted is None else admitted)
        if vision is not None:
            child(
                "mmserve.vision_tower",
                *vision,
                images_encoded=result.vision_tower_runs,
                images_needing_vision=result.images_needing_vision,
            )
        if admitted is not None:
            child(
                "mmserve.prefill",
                admitted,
                result.ttft,
                prompt_tokens=result.prompt_tokens,
                cached_tokens=result.cached_tokens,
            )
        if result.completion_tokens:
            child(
                "mmserve.decode",
                result.ttft,
                result.latency,
                completion_tokens=result.completion_tokens,
                finish_reason=result.finish_reason,
            )
        root.end(end_time=at(result.latency))


class TracingMiddleware:
    """ASGI middleware (inside FastAPI's telemetry): remembers the request's server span
    while the app handles it, so that :class:`RequestTracing` parents its spans on it
    (not on ``fastapi.endpoint``, which ends before a streamed answer does).

    Args:
        app: the wrapped ASGI app.
    """

    #: it passes every send through untouched (api.sse.BODY_PASSTHROUGH)
    mmserve_body_passthrough = True

    def __init__(self, app: _ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: _Scope, receive: Callable, send: Callable) -> None:
        token = _SERVER_SPAN.set(trace.get_current_span())
        try:
            await self.app(scope, receive, send)
        finally:
            _SERVER_SPAN.reset(token)
