"""Live video streams (/v1/streams): answers equal a /qa clip's over the same frames, the
question reuses the held prefix, deletion / expiry / a closed WebSocket release every
lock and page, streams share only content keys, bad frames get a 4xx naming the field
and leave the stream usable, and --max-streams bounds them. Everything is read over
HTTP, so the file runs as it is against the process-split server too."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.vision.image import ImageLimits
from mmserve.vision.video import Video, VideoLimits
from tests.helpers import (
    MODEL,
    assert_error,
    engine_figures,
    png_bytes,
    post_stream_frames,
    stream_ask,
    upload_video,
    video_qa,
    wait_stream_held,
    websocket_refusal,
)
from tests.live_server import (
    app_client,
    engine_pid,
    live_server_process,
    uvicorn_thread,
    wait_health,
)
from tests.videos import encode_mp4, rgb_frames

pytest.importorskip("av")

Q = "What happens in this clip?"
GREEDY = {"temperature": 0.0, "max_tokens": 5}


def noise_png(seed: int, w: int = 40, h: int = 30) -> bytes:
    rng = np.random.default_rng(seed)
    return png_bytes(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))


def at_rest(c: TestClient) -> dict:
    """The engine's figures once nothing runs, with the pool accounting checked."""
    deadline = time.time() + 30
    while True:
        stats = c.get("/v1/cache/stats").json()
        if stats["accounting"] is not None or time.time() > deadline:
            break
        time.sleep(0.05)
    acc = stats["accounting"]
    assert acc is not None and acc["ok"], stats
    return stats


def assert_released(c: TestClient) -> None:
    """No prefix held, no page locked or used: every page free or evictable, and free
    again after a flush."""
    stats = at_rest(c)
    assert (stats["held_prefixes"], stats["locked_pages"], stats["used_pages"]) == (0, 0, 0)
    assert stats["free_pages"] + stats["evictable_pages"] == stats["pool_pages"]
    assert c.post("/v1/cache/flush").status_code == 200
    stats = at_rest(c)
    assert stats["free_pages"] == stats["pool_pages"] and stats["tree_pages"] == 0


@pytest.fixture(scope="module")
def clip() -> bytes:
    return encode_mp4(rgb_frames(8, seed=3), fps=4)


@pytest.fixture(scope="module")
def client(families):
    limits = ImageLimits(max_bytes=60_000, max_side=512)
    engine = families["llava"].make_engine(max_total_tokens=16384, image_limits=limits)
    with app_client(engine, max_streams=3, max_stream_frames_per_post=3) as c:
        yield c


@pytest.fixture(scope="module")
def ov_client(families):
    with app_client(families["llava-onevision"].make_engine(max_total_tokens=8192)) as c:
        yield c


