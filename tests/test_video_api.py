"""/v1/videos routes, per-frame and clip question answering, video_url in chat completions."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from mmserve.vision.video import Video, VideoLimits
from tests.helpers import png_bytes, upload_video, video_qa
from tests.live_server import app_client, app_failing_prefill
from tests.videos import (
    encode_mp4,
    encode_video,
    exif_transposed,
    frameless,
    jpeg_frames_video,
    marked_frames,
    pyav_frames,
    rgb_frames,
)

pytest.importorskip("av")

QS = ["What is this?", "Describe the colors."]
GREEDY = {"max_tokens": 3, "temperature": 0.0}
#: the video limits of this file's servers
LIMITS = {"max_video_bytes": 200_000, "max_video_frames": 16, "max_video_side": 640}
upload = upload_video


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=16384)


@pytest.fixture(scope="module")
def client(engine):
    with app_client(engine, **LIMITS) as c:
        yield c


@pytest.fixture(scope="module")
def clip12() -> bytes:
    return encode_mp4(rgb_frames(12), fps=10)


def qa(client: TestClient, vid: str, **body) -> list[dict]:
    return video_qa(client, vid, **{**GREEDY, "questions": QS, **body})


def assert_healthy(client: TestClient, engine) -> None:
    assert client.get("/health").status_code == 200
    stats = client.get("/v1/cache/stats").json()
    assert stats["running_requests"] == stats["waiting_requests"] == 0
    # the engine's figures over HTTP: the same in one process and split
    assert stats["free_pages"] + stats["tree_pages"] == stats["pool_pages"]


def test_upload_get_list_delete(client: TestClient, clip12: bytes) -> None:
    r = upload(client, clip12)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["id"].startswith("vid-") and info["object"] == "video"
    assert (info["num_frames"], info["fps"], info["width"], info["height"]) == (12, 10.0, 64, 48)
    assert info["duration"] == pytest.approx(1.2, abs=1e-3)
    assert upload(client, clip12).json()["id"] == info["id"]
    assert client.get(f"/v1/videos/{info['id']}").json() == info
    assert info["id"] in [v["id"] for v in client.get("/v1/videos").json()["data"]]
    assert client.delete(f"/v1/videos/{info['id']}").json()["deleted"] is True
    r = client.get(f"/v1/videos/{info['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found"
    assert client.delete(f"/v1/videos/{info['id']}").status_code == 404


def test_per_frame_matches_png_images_and_runs_the_tower_once_per_frame(
    client: TestClient,
    engine,
) -> None:
    # frames no other test asks about: their features are in no cache yet
    clip = encode_mp4(rgb_frames(12, seed=21), fps=10)
    vid = upload(client, clip).json()["id"]
    before = client.get("/v1/cache/stats").json()["vision_tower_images"]
    events = qa(client, vid, num_frames=3, system="Be brief.")
    answers = [e for e in events if e["type"] == "answer"]
    summary = events[-1]
    assert len(answers) == 6 and [a["completed"] for a in answers] == list(range(1, 7))
    after = client.get("/v1/cache/stats").json()["vision_tower_images"]
    assert summary["vision_tower_runs"] == 3 == after - before
    assert summary["distinct_frames"] == 3 and summary["answers"] == 6
    n_img = engine.model.num_image_tokens
    by_frame: dict[int, list[dict]] = {}
    for a in answers:
        by_frame.setdefault(a["frame"], []).append(a)
    for got in by_frame.values():  # submitted in question order: the first prefills the frame
        got.sort(key=lambda a: a["question_index"])
        assert all(a["cached_tokens"] >= n_img for a in got[1:])
    # the same questions about each frame uploaded as a PNG image give the same answers
    frames = Video(clip, VideoLimits()).frames([f["frame_index"] for f in events[0]["frames"]])
    for k, im in enumerate(frames):
        image_id = client.post("/v1/images", files={"file": ("f.png", png_bytes(im))}).json()["id"]
        assert image_id == events[0]["frames"][k]["image_id"]
        r = client.post(
            f"/v1/images/{image_id}/ask", json={**GREEDY, "questions": QS, "system": "Be brief."}
        ).json()
        want = [a["answer"] for a in r["answers"]]
        assert [a["text"] for a in sorted(by_frame[k], key=lambda a: a["question_index"])] == want


def test_static_video_runs_the_tower_once(client: TestClient, engine) -> None:
    vid = upload(client, encode_mp4([rgb_frames(1, seed=5)[0]] * 12)).json()["id"]
    summary = qa(client, vid, num_frames=12, questions=QS[:1], max_tokens=1)[-1]
    assert summary["distinct_frames"] == 1 and summary["vision_tower_runs"] == 1
    assert summary["answers"] == 12


def test_overlapping_clips_share_frames(client: TestClient) -> None:
    vid = upload(client, encode_mp4(rgb_frames(12, seed=7), fps=10)).json()["id"]
    first = [round(0.1 * i, 2) for i in range(8)]
    second = [round(0.1 * i, 2) for i in range(4, 12)]
    a = qa(client, vid, timestamps=first, questions=QS[:1], max_tokens=1)
    b = qa(client, vid, timestamps=second, questions=QS[:1], max_tokens=1)
    assert [f["frame_index"] for f in a[0]["frames"]] == list(range(8))
    assert [f["frame_index"] for f in b[0]["frames"]] == list(range(4, 12))
    assert a[-1]["vision_tower_runs"] == 8 and b[-1]["vision_tower_runs"] == 4


def test_clip_mode_second_question_hits_all_frames(client: TestClient, engine) -> None:
    vid = upload(client, encode_mp4(rgb_frames(12, seed=9), fps=10)).json()["id"]
    events = qa(client, vid, mode="clip", num_frames=4)
    answers = sorted(
        (e for e in events if e["type"] == "answer"), key=lambda a: a["question_index"]
    )
    assert len(answers) == 2 and "frame" not in answers[0]
    assert answers[1]["cached_tokens"] >= 4 * engine.model.num_image_tokens
    assert events[-1]["vision_tower_runs"] == 4
    # the same clip as a video_url in a chat completion gives the same answer
    q = answers[0]["question"]
    body = {
        **GREEDY,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": vid, "num_frames": 4}},
                    {"type": "text", "text": q},
                ],
            }
        ],
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == answers[0]["text"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * 576


def test_clip_too_long_says_how_many_frames_fit(client: TestClient, make_engine) -> None:
    vid = upload(client, encode_mp4(rgb_frames(12, seed=11), fps=10)).json()["id"]
    r = client.post(f"/v1/videos/{vid}/qa", json={"questions": QS, "mode": "clip", "num_frames": 9})
    assert r.status_code == 400 and "select at most 8 frames" in r.json()["error"]["message"]
    # a server that allows more images per prompt: the context is the bound
    big = make_engine(max_total_tokens=16384, max_images_per_request=16)
    with app_client(big) as c2:
        vid = upload(c2, encode_mp4(rgb_frames(14, seed=11), fps=10)).json()["id"]
        body = {"questions": QS, "mode": "clip", "num_frames": 14, "max_tokens": 4}
        r = c2.post(f"/v1/videos/{vid}/qa", json=body)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "does not fit" in msg and "at most 13 frames" in msg, msg


def test_video_url_data_url_and_sse(client: TestClient, clip12: bytes) -> None:
    url = "data:video/mp4;base64," + base64.b64encode(clip12).decode()
    body = {
        **GREEDY,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": url, "num_frames": 2},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ],
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 2 * 576
    vid = upload(client, clip12).json()["id"]
    r = client.post(
        f"/v1/videos/{vid}/qa",
        json={**GREEDY, "questions": QS[:1], "num_frames": 1},
        headers={"Accept": "text/event-stream"},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: ")]
    assert [e["type"] for e in events] == ["frames", "answer", "summary"]


def test_bad_videos_get_4xx_and_the_server_stays_healthy(
    client: TestClient,
    clip12: bytes,
    engine,
    cases_dir,
) -> None:
    def err(r, status: int, text: str) -> None:
        assert r.status_code == status, r.text
        assert text in r.json()["error"]["message"], r.json()

    err(upload(client, clip12[: len(clip12) // 3]), 400, "not a decodable video")
    err(upload(client, b"not a video at all"), 400, "not a decodable video")
    err(upload(client, b""), 400, "empty")
    err(upload(client, frameless("matroska")), 400, "without video frames")  # zero frames
    err(upload(client, frameless("mp4")), 400, "no video stream")
    err(upload(client, b"\x00" * 300_000), 413, "over 200000 bytes")
    big = encode_mp4(rgb_frames(2, w=704, h=64))
    err(upload(client, big), 400, "704x64 pixels; limits are 640 per side")
    for name in ("truncated.mp4", "not-an-image.jpg", "empty.png"):
        if (cases_dir / name).exists():
            assert upload(client, (cases_dir / name).read_bytes()).status_code == 400
    if (cases_dir / "one-frame.mp4").exists():
        vid = upload(client, (cases_dir / "one-frame.mp4").read_bytes()).json()["id"]
        summary = qa(client, vid, num_frames=8, questions=QS[:1], max_tokens=1)[-1]
        assert summary["frames"] == 1 and summary["answers"] == 1
    vid = upload(client, clip12).json()["id"]
    url = f"/v1/videos/{vid}/qa"
    err(client.post(url, json={"questions": QS, "timestamps": [5.0]}), 400, "beyond the video")
    err(client.post(url, json={"questions": QS, "num_frames": 17}), 400, "limit is 16 frames")
    err(client.post(url, json={"questions": QS, "fps": 100.0, "mode": "clip"}), 400, "fps: a clip")
    err(client.post(url, json={"questions": QS, "mode": "nope"}), 400, "mode")
    err(client.post("/v1/videos/vid-0/qa", json={"questions": QS}), 404, "no video")
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": "vid-00"}]}]
    err(client.post("/v1/chat/completions", json={"messages": msgs}), 400, "unknown video id")
    msgs[0]["content"][0]["video_url"] = "https://example.com/v.mp4"
    err(client.post("/v1/chat/completions", json={"messages": msgs}), 400, "POST /v1/videos")
    msgs[0]["content"][0]["video_url"] = {"url": vid, "num_frames": 9}
    err(client.post("/v1/chat/completions", json={"messages": msgs}), 400, "limit is 8")
    assert_healthy(client, engine)


def test_small_odd_rotated_and_exif_videos_upload_and_answer(client: TestClient, engine) -> None:
    """The valid videos once refused as corrupt: small and odd frame sizes, display
    rotation, rgb24 PNG-in-MOV, camera MJPEG with EXIF orientation, TIFF-in-MOV. Each
    uploads with its displayed size, and every sampled frame is the image a viewer sees
    (PyAV's decode, turned as the file says): the same image id as that frame uploaded as
    a PNG."""
    cases = []  # (data, displayed width, height, how a stored frame is shown)
    for w, h in [(8, 8), (12, 12), (16, 16), (24, 16), (48, 64), (72, 48), (16, 12)]:
        cases.append((encode_video(marked_frames(3, w, h)), w, h, lambda a: a))
    for deg, k in [(90, 1), (270, 3)]:
        data = encode_video(marked_frames(3, 64, 48), rotation=deg)
        cases.append((data, 48, 64, lambda a, k=k: np.rot90(a, k)))
    png = encode_video(marked_frames(3, 48, 32), codec="png", pix_fmt="rgb24", fmt="mov")
    cases.append((png, 48, 32, lambda a: a))
    tiff = encode_video(marked_frames(3, 16, 8), codec="tiff", pix_fmt="rgb24", fmt="mov")
    cases.append((tiff, 16, 8, lambda a: a))
    for o in (6, 7):
        data = jpeg_frames_video(marked_frames(3, 32, 24), o)
        cases.append((data, 24, 32, lambda a, o=o: exif_transposed(a, o)))
    for data, w, h, shown in cases:
        r = upload(client, data)
        assert r.status_code == 200, r.text
        info = r.json()
        assert (info["width"], info["height"], info["num_frames"]) == (w, h, 3), info
        assert info["duration"] == pytest.approx(0.3, abs=1e-3)
        events = qa(client, info["id"], num_frames=3, questions=QS[:1], max_tokens=1)
        assert events[-1]["answers"] == 3 and events[0]["skipped_frames"] == []
        stored = pyav_frames(data)
        for fr in events[0]["frames"]:
            im = Image.fromarray(np.ascontiguousarray(shown(stored[fr["frame_index"]])))
            r = client.post("/v1/images", files={"file": ("f.png", png_bytes(im))})
            assert r.json()["id"] == fr["image_id"], (w, h, fr)
    assert_healthy(client, engine)


def test_engine_failure_during_video_qa_is_an_error_event(make_engine, tmp_path) -> None:
    """A failed engine step ends the answer stream with an error event naming the request
    (not an exception inside the stream); no request or page is left behind."""
    engine = make_engine(max_total_tokens=4096)
    flag = tmp_path / "fail"
    flag.touch()  # prefills fail (in the engine process, in the process-split run)
    with TestClient(app_failing_prefill(engine, flag, **LIMITS)) as c:
        vid = upload(c, encode_mp4(rgb_frames(4))).json()["id"]
        for fmt in ("ndjson", "sse"):
            body = {**GREEDY, "questions": QS, "num_frames": 2, "stream_format": fmt}
            r = c.post(f"/v1/videos/{vid}/qa", json=body)
            assert r.status_code == 200, r.text
            if fmt == "sse":
                events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data:")]
            else:
                events = [json.loads(line) for line in r.text.splitlines() if line]
            assert events[0]["type"] == "frames" and events[-1]["type"] == "error", events
            err = events[-1]["error"]
            assert err["type"] == "server_error" and err["code"] == "engine_error", err
            assert "req-" in err["message"] and "RuntimeError" in err["message"], err
            assert "/secret" not in err["message"]
        stats = c.get("/v1/cache/stats").json()
        assert stats["running_requests"] == stats["waiting_requests"] == 0
        assert stats["free_pages"] + stats["tree_pages"] == stats["pool_pages"], stats
        assert stats["accounting"]["ok"], stats
        flag.unlink()  # the fault goes away: answers come again
        assert qa(c, vid, num_frames=2)[-1]["answers"] == 2 * len(QS)
        assert c.get("/health").status_code == 200
