"""OpenTelemetry tracing (``--otlp-traces-endpoint``): span names, parents, attributes
and times in the SDK's in-memory exporter; the client's ``traceparent``; nothing
(not even an import of opentelemetry) when off."""

from __future__ import annotations

import importlib.util
import json

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from api.app import ServerSettings, create_app
from api.cli import main
from api.tracing import RequestTracing, traces_url
from tests.helpers import MODEL, ChatDefaults, image_part, run_python, upload

ENGINE_CHILDREN = {"mmserve.queue", "mmserve.vision_tower", "mmserve.prefill", "mmserve.decode"}
CHAT = ChatDefaults(max_tokens=4)


@pytest.fixture()
def traced(make_engine):
    """``(client, exporter)``: an app whose spans go to ``exporter``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = make_engine(max_total_tokens=4096)
    app = create_app(engine, ServerSettings(served_model_name=MODEL), RequestTracing(provider))
    with TestClient(app) as c:
        yield c, exporter


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def children(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> list[ReadableSpan]:
    sid = parent.context.span_id
    return [s for s in spans if s.parent is not None and s.parent.span_id == sid]


def one_trace(exporter: InMemorySpanExporter, route: str) -> tuple[ReadableSpan, tuple]:
    """The server span named ``route`` (exactly one) and every span of its trace."""
    spans = exporter.get_finished_spans()
    (root,) = by_name(spans, route)
    return root, tuple(s for s in spans if s.context.trace_id == root.context.trace_id)


def engine_spans(spans: tuple, request: ReadableSpan) -> dict[str, ReadableSpan]:
    kids = children(spans, request)
    assert len({s.name for s in kids}) == len(kids)
    return {s.name: s for s in kids}


def test_chat_spans_names_parents_attributes_and_times(traced, photos) -> None:
    client, exporter = traced
    image_id = upload(client, photos["cat.png"]).json()["id"]
    content = [image_part(image_id), {"type": "text", "text": "What is it?"}]
    outs = [CHAT.complete(client, content) for _ in range(2)]
    spans = exporter.get_finished_spans()
    (upload_span,) = by_name(spans, "POST /v1/images")
    assert upload_span.attributes["http.response.status_code"] == 200
    roots = by_name(spans, "POST /v1/chat/completions")
    assert len(roots) == 2 and len({r.context.trace_id for r in roots}) == 2
    for i, (root, out) in enumerate(zip(roots, outs, strict=True)):
        assert root.parent is None and root.kind == SpanKind.SERVER
        assert root.attributes["http.route"] == "/v1/chat/completions"
        assert root.attributes["http.request.method"] == "POST"
        assert root.attributes["http.response.status_code"] == 200
        kids = {s.name: s for s in children(spans, root)}
        # FastAPI's own operation spans: the route's handler among them
        assert set(kids) >= {"fastapi.endpoint", "mmserve.preprocess", "mmserve.request"}
        endpoint = kids["fastapi.endpoint"].attributes["code.function.name"]
        assert endpoint == "api.routes_chat.chat_completions"
        assert len(children(spans, root)) == len(kids)
        pre, req = kids["mmserve.preprocess"], kids["mmserve.request"]
        assert pre.attributes["mmserve.engine_requests"] == 1
        assert pre.attributes["mmserve.distinct_images"] == 1
        usage = out["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert req.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert req.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4
        assert req.attributes["gen_ai.response.finish_reasons"] == ("length",)
        assert req.attributes["mmserve.cached_tokens"] == cached
        assert req.attributes["mmserve.images"] == 1
        assert req.attributes["mmserve.video_frames"] == 0
        assert req.attributes["mmserve.image_tokens"] == 576  # LLaVA-1.5: 24 x 24 patches
        eng = engine_spans(spans, req)
        # the first request runs the vision tower; the second finds the image cached
        assert set(eng) == (
            ENGINE_CHILDREN if i == 0 else ENGINE_CHILDREN - {"mmserve.vision_tower"}
        )
        prefill, decode, queue = eng["mmserve.prefill"], eng["mmserve.decode"], eng["mmserve.queue"]
        assert prefill.attributes["mmserve.cached_tokens"] == cached
        assert prefill.attributes["mmserve.prompt_tokens"] == usage["prompt_tokens"]
        assert decode.attributes["mmserve.completion_tokens"] == 4
        assert decode.attributes["mmserve.finish_reason"] == "length"
        # one timeline: preprocess, queue, prefill, decode, inside the server span
        assert root.start_time == pre.start_time <= pre.end_time <= queue.end_time
        assert req.start_time == queue.start_time and queue.end_time == prefill.start_time
        assert prefill.end_time == decode.start_time <= decode.end_time == req.end_time
        assert req.end_time <= root.end_time
        if i == 0:
            vision = eng["mmserve.vision_tower"]
            assert vision.attributes["mmserve.images_encoded"] == 1
            assert prefill.start_time <= vision.start_time <= vision.end_time
            assert vision.end_time <= prefill.end_time
    assert outs[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 576


def test_traceparent_is_honoured(traced) -> None:
    client, exporter = traced
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{span_id}-01"}
    r = client.post("/v1/chat/completions", json=CHAT.body(), headers=headers)
    assert r.status_code == 200, r.text
    root, spans = one_trace(exporter, "POST /v1/chat/completions")
    assert root.context.trace_id == int(trace_id, 16)
    assert root.parent is not None and root.parent.span_id == int(span_id, 16)
    assert root.parent.is_remote
    (req,) = by_name(spans, "mmserve.request")
    assert req.attributes["mmserve.images"] == 0
    assert set(engine_spans(spans, req)) == ENGINE_CHILDREN - {"mmserve.vision_tower"}
    # a malformed traceparent starts a new trace instead of failing the request
    r = client.post("/v1/chat/completions", json=CHAT.body(), headers={"traceparent": "00-zz"})
    assert r.status_code == 200, r.text
    newest = by_name(exporter.get_finished_spans(), "POST /v1/chat/completions")[-1]
    assert newest.parent is None and newest.context.trace_id != int(trace_id, 16)


def test_n_choices_streaming_and_errors(traced) -> None:
    client, exporter = traced
    chunks = CHAT.stream(client, n=2, stream_options={"include_usage": True})
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    root, spans = one_trace(exporter, "POST /v1/chat/completions")
    (pre,) = by_name(spans, "mmserve.preprocess")
    assert pre.attributes["mmserve.engine_requests"] == 2
    reqs = by_name(spans, "mmserve.request")
    assert len(reqs) == 2 and all(r.parent.span_id == root.context.span_id for r in reqs)
    assert len({r.attributes["mmserve.request_id"] for r in reqs}) == 2
    assert sum(r.attributes["gen_ai.usage.output_tokens"] for r in reqs) == 8
    assert all(r.end_time <= root.end_time for r in reqs)
    exporter.clear()
    # a refused request: its server span with the status and no engine spans
    r = client.post("/v1/chat/completions", json=CHAT.body(max_tokens=-1))
    assert r.status_code == 400
    root, spans = one_trace(exporter, "POST /v1/chat/completions")
    assert root.attributes["http.response.status_code"] == 400
    assert not [s for s in spans if s.name.startswith("mmserve.")]
    exporter.clear()
    # outside /v1/ nothing is traced; an unknown path is named by its method only
    assert client.get("/health").status_code == 200
    assert client.get("/v1/nothing/here").status_code == 404
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["GET"]
    assert "http.route" not in spans[0].attributes


def test_ask_route_names_the_template_and_counts_every_question(traced, photos) -> None:
    client, exporter = traced
    image_id = upload(client, photos["cat.png"]).json()["id"]
    exporter.clear()
    body = {"questions": ["What is it?", "Where?", "Why?"], "max_tokens": 2, "temperature": 0}
    r = client.post(f"/v1/images/{image_id}/ask", json=body)
    assert r.status_code == 200, r.text
    root, spans = one_trace(exporter, "POST /v1/images/{image_id}/ask")
    assert root.attributes["http.route"] == "/v1/images/{image_id}/ask"
    assert root.attributes["url.path"] == f"/v1/images/{image_id}/ask"
    (pre,) = by_name(spans, "mmserve.preprocess")
    assert pre.attributes["mmserve.engine_requests"] == 3
    assert pre.attributes["mmserve.distinct_images"] == 1
    reqs = by_name(spans, "mmserve.request")
    assert len(reqs) == 3 and all(q.attributes["mmserve.images"] == 1 for q in reqs)
    answers = r.json()["answers"]
    cached = sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert sorted(q.attributes["mmserve.cached_tokens"] for q in reqs) == cached
    # the image is encoded once: one request's spans hold the tower call
    assert len(by_name(spans, "mmserve.vision_tower")) == 1


def test_off_by_default_imports_no_opentelemetry_sdk(model_dir) -> None:
    # (FastAPI itself imports the OpenTelemetry API, never the SDK)
    code = f"""