@pytest.mark.parametrize("family", ["llava", "llava-onevision"])
def test_stream_answers_equal_a_qa_clip_and_reuse_the_held_prefix(
    family: str, client: TestClient, ov_client: TestClient, clip: bytes
) -> None:
    c = ov_client if family == "llava-onevision" else client
    n = 6 if family == "llava-onevision" else 3
    vid = upload_video(c, clip).json()["id"]
    system = "You describe video."
    events = video_qa(c, vid, questions=[Q], mode="clip", num_frames=n, system=system, **GREEDY)
    (want,) = [e for e in events if e["type"] == "answer"]
    frames = events[0]["frames"]
    images = Video(clip, VideoLimits()).frames([f["frame_index"] for f in frames])
    sid = c.post("/v1/streams", json={"system": system}).json()["id"]
    # the frames as PNGs, posted one at a time at the clip's times
    for f, im in zip(frames, images, strict=True):
        r = post_stream_frames(c, sid, [png_bytes(im)], [f["timestamp"]])
        assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    info = wait_stream_held(c, sid, n)
    assert info["frames_held"] == n and info["tokens"] > 0
    got = stream_ask(c, sid, [Q], **GREEDY)
    (ans,) = got["answers"]
    assert (ans["answer"], ans["finish_reason"]) == (want["text"], want["finish_reason"])
    assert ans["usage"]["prompt_tokens"] == want["prompt_tokens"]
    # the question prefilled only what follows the last frame's run
    cached = ans["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == ans["usage"]["cached_tokens"] >= info["tokens"]
    assert want["prompt_tokens"] - cached < 40 < info["tokens"]
    assert got["usage"]["cached_tokens"] == cached and got["window"]["frames"] == n
    # the same frames replayed from the uploaded video: the same answer
    sid2 = c.post("/v1/streams", json={"system": system}).json()["id"]
    r = c.post(f"/v1/streams/{sid2}/frames", json={"video_id": vid, "num_frames": n})
    assert r.status_code == 200 and r.json()["accepted"] == n, r.text
    assert [f["image_id"] for f in r.json()["frames"]] == [f["image_id"] for f in frames]
    assert stream_ask(c, sid2, [Q], **GREEDY)["answers"][0]["answer"] == want["text"]
    for s in (sid, sid2):
        assert c.delete(f"/v1/streams/{s}").json()["deleted"] is True
    assert_released(c)


def test_streamed_ask_and_window(client: TestClient) -> None:
    sid = client.post("/v1/streams", json={"max_frames": 3, "roll_frames": 2}).json()["id"]
    for i in range(5):  # 3 frames fill the window; the 4th rolls it to the last 1 + itself
        r = post_stream_frames(client, sid, [noise_png(i)], [float(i)])
        assert r.status_code == 200, r.text
    info = wait_stream_held(client, sid, 3)
    assert (info["frames_held"], info["segments"], info["window"]["first_frame"]) == (3, 2, 2)
    # only the current segment's prefix stays locked: the first one was released
    stats = at_rest(client)
    assert stats["held_prefixes"] == 1
    assert stats["locked_pages"] == info["tokens"] // stats["page_size"]
    whole = stream_ask(client, sid, ["Describe it."], **GREEDY)
    last = stream_ask(client, sid, ["Describe it."], window=1, **GREEDY)
    secs = stream_ask(client, sid, ["Describe it."], window={"seconds": 1.0}, **GREEDY)
    assert (whole["window"]["frames"], last["window"]["frames"]) == (3, 1)
    assert secs["window"] == {"frames": 2, "first_frame": 3, "start": 3.0, "end": 4.0}
    r = client.post(
        f"/v1/streams/{sid}/ask", json={"questions": ["Describe it."], "stream": True, **GREEDY}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    text = "".join(e["delta"] for e in events if e["object"] == "stream.answer.delta")
    assert events[-1]["object"] == "stream.answers"
    assert text == events[-1]["answers"][0]["answer"] == whole["answers"][0]["answer"]
    assert r.text.rstrip().endswith("data: [DONE]")
    client.delete(f"/v1/streams/{sid}")
    assert_released(client)


def test_fps_thins_frames_and_reports_them(client: TestClient) -> None:
    sid = client.post("/v1/streams", json={"fps": 1.0}).json()["id"]
    times = [0.0, 0.4, 0.8, 1.0, 1.5, 2.1]
    got = []
    for i in range(0, 6, 3):
        r = post_stream_frames(client, sid, [noise_png(i + k) for k in range(3)], times[i : i + 3])
        assert r.status_code == 200, r.text
        got += [f["kept"] for f in r.json()["frames"]]
    assert got == [True, False, False, True, False, True]
    info = client.get(f"/v1/streams/{sid}").json()
    assert (info["frames_received"], info["frames_thinned"], info["frames_held"]) == (6, 3, 3)
    client.delete(f"/v1/streams/{sid}")


def test_delete_mid_prefill_and_a_closed_websocket_release_locks_and_pages(
    client: TestClient,
) -> None:
    assert_released(client)
    # deleted while its prefill may still run: the prefill is aborted, nothing stays held
    sid = client.post("/v1/streams", json={}).json()["id"]
    assert post_stream_frames(client, sid, [noise_png(1), noise_png(2)]).status_code == 200
    assert client.delete(f"/v1/streams/{sid}").status_code == 200
    assert client.get(f"/v1/streams/{sid}").status_code == 404
    assert_released(client)
    # a WebSocket client: frames in as binary and JSON, answers out; gone -> stream gone
    sid = client.post("/v1/streams", json={}).json()["id"]
    with client.websocket_connect(f"/v1/streams/{sid}/ws") as ws:
        ws.send_bytes(noise_png(3))
        reply = json.loads(ws.receive_text())
        assert (reply["type"], reply["accepted"]) == ("frames", 1)
        frame = base64.b64encode(noise_png(4)).decode()
        ws.send_text(json.dumps({"type": "frame", "data": frame, "timestamp": 5.0}))
        reply = json.loads(ws.receive_text())
        assert (reply["type"], reply["frames_held"], reply["frames"][0]["timestamp"]) == (
            "frames",
            2,
            5.0,
        )
        ws.send_text(json.dumps({"questions": ["Hi?"], **GREEDY}))
        reply = json.loads(ws.receive_text())
        assert reply["type"] == "answers" and reply["answers"][0]["finish_reason"] == "length"
        assert reply["window"]["frames"] == 2
        ws.send_text(json.dumps({"frames": [{"data": "!!", "timestamp": 9.0}]}))
        err = json.loads(ws.receive_text())
        assert (err["type"], err["error"]["param"]) == ("error", "frames[0].data")
        wait_stream_held(client, sid, 2)
        assert at_rest(client)["held_prefixes"] == 1 and at_rest(client)["locked_pages"] > 0
    deadline = time.time() + 10
    while client.get(f"/v1/streams/{sid}").status_code != 404:
        assert time.time() < deadline, "the stream outlived its WebSocket"
        time.sleep(0.05)
    assert_released(client)


def test_a_websocket_ask_is_aborted_when_its_client_leaves(families) -> None:
    """Over a real uvicorn (which, unlike the test client, never cancels the app when a
    socket closes): a WebSocket that closes while its ask decodes has the ask's engine
    request aborted at once (not decoded to ``max_tokens``: ~6 s here), and the stream
    goes with the socket. A refused handshake answers its status and JSON body."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    engine = families["llava"].make_engine(max_total_tokens=16384)
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    long_ask = {"questions": ["Hi?"], "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    with uvicorn_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        ws_url = url.replace("http://", "ws://")
        with pytest.raises(InvalidStatus) as refused:
            connect(f"{ws_url}/v1/streams/stream-{'0' * 32}/ws", open_timeout=10)
        assert refused.value.response.status_code == 404
        assert json.loads(bytes(refused.value.response.body))["error"]["code"] == "stream_not_found"
        sid = http.post("/v1/streams", json={}).json()["id"]
        with connect(f"{ws_url}/v1/streams/{sid}/ws", open_timeout=10) as ws:
            ws.send(noise_png(3))
            assert json.loads(ws.recv(timeout=30))["accepted"] == 1
            ws.send(json.dumps(long_ask))
            deadline = time.time() + 30
            while http.get("/v1/cache/stats").json()["running_requests"] == 0:  # decoding
                assert time.time() < deadline, "the ask never started"
                time.sleep(0.01)
        left = time.time()
        while http.get("/v1/cache/stats").json()["running_requests"]:
            assert time.time() - left < 1.5, "the ask kept decoding after its client left"
            time.sleep(0.02)
        deadline = time.time() + 10
        while http.get(f"/v1/streams/{sid}").status_code != 404:
            assert time.time() < deadline, "the stream outlived its WebSocket"
            time.sleep(0.05)
        assert http.get("/v1/cache/stats").json()["held_prefixes"] == 0


def test_streams_frame_pixels_are_bounded(client: TestClient, families) -> None:
    """A stream reserves its window's frame pixels (``max_frames`` times a frame's) at
    its first frame, out of ``--max-stream-pixel-bytes`` for all streams: 429
    ``stream_pixels_full`` when others hold the rest, 400 naming ``max_frames`` when the
    window alone is too large; a deleted stream's reservation is free again."""
    sid = client.post("/v1/streams", json={"max_frames": 2}).json()["id"]
    assert client.get(f"/v1/streams/{sid}").json()["pixel_bytes_reserved"] == 0
    assert post_stream_frames(client, sid, [noise_png(1)]).status_code == 200
    frame = client.get(f"/v1/streams/{sid}").json()["pixel_bytes_reserved"] // 2
    client.delete(f"/v1/streams/{sid}")
    assert frame > 0
    engine = families["llava"].make_engine(max_total_tokens=8192)
    with app_client(engine, max_stream_pixel_bytes=5 * frame) as c:
        # a window that could never hold its frames is refused when made
        r = c.post("/v1/streams", json={"max_frames": 6})
        err = assert_error(r, 400, "--max-stream-pixel-bytes", "stream_window_too_large")
        assert err["param"] == "max_frames"
        a, b, big = (c.post("/v1/streams", json={"max_frames": n}).json()["id"] for n in (3, 3, 5))
        for i in range(5):  # a rolls within its reservation
            assert post_stream_frames(c, a, [noise_png(i)], [float(i)]).status_code == 200
        assert c.get(f"/v1/streams/{a}").json()["pixel_bytes_reserved"] == 3 * frame
        r = post_stream_frames(c, b, [noise_png(7)], [1.0])
        assert_error(r, 429, "--max-stream-pixel-bytes", "stream_pixels_full")
        r = post_stream_frames(c, big, [noise_png(8)], [1.0])  # fits alone, not beside a
        assert_error(r, 429, "--max-stream-pixel-bytes", "stream_pixels_full")
        assert c.get(f"/v1/streams/{b}").json()["frames_received"] == 0  # refused whole
        c.delete(f"/v1/streams/{a}")
        assert post_stream_frames(c, b, [noise_png(7)], [1.0]).status_code == 200
        for sid in (b, big):
            c.delete(f"/v1/streams/{sid}")


def test_a_hold_lost_with_the_engine_process_is_reported_and_prefilled_again(
    model_dir,
) -> None:
    """The engine process dies after a stream's prefix is held: a new one holds nothing,
    so ``GET`` stops reporting held tokens (and says why), questions still answer, and the
    next frame prefills the whole window into a new hold."""
    import os
    import signal

    with (
        live_server_process(model_dir, timeout=180) as (url, srv),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        sid = http.post("/v1/streams", json={}).json()["id"]
        assert post_stream_frames(http, sid, [noise_png(1)], [1.0]).status_code == 200
        before = wait_stream_held(http, sid, 1)["cached"]["tokens"]
        assert before > 0
        os.kill(engine_pid(srv), signal.SIGKILL)
        wait_health(url, 503, 30)
        wait_health(url, 200, 120)
        info = http.get(f"/v1/streams/{sid}").json()
        assert (info["cached"]["tokens"], info["cached"]["frames"]) == (0, 0), info
        assert "restarted" in info["cached"]["error"], info
        assert stream_ask(http, sid, ["Hi?"], **GREEDY)["answers"][0]["finish_reason"] == "length"
        assert post_stream_frames(http, sid, [noise_png(2)], [2.0]).status_code == 200
        assert wait_stream_held(http, sid, 2)["cached"]["tokens"] > before
        http.delete(f"/v1/streams/{sid}")


@pytest.mark.parametrize("streamed", [False, True])
def test_deleting_a_stream_ends_its_asks(client: TestClient, streamed: bool) -> None:
    """A stream deleted while an ask about it decodes: the ask's engine requests are
    aborted at once, and the ask answers 404 ``stream_not_found`` (streamed: an error
    event, then ``[DONE]``) instead of decoding to ``max_tokens`` for a stream that is
    gone."""
    import threading

    sid = client.post("/v1/streams", json={}).json()["id"]
    assert post_stream_frames(client, sid, [noise_png(1)]).status_code == 200
    body = {"questions": ["Hi?"], "max_tokens": 3000, "ignore_eos": True, "stream": streamed}
    got: list = []
    asker = threading.Thread(
        target=lambda: got.append(client.post(f"/v1/streams/{sid}/ask", json=body))
    )
    asker.start()
    deadline = time.time() + 30
    while engine_figures(client)["running_requests"] == 0:
        assert time.time() < deadline, "the ask never started"
        time.sleep(0.01)
    assert client.delete(f"/v1/streams/{sid}").status_code == 200
    asker.join(10)
    assert not asker.is_alive(), "the ask kept decoding after its stream was deleted"
    (r,) = got
    if streamed:
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert (err["object"], err["error"]["code"]) == ("error", "stream_not_found")
    else:
        assert_error(r, 404, "no stream with id", "stream_not_found")
    assert_released(client)


def test_idle_streams_expire_and_release(families) -> None:
    engine = families["llava"].make_engine(max_total_tokens=8192)
    with app_client(engine, stream_idle_seconds=3.0) as c:
        sid = c.post("/v1/streams", json={}).json()["id"]
        assert post_stream_frames(c, sid, [noise_png(5)]).status_code == 200
        while not (info := c.get(f"/v1/streams/{sid}").json()).get("cached", {}).get("frames"):
            assert "cached" in info, info
            stream_ask(c, sid, ["Hi?"], **GREEDY)  # activity, while the prefill runs
        assert at_rest(c)["held_prefixes"] == 1
        time.sleep(4.5)  # no frames, no questions: the expiry task deletes it
        assert at_rest(c)["held_prefixes"] == 0
        assert_error(c.get(f"/v1/streams/{sid}"), 404, "no stream", "stream_not_found")
        assert_released(c)
        # an ask that answers for longer than the idle time is activity, not idleness
        sid = c.post("/v1/streams", json={}).json()["id"]
        assert post_stream_frames(c, sid, [noise_png(6)]).status_code == 200
        start = time.time()
        long = stream_ask(c, sid, ["Hi?"], max_tokens=4000, ignore_eos=True, temperature=0)
        assert time.time() - start > 3.0, "the ask was too short to test expiry"
        assert long["answers"][0]["finish_reason"] == "length"
        assert c.get(f"/v1/streams/{sid}").status_code == 200  # touched when it ended
        c.delete(f"/v1/streams/{sid}")


def test_two_streams_share_nothing_but_content_keys(client: TestClient) -> None:
    a = client.post("/v1/streams", json={}).json()["id"]
    b = client.post("/v1/streams", json={}).json()["id"]
    same = [noise_png(7), noise_png(8)]
    for sid in (a, b):
        assert post_stream_frames(client, sid, same, [0.0, 1.0]).status_code == 200
        wait_stream_held(client, sid, 2)
    held = client.get(f"/v1/streams/{a}").json()["tokens"]
    assert client.get(f"/v1/streams/{b}").json()["tokens"] == held
    # a frame posted to one is not in the other's window
    assert post_stream_frames(client, a, [noise_png(9)], [2.0]).status_code == 200
    assert client.get(f"/v1/streams/{b}").json()["frames_held"] == 2
    # a's end leaves b's prefix held (the two held the same pages: content keys)
    client.delete(f"/v1/streams/{a}")
    stats = at_rest(client)
    assert stats["held_prefixes"] == 1 and stats["locked_pages"] >= held // stats["page_size"]
    ans = stream_ask(client, b, ["Hi?"], **GREEDY)["answers"][0]
    assert ans["usage"]["cached_tokens"] >= held
    # another cache salt shares nothing with b
    c = client.post("/v1/streams", json={"cache_salt": "other"}).json()["id"]
    assert post_stream_frames(client, c, same, [0.0, 1.0]).status_code == 200
    wait_stream_held(client, c, 2)
    alone = stream_ask(client, c, ["Hi?"], **GREEDY)["answers"][0]
    assert alone["usage"]["cached_tokens"] >= held  # its own held prefix
    assert (
        stream_ask(client, b, ["Hi?"], cache_salt="x", **GREEDY)["answers"][0]["usage"][
            "cached_tokens"
        ]
        < 16
    )
    for sid in (b, c):
        client.delete(f"/v1/streams/{sid}")
    assert_released(client)


def big_png() -> bytes:
    return noise_png(11, 200, 200)  # ~120 kB: over this server's 60 kB image limit


@pytest.mark.parametrize(
    ("files", "data", "status", "param", "words"),
    [
        ([("file", b"not an image")], None, 400, "file", "file"),
        ([("file", "BIG")], None, 400, "file", "larger than 60000 bytes"),
        ([("file", "WIDE")], None, 400, "file", "file"),
        ([("file", "OK"), ("timestamp", "0.5")], None, 400, "timestamp", "must increase"),
        ([("file", "OK")] * 4, None, 400, "file", "4 frames in one post; the limit is 3"),
        ([("file", "OK"), ("colour", "red")], None, 400, "colour", "unknown field"),
        (None, {"frames": [{"data": "%%%"}]}, 400, "frames[0].data", "not valid base64"),
        (None, {"frames": [{"data": "OK", "when": 1}]}, 400, "frames[0].when", "unknown field"),
        (None, {"frames": [{"data": "OK", "timestamp": -1}]}, 400, "frames[0].timestamp", "0 to"),
        # a timestamp is printed into the frame's label: bounded (1e99 would be ~100 tokens)
        ([("file", "OK"), ("timestamp", "1e99")], None, 400, "timestamp", "from 0 to 1e+07"),
        (
            None,
            {"frames": [{"data": "OK", "timestamp": 1e7 + 1}]},
            400,
            "frames[0].timestamp",
            "1e+07",
        ),
        (
            None,
            {"frames": [{"data": "OK", "timestamp": 10**400}]},
            400,
            "frames[0].timestamp",
            "too large",
        ),
        (None, {"video_id": "vid-" + "0" * 32}, 400, "video_id", "unknown video id"),
        (None, {"frames": []}, 400, "frames", "empty"),
    ],
)
def test_bad_frames_get_a_4xx_naming_the_field_and_leave_the_stream_usable(
    client: TestClient, files, data, status, param, words
) -> None:
    sid = client.post("/v1/streams", json={}).json()["id"]
    assert post_stream_frames(client, sid, [noise_png(1)], [1.0]).status_code == 200
    swap = {"OK": noise_png(2), "BIG": big_png(), "WIDE": noise_png(3, 600, 8)}
    if files is not None:
        parts = [(k, ("f.png", swap.get(v, v)) if k == "file" else (None, v)) for k, v in files]
        r = client.post(f"/v1/streams/{sid}/frames", files=parts)
    else:
        if "frames" in data and data["frames"] and data["frames"][0]["data"] == "OK":
            data["frames"][0]["data"] = base64.b64encode(noise_png(2)).decode()
        r = client.post(f"/v1/streams/{sid}/frames", json=data)
    err = assert_error(r, status, words)
    assert err["param"] == param, err
    # nothing of the bad post joined; the stream takes the next good frame
    assert client.get(f"/v1/streams/{sid}").json()["frames_received"] == 1
    r = post_stream_frames(client, sid, [noise_png(4)], [2.0])
    assert r.status_code == 200 and r.json()["frames_held"] == 2
    assert stream_ask(client, sid, ["Hi?"], **GREEDY)["answers"][0]["finish_reason"] == "length"
    client.delete(f"/v1/streams/{sid}")


def test_unknown_ids_fields_and_the_max_streams_bound(client: TestClient) -> None:
    missing = "stream-" + "0" * 32
    for r in (
        client.get(f"/v1/streams/{missing}"),
        client.post(f"/v1/streams/{missing}/frames", files=[("file", ("a.png", noise_png(1)))]),
        client.post(f"/v1/streams/{missing}/ask", json={"questions": ["Hi?"]}),
        client.delete(f"/v1/streams/{missing}"),
    ):
        assert_error(r, 404, "no stream with id", "stream_not_found")
    assert_error(client.get("/v1/streams/vid-12"), 404, "malformed", "invalid_stream_id")
    # a WebSocket to an unknown id: refused at the handshake with the same 404 and body
    r = websocket_refusal(client, f"/v1/streams/{missing}/ws")
    assert_error(r, 404, "no stream with id", "stream_not_found")
    assert_error(websocket_refusal(client, "/v1/streams/vid-12/ws"), 404, "malformed")
    for path in ("/v1/streams/a%2Fb/ws", "/v1/streams//ws", f"/v1/streams/{missing}/ws/x", "/v1"):
        assert_error(websocket_refusal(client, path), 404, "no WebSocket route", "not_found")
    assert_error(client.post("/v1/streams", json={"colour": 1}), 400, "colour")
    assert_error(client.post("/v1/streams", json={"fps": "2"}), 400, "fps")
    r = client.post("/v1/streams")  # no body: every field has a default
    assert r.status_code == 200 and r.json()["object"] == "stream", r.text
    client.delete(f"/v1/streams/{r.json()['id']}")
    assert_error(client.post("/v1/streams", json={"max_frames": 10**6}), 400, "max_frames")
    sids = [client.post("/v1/streams", json={}).json()["id"] for _ in range(3)]
    err = assert_error(
        client.post("/v1/streams", json={}), 429, "--max-streams", "too_many_streams"
    )
    assert "3 are open" in err["message"]
    sid = sids[0]
    assert_error(
        client.post(f"/v1/streams/{sid}/ask", json={"questions": ["Hi?"]}), 400, "no frames"
    )
    bad = {"questions": ["Hi?"], "window": {"frames": 1, "seconds": 2}}
    assert_error(client.post(f"/v1/streams/{sid}/ask", json=bad), 400, "window")
    body = {"questions": ["Hi?"], "detail": "low"}
    assert_error(client.post(f"/v1/streams/{sid}/ask", json=body), 400, "detail: this stream's")
    body = {"questions": ["Hi?"], "stream_format": "ndjson"}
    assert_error(client.post(f"/v1/streams/{sid}/ask", json=body), 400, "stream_format")
    body = {"questions": ["Hi?"], "colour": "red"}
    assert_error(client.post(f"/v1/streams/{sid}/ask", json=body), 400, "colour")
    client.delete(f"/v1/streams/{sid}")
    sids[0] = client.post("/v1/streams", json={}).json()["id"]
    for sid in sids:
        client.delete(f"/v1/streams/{sid}")


def test_a_stream_belongs_to_its_tenant(families, tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("key-alice-0001 alice\nkey-bob-000002 bob\n")
    alice = {"Authorization": "Bearer key-alice-0001"}
    bob = {"Authorization": "Bearer key-bob-000002"}
    engine = families["llava"].make_engine(max_total_tokens=8192)
    settings = {"api_keys": str(keys), "data_dir": str(tmp_path / "d")}
    with app_client(engine, **settings) as c:
        sid = c.post("/v1/streams", json={}, headers=alice).json()["id"]
        assert c.get(f"/v1/streams/{sid}", headers=alice).status_code == 200
        for r in (
            c.get(f"/v1/streams/{sid}", headers=bob),
            c.post(f"/v1/streams/{sid}/ask", json={"questions": ["Hi?"]}, headers=bob),
            c.delete(f"/v1/streams/{sid}", headers=bob),
        ):
            assert_error(r, 404, "no stream", "stream_not_found")
        # another tenant's stream: refused at the handshake as unknown, with the JSON body
        r = websocket_refusal(c, f"/v1/streams/{sid}/ws?api_key=key-bob-000002")
        assert_error(r, 404, "no stream with id", "stream_not_found")
        with c.websocket_connect(f"/v1/streams/{sid}/ws?api_key=key-alice-0001") as ws:
            ws.send_bytes(noise_png(1))
            assert json.loads(ws.receive_text())["accepted"] == 1
        assert c.get(f"/v1/streams/{sid}", headers=alice).status_code == 404  # socket closed
        r = websocket_refusal(c, f"/v1/streams/{sid}/ws")  # no key
        assert_error(r, 401, "missing API key", "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        r = websocket_refusal(c, f"/v1/streams/{sid}/ws?api_key=nobody-000000000")
        assert_error(r, 401, "invalid API key", "invalid_api_key")


def test_image_bytes_of_a_jpeg_frame(client: TestClient) -> None:
    """A frame in any image format the image routes take (a JPEG here)."""
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 30)).save(buf, "JPEG")
    sid = client.post("/v1/streams", json={"model": MODEL}).json()["id"]
    r = post_stream_frames(client, sid, [buf.getvalue()])
    assert r.status_code == 200 and r.json()["frames"][0]["image_id"].startswith("img-")
    client.delete(f"/v1/streams/{sid}")


# ---- the engine's held prefixes (EngineRequest.hold) ----------------------------------


def _held_request(engine, text: str, hold: str):
    import dataclasses

    from tests.helpers import greedy, user

    req = engine.processor.make_request(messages=user(text), params=greedy(1))
    return dataclasses.replace(req, hold=hold)


def test_a_held_prefix_stays_locked_until_released_and_is_replaced_by_its_id(families) -> None:
    engine = families["llava"].make_engine(max_total_tokens=4096, page_size=4)
    short = "The cat sat on the mat and looked at the door."
    longer = short + " Then the dog came in and sat down beside it."
    (res,) = engine.generate([_held_request(engine, short, "s1")])
    pages = res.prompt_tokens // 4
    stats = engine.cache_stats()
    assert (stats["held_prefixes"], stats["locked_pages"]) == (1, pages)
    assert engine.stats_snapshot()["accounting"]["ok"]
    engine.flush_cache()  # a flush drops held prefixes too
    assert engine.cache_stats()["held_prefixes"] == engine.cache_stats()["locked_pages"] == 0
    engine.generate([_held_request(engine, short, "s1")])
    (res2,) = engine.generate([_held_request(engine, longer, "s1")])  # the same id: replaced
    stats = engine.cache_stats()
    assert (stats["held_prefixes"], stats["locked_pages"]) == (1, res2.prompt_tokens // 4)
    assert res2.cached_tokens > 0  # the old prefix was still held when it ran
    # an aborted held request takes no hold; releasing twice is harmless
    req = _held_request(engine, "Something else entirely, quite long enough.", "s2")
    engine.add_request(req)
    assert engine.abort(req.rid) and engine.cache_stats()["held_prefixes"] == 1
    assert engine.release_hold("s1") is True and engine.release_hold("s1") is False
    assert engine.release_hold("s2") is False
    stats = engine.stats_snapshot()
    assert (stats["held_prefixes"], stats["locked_pages"], stats["used_pages"]) == (0, 0, 0)
    assert stats["accounting"]["ok"] and stats["evictable_pages"] == stats["tree_pages"] > 0


@pytest.mark.parametrize("family", ["llava", "llava-onevision"])
def test_most_frames_counts_the_layouts_own_tokens_per_frame(families, family: str) -> None:
    """A window is checked against the context with each frame's real tokens: its run
    only on the video layout (no per-frame text), run plus label on the images layout;
    two asks one frame apart measure the per-frame tokens the count must cover. The
    frame limits are raised so that the context decides."""

    engine = families[family].make_engine(
        max_total_tokens=16384, max_images_per_request=4096, max_image_tokens_per_request=10**6
    )
    with app_client(engine, max_video_frames=4096) as c:
        _check_most_frames(c, family)


def _check_most_frames(c: TestClient, family: str) -> None:
    from api.routes_streams import _most_frames
    from api.streams import ASK_ROOM_TOKENS

    st = c.app.state.mm
    stream = c.post("/v1/streams", json={"max_frames": 4}).json()
    sid, layout = stream["id"], stream["layout"]
    assert layout == ("video" if family == "llava-onevision" else "images")
    prompt = []
    for k in range(2):
        r = post_stream_frames(c, sid, [noise_png(50 + k)], [1000.0 + k])
        assert r.status_code == 200, r.text
        got = stream_ask(c, sid, [Q], temperature=0.0, max_tokens=1)
        prompt.append(got["usage"]["prompt_tokens"])
    assert c.delete(f"/v1/streams/{sid}").json()["deleted"] is True
    proc = st.engine.processor
    side = proc.shortest_edge
    mode = "frame" if layout == "video" else st.engine.model.family.detail_mode("auto", 2)
    run = st.engine.model.image_tokens(side, side, mode)
    per_frame = prompt[1] - prompt[0]
    room = min(proc.max_context, proc.kv_capacity_tokens) - ASK_ROOM_TOKENS
    cfg = st.engine.config
    limit = st.settings.max_video_frames if layout == "video" else cfg.max_images_per_request
    bounds = (limit, cfg.max_image_tokens_per_request // run)
    most = _most_frames(st, layout, mode)
    if layout == "video":  # the frames' runs follow each other: no text between
        assert per_frame == run
        assert most == max(1, min(*bounds, room // run)), (most, bounds, room, run)
    else:  # each frame's label too, counted with a later frame's (longer) timestamp
        assert run < per_frame
        assert most <= max(1, min(*bounds, room // per_frame)), (most, bounds, room, per_frame)
    # what the server says fits is what it offers
    r = c.post("/v1/streams", json={"max_frames": most + 1})
    assert_error(r, 400, "max_frames")
    assert f"at most {most} frames fit" in r.json()["error"]["message"]


def test_held_prefixes_never_lock_more_than_their_share_of_the_pool(families) -> None:
    """A window as long as the pool allows, rolled, on a 900-token pool: streams' held
    pages stay within half the pool (a prefix past it is not held and says so), so a
    question and an unrelated chat still run instead of waiting for pages that never free."""
    engine = families["llava-onevision"].make_engine(max_total_tokens=900)
    with app_client(engine, max_stream_frames_per_post=8) as c:
        most = c.post("/v1/streams", json={"max_frames": 10**6}).json()["error"]["message"]
        n = int(most.split("at most ")[1].split()[0])
        sid = c.post("/v1/streams", json={"max_frames": n}).json()["id"]
        for i in range(0, n + 1, 8):
            times = [float(t) for t in range(i, min(i + 8, n + 1))]
            r = post_stream_frames(c, sid, [noise_png(int(t)) for t in times], times)
            assert r.status_code == 200, r.text
        deadline = time.time() + 60
        while (info := c.get(f"/v1/streams/{sid}").json())["cached"]["pending"]:
            assert time.time() < deadline, info
            time.sleep(0.05)
        stats = c.get("/v1/cache/stats").json()
        assert stats["locked_pages"] * engine.config.page_size <= 450, (stats, info)
        assert info["cached"]["tokens"] > 0 or "not held" in (info["cached"]["error"] or "")
        chat = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **GREEDY},
        )
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 5
        assert stream_ask(c, sid, [Q], **GREEDY)["answers"][0]["finish_reason"] == "length"
        assert c.delete(f"/v1/streams/{sid}").status_code == 200
        assert_released(c)


def test_a_websocket_query_key_never_reaches_the_logs() -> None:
    """uvicorn logs a WebSocket's path with its query string: the ``api_key`` value is
    written as ``***`` (the message's own text and its arguments)."""
    import logging

    from api.auth import RedactQueryKeys, redact_query_keys_in_logs

    redact_query_keys_in_logs()
    logger = logging.getLogger("uvicorn.error")
    assert any(isinstance(f, RedactQueryKeys) for f in logger.filters)
    rec = logging.LogRecord(
        "uvicorn.error",
        logging.INFO,
        __file__,
        1,
        '%s - "WebSocket %s" [accepted]',
        (("127.0.0.1", 5), "/v1/streams/s/ws?x=1&api_key=sk-secret&y=2"),
        None,
    )
    assert RedactQueryKeys().filter(rec)
    text = rec.getMessage()
    assert "sk-secret" not in text and "api_key=***&y=2" in text


def test_a_refused_handshake_is_not_logged_as_an_error(client: TestClient) -> None:
    """uvicorn logs "returned without completing handshake" after a denial response (the
    404/401 a refused WebSocket gets): the filter the app installs drops that record only."""
    import logging

    from api.errors import DeniedHandshakeNoise

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, (), None)

    noise = DeniedHandshakeNoise()
    assert not noise.filter(record("ASGI callable returned without completing handshake."))
    assert noise.filter(record("Exception in ASGI application\n"))
    assert any(
        isinstance(f, DeniedHandshakeNoise) for f in logging.getLogger("uvicorn.error").filters
    )


def test_a_frame_stamped_after_the_largest_timestamp_is_refused(client: TestClient) -> None:
    """After a frame at the largest timestamp, a frame without one (stamped just after
    the newest) would pass it: 400 ``invalid_timestamp`` naming ``timestamp``."""
    sid = client.post("/v1/streams", json={}).json()["id"]
    assert post_stream_frames(client, sid, [noise_png(1)], [1e7]).status_code == 200
    err = assert_error(post_stream_frames(client, sid, [noise_png(2)]), 400, "largest timestamp")
    assert (err["param"], err["code"]) == ("timestamp", "invalid_timestamp")
    assert client.get(f"/v1/streams/{sid}").json()["frames_received"] == 1
    client.delete(f"/v1/streams/{sid}")


def test_a_placeholder_in_a_question_names_the_question(ov_client: TestClient, clip: bytes) -> None:
    """Routes that take ``questions`` (a stream's ask, an image's ask, a video's ``/qa``)
    refuse the model's reserved placeholder in a question or ``system`` with a 400 naming
    that field (they have no ``messages`` field to name)."""
    c = ov_client
    sid = c.post("/v1/streams", json={}).json()["id"]
    assert post_stream_frames(c, sid, [noise_png(1)]).status_code == 200
    img = c.post("/v1/images", files={"file": ("a.png", noise_png(2))}).json()["id"]
    vid = upload_video(c, clip).json()["id"]
    r = c.post("/v1/streams", json={"system": "See <image>."})  # every ask would fail
    assert assert_error(r, 400, "reserved placeholder")["param"] == "system"
    for url in (f"/v1/streams/{sid}/ask", f"/v1/images/{img}/ask", f"/v1/videos/{vid}/qa"):
        r = c.post(url, json={"questions": ["Hi?", "What is <image> here?"]})
        assert assert_error(r, 400, "reserved placeholder")["param"] == "questions[1]", url
        r = c.post(url, json={"questions": ["Hi?"], "system": "Look at <video>."})
        assert assert_error(r, 400, "reserved placeholder")["param"] == "system", url
    c.delete(f"/v1/streams/{sid}")


def test_a_frame_without_a_timestamp_counts_as_now(client: TestClient) -> None:
    """In one JSON post, a frame without a timestamp takes the seconds since the stream
    began: a later frame stamped before that is refused (400 naming its field), and the
    stream keeps nothing of the post."""
    sid = client.post("/v1/streams", json={}).json()["id"]
    time.sleep(0.3)
    frames = [
        {"data": base64.b64encode(noise_png(1)).decode()},
        {"data": base64.b64encode(noise_png(2)).decode(), "timestamp": 0.1},
    ]
    r = client.post(f"/v1/streams/{sid}/frames", json={"frames": frames})
    err = assert_error(r, 400, "not after")
    assert err["param"] == "frames[1].timestamp" or err["param"].endswith("timestamp"), err
    assert client.get(f"/v1/streams/{sid}").json()["frames_received"] == 0
    client.delete(f"/v1/streams/{sid}")


@pytest.mark.parametrize("field", [{"logprobs": True}, {"top_logprobs": 2}])
def test_routes_whose_answers_carry_no_logprobs_refuse_them(client: TestClient, field) -> None:
    """``/ask``, ``/qa`` and a stream's ``/ask`` answer without logprobs: asking for them
    is a 400 naming the field, not a field silently dropped."""
    sid = client.post("/v1/streams", json={}).json()["id"]
    assert post_stream_frames(client, sid, [noise_png(3)], [1.0]).status_code == 200
    img = client.post("/v1/images", files={"file": ("a.png", noise_png(4), "image/png")})
    assert img.status_code == 200, img.text
    routes = [f"/v1/streams/{sid}/ask", f"/v1/images/{img.json()['id']}/ask"]
    for route in routes:
        r = client.post(route, json={"questions": [Q], **GREEDY, **field})
        err = assert_error(r, 400, "no logprobs")
        assert err["param"] == next(iter(field)), err
    client.delete(f"/v1/streams/{sid}")


def test_a_replay_whose_timestamps_go_back_names_them(ov_client: TestClient, clip: bytes) -> None:
    """Replaying an uploaded video at client-chosen ``timestamps`` that are not after the
    stream's newest frame is a 400 naming ``timestamps`` (not ``time_offset``)."""
    vid = upload_video(ov_client, clip).json()["id"]
    sid = ov_client.post("/v1/streams", json={}).json()["id"]
    r = ov_client.post(f"/v1/streams/{sid}/frames", json={"video_id": vid, "timestamps": [1.0]})
    assert r.status_code == 200, r.text
    r = ov_client.post(f"/v1/streams/{sid}/frames", json={"video_id": vid, "timestamps": [0.5]})
    err = assert_error(r, 400, "not after")
    assert err["param"] == "timestamps", err
    # an offset that carries the frames past the largest timestamp names time_offset
    r = ov_client.post(f"/v1/streams/{sid}/frames", json={"video_id": vid, "time_offset": 1e99})
    assert assert_error(r, 400, "from 0 to 1e+07")["param"] == "time_offset"
    assert ov_client.get(f"/v1/streams/{sid}").json()["frames_received"] == 1
    ov_client.delete(f"/v1/streams/{sid}")
