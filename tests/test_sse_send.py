"""Streamed answers' send path (api/sse.py), the start-up GC freeze, and the host
benchmark's load generators (benchmarks/host_client.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from api.app import freeze_startup_objects
from api.metrics import Metrics
from api.settings import ServerSettings
from api.sse import EventStreamResponse, FastSendApp
from api.submit import EngineClient
from benchmarks.host_client import AnswerError, send_all
from mmserve.cancel import CancelToken
from mmserve.frontend.output import StreamUpdate
from mmserve.types import GenerateResult
from tests.helpers import ChatDefaults, stream_chunks
from tests.live_server import app_client

EVENTS = [f"data: {i}\n\n" for i in range(3)]


def _app(marked: bool = True, fast_send: bool = True, token: CancelToken | None = None):
    """An app streaming :data:`EVENTS` behind one middleware that records the messages it
    is sent; (app, what the middleware saw, whether the events' generator was closed)."""
    app = FastSendApp(fast_send=fast_send)
    seen: list[dict] = []
    closed: list[bool] = []

    class Recorder:
        mmserve_body_passthrough = marked

        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            async def record(msg) -> None:
                seen.append(msg)
                await send(msg)

            await self.inner(scope, receive, record)

    app.add_middleware(Recorder)

    @app.get("/events")
    async def events() -> EventStreamResponse:
        async def gen() -> AsyncIterator[str]:
            try:
                for i, e in enumerate(EVENTS):
                    if i == 1 and token is not None:
                        token.cancel()  # the client hangs up after the first event
                    yield e
            finally:
                closed.append(True)

        return EventStreamResponse(gen(), token)

    return app, seen, closed


def _call(app) -> list[dict]:
    """The messages the ASGI server is sent for ``GET /events``."""
    sent: list[dict] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/events",
        "raw_path": b"/events",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg: dict) -> None:
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    return sent


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_events_skip_a_passthrough_middleware_but_start_and_end_pass_it() -> None:
    app, seen, closed = _app()
    sent = _call(app)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-cache"
    assert _body(sent) == "".join(EVENTS).encode()
    assert [m.get("more_body") for m in sent[1:]] == [True, True, True, False]
    # the middleware saw the start and the last body message only
    assert [m["type"] for m in seen] == ["http.response.start", "http.response.body"]
    assert seen[1]["more_body"] is False and closed == [True]


@pytest.mark.parametrize("marked, fast_send", [(False, True), (True, False)])
def test_every_message_passes_an_unmarked_middleware_or_with_tracing(
    marked: bool, fast_send: bool
) -> None:
    app, seen, _ = _app(marked=marked, fast_send=fast_send)
    sent = _call(app)
    assert _body(sent) == "".join(EVENTS).encode()
    assert seen == sent  # nothing bypassed it


def test_a_cancelled_token_ends_the_stream_quietly_and_closes_the_events() -> None:
    token = CancelToken()
    app, _, closed = _app(token=token)
    sent = _call(app)
    assert _body(sent) == EVENTS[0].encode()  # nothing after the hang-up
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert closed == [True]


def test_freeze_startup_objects_takes_them_out_of_the_collector() -> None:
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()


