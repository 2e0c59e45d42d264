"""A client that hangs up stops its work at once (issue 45, item 2).

A real uvicorn on 127.0.0.1 (in this process, so the front end's figures can be read
while it runs; the engine's are asked of it over ``/v1/cache/stats``, so the same tests
run against the in-process engine and the engine process) gets requests with many
large pictures (or many frames, or many questions) from a raw socket that closes 0.05 s
or 0.5 s in (the pictures are still being fetched, decoded, hashed and preprocessed
then) or once the prefill has started.
After the hang-up: no vision-tower run and no generated token, a request still being
prepared never reaches the engine, at most the picture in hand when the client left is
finished, and the decoded-image bytes are back to their baseline within 1 s (and stay
there); the engine ends idle with every page back (accounting holds, every tree page
unlocked).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest
from PIL import Image

from api.app import ServerSettings, create_app
from api.disconnect import SCOPE_KEY, DisconnectMiddleware
from mmserve.cancel import Cancelled, CancelToken, current, using
from mmserve.frontend.async_engine import AsyncEngine
from mmserve.types import GenerateResult
from mmserve.vision.budget import DecodeBudget
from tests.helpers import MODEL, greedy, user
from tests.live_server import app_client, uvicorn_thread
from tests.videos import encode_mp4

SIDE = 2400  # a picture takes ~0.2 s to decode, hash and preprocess on one core
PICTURES = 8


@pytest.fixture(scope="module")
def served(make_engine) -> Iterator[tuple[str, object]]:
    """``(base URL, app)`` of a uvicorn serving a fresh tiny engine whose prefill runs
    in 64-token chunks (a prompt of eight pictures prefills over ~70 steps)."""
    engine = make_engine(max_prefill_tokens=64)
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    with uvicorn_thread(app) as url:
        yield url, app


_BASE: list[np.ndarray] = []


def picture(seed: int) -> bytes:
    """A ``SIDE`` x ``SIDE`` PNG, distinct per ``seed`` (no cache holds its features),
    that compresses well (~100 KB) but decodes to 17 MB."""
    if not _BASE:
        x = np.arange(SIDE, dtype=np.uint32)
        base = np.empty((SIDE, SIDE, 3), np.uint8)
        base[..., 0] = x[None, :] * 7 // 5 % 256
        base[..., 1] = x[:, None] * 3 // 2 % 256
        base[..., 2] = (x[None, :] + x[:, None]) // 3 % 256
        _BASE.append(base)
    a = _BASE[0].copy()
    rng = np.random.default_rng(seed)
    a[: SIDE // 8, : SIDE // 8] = rng.integers(0, 256, 3, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def image_parts(seed: int) -> list[dict]:
    """``PICTURES`` large pictures as data-URL content parts (distinct per ``seed``)."""
    urls = [
        "data:image/png;base64," + base64.b64encode(picture(seed * 100 + k)).decode()
        for k in range(PICTURES)
    ]
    return [{"type": "image_url", "image_url": {"url": u}} for u in urls]


LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


def chat_body(seed: int, stream: bool = False) -> dict:
    content = [*image_parts(seed), {"type": "text", "text": "Describe them all."}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **LONG} | (
        {"stream": True} if stream else {}
    )


def responses_body(seed: int, stream: bool = False) -> dict:
    parts = [{"type": "input_image", "image_url": p["image_url"]["url"]} for p in image_parts(seed)]
    content = [*parts, {"type": "input_text", "text": "Describe them all."}]
    return {
        "model": MODEL,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": 400,
        "temperature": 0,
        "stream": stream,
    }


class Counters:
    """The engine and front-end figures a hang-up must leave alone: the front end's read
    in this process (the API process's own objects), the engine's asked of the engine over
    HTTP (``/v1/cache/stats``: its control call), so the same test runs against the
    in-process engine and the engine process (``MMSERVE_TEST_ENGINE_PROCESS=1``)."""

    def __init__(self, app, url: str) -> None:
        self.st = app.state.mm
        self.url = url

    def engine(self) -> dict:
        """The engine's ``/v1/cache/stats``."""
        r = httpx.get(f"{self.url}/v1/cache/stats", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def decoded(self) -> int:
        """Decoded-image bytes the front end holds now."""
        return self.st.engine.processor.decode_budget.in_use

    def snapshot(self) -> dict[str, int]:
        """Tower runs, tokens generated (finished requests'), requests the engine took
        in, requests live there, pictures prepared and decoded bytes held."""
        eng = self.engine()
        return {
            "tower": eng["vision_tower_images"],
            "tokens": eng["completion_tokens"],
            "engine_requests": eng["requests_finished"] + eng["live_requests"],
            "live": eng["live_requests"],
            "prepared_images": len(self.st.media.transient),
            "decoded_bytes": self.decoded(),
        }

    def idle(self, timeout: float = 60) -> dict:
        """Wait until no request is queued in the app or live in the engine; then the
        engine's pages are all back (accounting holds, every tree page unlocked).
        Returns the engine's stats."""
        deadline = time.time() + timeout
        while True:
            if not (self.st.client.queued or self.st.client.online):
                stats = self.engine()
                if stats["live_requests"] == 0:
                    break
            assert time.time() < deadline, "requests still live after the hang-up"
            time.sleep(0.02)
        assert stats["accounting"] is not None and stats["accounting"]["ok"], stats
        assert stats["evictable_pages"] == stats["tree_pages"], stats  # lock_ref back to 0
        assert stats["running_requests"] == stats["waiting_requests"] == 0, stats
        return stats


def send_then_hang_up(url: str, path: str, body: dict, when: Callable[[], bool]) -> float:
    """POST ``body`` to ``path`` over a raw socket and close it once ``when()`` is true
    (polled every 5 ms); returns the ``time.monotonic()`` of the hang-up."""
    u = urlparse(url)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    try:
        s.sendall(head + data)
        deadline = time.monotonic() + 30
        while not when():
            assert time.monotonic() < deadline, "the moment to hang up never came"
            time.sleep(0.005)
    finally:
        s.close()
    return time.monotonic()


def after(seconds: float) -> Callable[[], bool]:
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0 >= seconds


def assert_released_within(counters: Counters, hung_up: float, baseline: int) -> float:
    """The decoded-image bytes back to ``baseline`` within 1 s of ``hung_up`` and still
    there 0.3 s later (no picture decoded after); returns how long it took (s)."""
    while counters.decoded() != baseline:
        assert time.monotonic() - hung_up < 1.0, "decoded images still held 1 s after"
        time.sleep(0.005)
    took = time.monotonic() - hung_up
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        assert counters.decoded() == baseline
        time.sleep(0.005)
    return took


PREPARING = [  # (name, path, body builder): pictures prepared before the engine sees them
    ("chat", "/v1/chat/completions", lambda seed: chat_body(seed)),
    ("chat_stream", "/v1/chat/completions", lambda seed: chat_body(seed, stream=True)),
    ("responses", "/v1/responses", lambda seed: responses_body(seed)),
    ("responses_stream", "/v1/responses", lambda seed: responses_body(seed, stream=True)),
]


@pytest.mark.parametrize("delay", [0.05, 0.5])
@pytest.mark.parametrize(("kind", "path", "build"), PREPARING, ids=[c[0] for c in PREPARING])
def test_hang_up_while_pictures_are_prepared_stops_the_work(
    served, kind, path, build, delay
) -> None:
    url, app = served
    counters = Counters(app, url)
    seed = 1000 * PREPARING.index((kind, path, build)) + int(delay * 100)
    body = build(seed)
    before = counters.snapshot()
    hung_up = send_then_hang_up(url, path, body, after(delay))
    at_hang_up = counters.snapshot()
    took = assert_released_within(counters, hung_up, before["decoded_bytes"])
    counters.idle()
    end = counters.snapshot()
    # the preparation stopped: at most the picture in hand was finished after the hang-up
    assert end["prepared_images"] - at_hang_up["prepared_images"] <= 1, (end, at_hang_up)
    assert end["prepared_images"] - before["prepared_images"] < PICTURES
    # the request never reached the engine: no tower run, no token
    assert end["engine_requests"] == before["engine_requests"], (kind, before, end)
    assert end["tower"] == before["tower"] and end["tokens"] == before["tokens"]
    print(f"{kind} hung up at {delay} s: decoded images released {took:.3f} s after")
    assert_server_fine(url)


def test_hang_up_mid_prefill_aborts_before_the_next_step(served) -> None:
    url, app = served
    counters = Counters(app, url)
    for k, stream in enumerate((False, True)):
        before = counters.snapshot()
        body = chat_body(5000 + k, stream=stream)

        def prefilling(start: int = before["tower"]) -> bool:  # the first picture ran
            return counters.engine()["vision_tower_images"] > start

        send_then_hang_up(url, "/v1/chat/completions", body, prefilling)
        at_hang_up = counters.snapshot()
        counters.idle()
        end = counters.snapshot()
        # a step already running when the client left may finish (one picture at most
        # starts in a 64-token chunk); nothing after it: the other pictures never run
        assert end["tower"] - at_hang_up["tower"] <= 1, (stream, at_hang_up, end)
        assert end["tower"] - before["tower"] < PICTURES
        assert end["tokens"] == before["tokens"], (stream, before, end)
        assert end["decoded_bytes"] == before["decoded_bytes"]
    assert_server_fine(url)


def hang_up_before_the_engine(url: str, counters: Counters, path: str, body: dict) -> None:
    """POST ``body`` to ``path``, hang up at 0.05 s, and check that the decoded bytes come
    back within 1 s and that no engine request, tower run or token followed."""
    before = counters.snapshot()
    hung_up = send_then_hang_up(url, path, body, after(0.05))
    assert_released_within(counters, hung_up, before["decoded_bytes"])
    counters.idle()
    end = counters.snapshot()
    assert end["engine_requests"] == before["engine_requests"], (before, end)
    assert end["tower"] == before["tower"] and end["tokens"] == before["tokens"]
    assert_server_fine(url)


def test_hang_up_during_ask_never_reaches_the_engine(served) -> None:
    url, app = served
    counters = Counters(app, url)
    up = httpx.post(
        f"{url}/v1/images", files={"file": ("big.png", picture(7777), "image/png")}, timeout=60
    )
    assert up.status_code == 200, up.text
    image_id = up.json()["id"]
    body = {"model": MODEL, "questions": [f"Question {i}?" for i in range(32)], **LONG}
    hang_up_before_the_engine(url, counters, f"/v1/images/{image_id}/ask", body)


def test_hang_up_during_video_qa_never_reaches_the_engine(served) -> None:
    url, app = served
    counters = Counters(app, url)
    rng = np.random.default_rng(3)
    base = np.kron(rng.integers(0, 256, (90, 160, 3), dtype=np.uint8), np.ones((8, 8, 1), np.uint8))
    frames = []
    for i in range(48):
        f = base.copy()
        f[40:120, 20 * i : 20 * i + 80] = (255, 40 * (i % 6), 200)
        frames.append(f)
    up = httpx.post(
        f"{url}/v1/videos", files={"file": ("v.mp4", encode_mp4(frames), "video/mp4")}, timeout=60
    )
    assert up.status_code == 200, up.text
    vid = up.json()["id"]
    body = {
        "model": MODEL,
        "questions": ["What moves?", "What colour?"],
        "mode": "per_frame",
        "num_frames": 48,
        **LONG,
    }
    hang_up_before_the_engine(url, counters, f"/v1/videos/{vid}/qa", body)


def assert_server_fine(url: str) -> None:
    """A later request is answered and the KV pool's accounting holds."""
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    stats = httpx.get(f"{url}/v1/cache/stats", timeout=30).json()
    assert stats["live_requests"] == 0 and stats["accounting"]["ok"], stats


# ---- the pieces, without sockets ---------------------------------------------------------
def test_a_request_whose_client_left_on_the_way_is_never_scheduled(make_engine, photos) -> None:
    """The token is cancelled after the route submitted but before the engine thread took
    the request in: it is aborted there, before any step (no tower run, no token)."""
    eng = make_engine()
    image = eng.processor.prepare_image(photos["astronaut.png"], eng.processor.image_mode(1))
    req = eng.processor.make_request(
        messages=user(None, "Describe it."), images=[image], params=greedy(8)
    )
    aeng = AsyncEngine(eng)
    token = CancelToken()

    async def run() -> GenerateResult:
        with using(token):
            gen = asyncio.ensure_future(aeng.generate(req))
            await asyncio.sleep(0)  # submitted: the add waits in the engine's inbox
            token.cancel()
            aeng.start()
            return await asyncio.wait_for(gen, timeout=60)

    try:
        res = asyncio.run(run())
    finally:
        aeng.stop()
    assert res.finish_reason == "abort" and res.completion_tokens == 0
    assert eng.runner.vision_tower_images == 0
    assert eng.stats.prefill_steps == 0 and eng.stats.decode_steps == 0
    eng.scheduler.check_accounting()


def test_preparation_stops_between_items_and_releases_the_budget(make_engine, photos) -> None:
    """Decoding, preprocessing and request building raise ``Cancelled`` under a cancelled
    token, holding nothing; without a token (batch lines) nothing changes."""
    eng = make_engine()
    proc = eng.processor
    mode = proc.image_mode(1)
    token = CancelToken()
    token.cancel()
    data = picture(4242)
    with using(token):
        with pytest.raises(Cancelled):
            proc.prepare_image(data, mode, proc.request_pixels())
        with pytest.raises(Cancelled):
            proc.make_request(messages=user("Hi"), params=greedy(2))
    assert proc.decode_budget.in_use == 0
    assert proc.prepare_image(data, mode).pixels is not None  # no token: prepared
    # a token cancelled while a picture decodes: that picture is dropped, not preprocessed
    late = CancelToken()
    decode = proc.decode_budget.acquire

    def acquire_then_hang_up(n: int) -> None:
        decode(n)
        late.cancel()

    proc.decode_budget.acquire = acquire_then_hang_up  # type: ignore[method-assign]
    try:
        with using(late), pytest.raises(Cancelled):
            proc.prepare_image(picture(4243), mode)
    finally:
        del proc.decode_budget.acquire
    assert proc.decode_budget.in_use == 0


def test_the_watcher_leaves_the_body_to_the_route_and_sees_the_hang_up() -> None:
    """The middleware passes every body message to the app untouched, then waits for the
    disconnect on its own; the app's later ``receive`` (a stream listening) gets it too."""
    seen: dict[str, object] = {}

    async def app(scope, receive, send) -> None:
        token = scope[SCOPE_KEY]
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        seen["body"] = body
        seen["before"] = token.cancelled
        await asyncio.wait_for(receive(), timeout=5)  # waits for the hang-up
        seen["after"] = token.cancelled

    async def run() -> None:
        inbox: asyncio.Queue[dict] = asyncio.Queue()
        for part, more in ((b"ab", True), (b"cd", False)):
            inbox.put_nowait({"type": "http.request", "body": part, "more_body": more})
        task = asyncio.ensure_future(DisconnectMiddleware(app)({"type": "http"}, inbox.get, None))
        await asyncio.sleep(0.05)
        assert seen == {"body": b"abcd", "before": False}
        inbox.put_nowait({"type": "http.disconnect"})
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(run())
    assert seen["after"] is True


def test_a_disconnect_after_the_whole_answer_is_no_hang_up() -> None:
    """The server reports ``http.disconnect`` once the response is sent (uvicorn does):
    work the route left running (a task inheriting the token) is not cancelled."""
    tokens: list[CancelToken] = []

    async def app(scope, receive, send) -> None:
        await receive()
        tokens.append(scope[SCOPE_KEY])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        await asyncio.sleep(0.05)  # the watcher sees the disconnect meanwhile

    async def run() -> None:
        inbox: asyncio.Queue[dict] = asyncio.Queue()
        inbox.put_nowait({"type": "http.request", "body": b"", "more_body": False})

        async def send(msg: dict) -> None:
            if msg["type"] == "http.response.body":
                inbox.put_nowait({"type": "http.disconnect"})

        await DisconnectMiddleware(app)({"type": "http"}, inbox.get, send)

    asyncio.run(run())
    assert tokens[0].cancelled is False


def test_a_decode_waiting_for_room_stops_when_its_client_leaves() -> None:
    """A decode waiting for room in a full decoded-image budget gives up within 50 ms of
    the hang-up (not after the 5 s wait), holding nothing."""
    budget = DecodeBudget(capacity=100, wait_seconds=5)
    budget.acquire(100)  # another request's picture fills it
    token = CancelToken()
    threading.Timer(0.1, token.cancel).start()
    t0 = time.monotonic()
    with using(token), pytest.raises(Cancelled):
        budget.acquire(50)
    assert time.monotonic() - t0 < 1
    assert budget.in_use == 100 and budget.refusals == 0


@pytest.mark.parametrize("route", ["/v1/images", "/v1/files"])
def test_an_upload_whose_client_leaves_during_the_decode_stores_nothing(
    make_engine, tmp_path, route
) -> None:
    """An upload (``POST /v1/images``, ``POST /v1/files`` with purpose vision) whose
    client leaves while its picture decodes stops there: 499, nothing stored (listing and
    directory empty), the decoded-image budget back where it was."""
    eng = make_engine()
    directory = tmp_path / "images"
    with app_client(eng, image_store_dir=str(directory)) as c:
        # the app's front end decodes (the engine's own, or the split server's)
        budget = c.app.state.mm.engine.processor.decode_budget
        decode = budget.acquire

        def acquire_then_hang_up(n: int) -> None:
            decode(n)
            token = current()
            assert token is not None  # the request's token reached the worker thread
            token.cancel()

        budget.acquire = acquire_then_hang_up  # type: ignore[method-assign]
        try:
            extra = {"data": {"purpose": "vision"}} if route == "/v1/files" else {}
            r = c.post(route, files={"file": ("big.png", picture(4444))}, **extra)
        finally:
            del budget.acquire
        assert r.status_code == 499
        assert c.get("/v1/images").json()["data"] == []
        assert c.get("/v1/files?purpose=vision").json()["data"] == []
    assert budget.in_use == 0
    assert list(directory.iterdir()) == []


def test_a_clip_too_long_check_is_no_400_for_a_client_gone(monkeypatch) -> None:
    """``/v1/videos/{id}/qa``: the check that measures how many frames would fit builds
    requests; a client gone meanwhile is ``Cancelled`` (the route's 499), never turned
    into the 400 ``clip_too_long`` its ``except`` gives a request that does not fit."""
    from types import SimpleNamespace

    from api import routes_videos
    from api.errors import APIError

    def make_request(**_) -> None:
        raise Cancelled("client disconnected")

    processor = SimpleNamespace(make_request=make_request)
    st = SimpleNamespace(engine=SimpleNamespace(processor=processor))
    monkeypatch.setattr(routes_videos, "clip_prompt", lambda *a: ([], [], []))
    part = SimpleNamespace(param=lambda n: "video.frames")
    err = APIError(400, "too long")
    with pytest.raises(Cancelled):
        asyncio.run(routes_videos._clip_too_long(st, [1, 2], [], "Q?", greedy(4), err, part))


def test_until_cancelled_ends_quietly_when_the_hang_up_reaches_the_events_first() -> None:
    """A hang-up can end the events' own wait first (a submission cancelled by the same
    token raises ``ClientDisconnected`` inside them): the stream still ends quietly; a
    ``Cancelled`` with no hang-up still raises."""
    from api.disconnect import until_cancelled
    from api.errors import ClientDisconnected

    async def events(token: CancelToken):
        yield 1
        token.cancel()
        raise ClientDisconnected("the submission was cancelled")

    async def drain(token: CancelToken, source) -> list[int]:
        return [x async for x in until_cancelled(source, token)]

    token = CancelToken()
    assert asyncio.run(drain(token, events(token))) == [1]

    async def fails():
        yield 1
        raise ClientDisconnected("not a hang-up")

    with pytest.raises(ClientDisconnected):
        asyncio.run(drain(CancelToken(), fails()))


def test_a_long_lived_token_keeps_no_hook_of_a_finished_submission(make_engine) -> None:
    """A token that outlives many submissions (a WebSocket's, one per connection) holds
    no cancel hook of a submission whose requests have all ended: the hook would keep
    the submission (its requests, results and frames) alive as long as the token."""
    token = CancelToken()
    with app_client(make_engine()) as c:
        st = c.app.state.mm

        async def ask_three_times() -> int:
            with using(token):
                for k in range(3):
                    req = st.engine.processor.make_request(
                        messages=user(f"hello {k}"), params=greedy(2)
                    )
                    (res,) = await st.client.submit([req], final_only=True).answers()
                    assert res.finish_reason == "length"
            return len(token._callbacks)

        assert c.portal.call(ask_three_times) == 0