import sys
from fastapi.testclient import TestClient
from api.app import ServerSettings, create_app
from api.cli import main
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
app = create_app(Engine(EngineConfig(model_path={str(model_dir)!r})), ServerSettings())
with TestClient(app) as c:
    body = {{"messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": 2}}
    parent = {{"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}}
    r = c.post("/v1/chat/completions", json=body, headers=parent)
    assert r.status_code == 200, r.text
    assert app.state.mm.client.tracing is None
loaded = ("opentelemetry.sdk", "opentelemetry.exporter", "api.tracing")
print(sorted(m for m in sys.modules if m.startswith(loaded)))
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"')) == []


def test_endpoint_setting(monkeypatch, capsys) -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("https://c:4318/") == "https://c:4318/v1/traces"
    assert traces_url("http://c:4318/custom/path") == "http://c:4318/custom/path"
    ServerSettings(otlp_traces_endpoint="http://127.0.0.1:4318").validate()
    for bad in ("grpc://c:4317", "c:4318", "http://"):
        with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
            ServerSettings(otlp_traces_endpoint=bad).validate()
    assert main(["serve", "--otlp-traces-endpoint", "grpc://127.0.0.1:4317"]) == 2
    assert "OTLP/HTTP collector" in capsys.readouterr().err
    # without the extra: refused at start-up with the command that installs it
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("opentelemetry.exporter") else find_spec(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install 'mmserve\[tracing\]'"):
        ServerSettings(otlp_traces_endpoint="http://127.0.0.1:4318").validate()


def test_prompt_cache_key_is_recorded(traced) -> None:
    client, exporter = traced
    r = client.post("/v1/chat/completions", json=CHAT.body(prompt_cache_key="conv-7"))
    assert r.status_code == 200, r.text
    _, spans = one_trace(exporter, "POST /v1/chat/completions")
    (req,) = by_name(spans, "mmserve.request")
    assert req.attributes["mmserve.prompt_cache_key"] == "conv-7"
    exporter.clear()
    assert client.post("/v1/chat/completions", json=CHAT.body()).status_code == 200
    _, spans = one_trace(exporter, "POST /v1/chat/completions")
    (req,) = by_name(spans, "mmserve.request")
    assert "mmserve.prompt_cache_key" not in req.attributes