def _chunk(delta: dict, finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return "data: " + json.dumps({"id": "c", "choices": [choice], "usage": None}) + "\n\n"


def _stream(tokens: int, content: list[str], error: bool = False) -> bytes:
    """A chat stream as the server writes it (include_usage), ``content`` its deltas."""
    out = [_chunk({"role": "assistant", "content": ""})]
    out += [_chunk({"content": c}) for c in content]
    if error:
        out.append("data: " + json.dumps({"error": {"message": "boom"}}) + "\n\n")
    out.append(_chunk({}, "length"))
    usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
    out.append("data: " + json.dumps({"id": "c", "choices": [], "usage": usage}) + "\n\n")
    out.append("data: [DONE]\n\n")
    return "".join(out).encode()


@pytest.fixture()
def canned() -> Iterator[tuple[str, list[bytes]]]:
    """A server on 127.0.0.1 answering every POST with the next body of its list."""
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = bodies.pop(0)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", bodies
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_load_generators_check_each_answers_tokens(
    client: str, canned: tuple[str, list[bytes]]
) -> None:
    url, bodies = canned
    # a quote and a '"usage": null' inside the text are escaped: still a content line
    bodies.append(_stream(3, ["a", 'b "usage": null', "c"]))
    assert send_all(client, url, [{"messages": []}], True, 3) == [3]
    bodies.append(_stream(2, ["ab"]))  # two tokens merged into one chunk
    assert send_all(client, url, [{"messages": []}], True, 2) == [2]
    bodies.append(_stream(3, ["a", "b", "c"]))
    with pytest.raises(AnswerError, match="3 completion tokens, 4 asked for"):
        send_all(client, url, [{"messages": []}], True, 4)
    bodies.append(_stream(2, ["a", "b"], error=True))
    with pytest.raises(AnswerError, match="boom"):
        send_all(client, url, [{"messages": []}], True, 2)
    bodies.append(_stream(2, []))  # no content at all
    with pytest.raises(AnswerError, match="0 content chunks"):
        send_all(client, url, [{"messages": []}], True, 2)


def _content(chunks: list[dict]) -> list[str]:
    return [
        c["choices"][0]["delta"]["content"]
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("content")
    ]


def test_stream_interval_sends_the_same_text_in_fewer_chunks(make_engine) -> None:
    """--stream-interval 4: a request's reader wakes for its first update, its last, and
    every 4 new tokens, so between the first and the last content chunk each carries at
    least 4 of the 16 tokens: at most 5 chunks, with the text and usage of interval 1."""
    body = ChatDefaults(max_tokens=16).body(ignore_eos=True, stream_options={"include_usage": True})
    runs = {}
    for interval in (1, 4):
        with app_client(make_engine(), stream_interval=interval) as client:
            runs[interval] = stream_chunks(client, body)
    one, four = (_content(runs[k]) for k in (1, 4))
    assert "".join(four) == "".join(one) and one
    assert 2 <= len(four) <= 5
    assert runs[4][-1]["usage"] == runs[1][-1]["usage"]
    assert runs[4][-1]["usage"]["completion_tokens"] == 16


def test_stream_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        ServerSettings(stream_interval=0).validate()


class _PumpedEngine:
    """An engine whose streams are plain async iterators (as a replica client's are, so
    the submission pumps them): one update per token and loop turn, ``tokens`` tokens,
    the result on the last."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def stream(self, req: object, final_only: bool) -> AsyncIterator[StreamUpdate]:
        for t in range(self.tokens):
            done = t == self.tokens - 1
            result = None
            if done:
                ids = list(range(self.tokens))
                text = "".join(f"{i}," for i in ids)
                result = GenerateResult("r", text, ids, "length", 1, 0, self.tokens, 0, 0, 0.0, 0.0)
            yield StreamUpdate(f"{t},", (t,), None, t + 1, result)
            await asyncio.sleep(0)


@pytest.mark.parametrize("interval, most_reads", [(1, 10), (3, 5)])
def test_stream_interval_on_pumped_streams(interval: int, most_reads: int) -> None:
    """A pumped stream (replicas) keeps the interval too: with 3, a read has the first
    token, or at least 3 new ones, or the result; the text is whole either way."""

    async def run() -> list[StreamUpdate]:
        client = EngineClient(_PumpedEngine(10), Metrics(), 100, 1)
        client.stream_interval = interval
        sub = client.submit([object()])  # the fake engine reads nothing of the request
        got = []
        async for batch in sub.batches():
            got += [upd for _, upd in batch]  # read at once: one token a read at interval 1
        return got

    got = asyncio.run(run())
    assert "".join(u.delta_text for u in got) == "".join(f"{i}," for i in range(10))
    assert got[-1].result is not None and len(got) <= most_reads
    if interval > 1:
        assert all(len(u.delta_ids) >= interval for u in got[1:-1])


def test_the_replica_ingress_takes_the_stream_interval(model_dir) -> None:
    """``--stream-interval`` reaches the ``--replicas`` ingress's client too (it builds its
    own, not through ``create_app``)."""
    from api.replicas.ingress import create_ingress_app
    from api.settings import ServerSettings
    from mmserve.config import EngineConfig
    from mmserve.frontend.frontend import FrontEnd, load_frontend_model

    front = FrontEnd(EngineConfig(model_path=str(model_dir)), load_frontend_model(model_dir))
    settings = ServerSettings(stream_interval=4)
    app = create_ingress_app(front, object(), settings, "m", 1)  # type: ignore[arg-type]
    assert app.state.mm.client.stream_interval == 4
