"""Frame timing, constant and variable frame rate: durations, the frames that ``num_frames``,
``fps`` and ``timestamps`` pick, and their reported times, in ``Video`` and through the API.

A player shows, at time ``t``, the last frame whose presentation time is ``<= t``; a video
lasts as long as its container says, unless that ends before its last frame starts.
The test videos are written by PyAV with explicit presentation times.
"""

from __future__ import annotations

import io
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import ServerSettings, create_app
from mmserve.vision.video import FrameSelection, Video, VideoError, VideoLimits
from tests.videos import encode_video, marked_frames, set_mp4_duration

av = pytest.importorskip("av")

LIMITS = VideoLimits()
# the clip: frames at 0, 0.1, 0.2, 2.0, 2.1 and 3.9 s, lasting 4.0 s
PTS_MS = [0, 100, 200, 2000, 2100, 3900]
END_MS = 4000
TIMES = (0.0, 0.1, 0.2, 2.0, 2.1, 3.9)


def vfr(**kw) -> bytes:
    kw = {"pts": PTS_MS, "end": END_MS, "options": {"bf": "0"}, **kw}
    return encode_video(marked_frames(len(PTS_MS), 32, 24), **kw)


def container_seconds(data: bytes) -> tuple[float, float]:
    """(the container's duration, the video stream's), as FFmpeg reads them (seconds)."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        return c.duration / 1e6, float(s.duration * s.time_base)


def pick(v: Video, **sel) -> list[int]:
    if "timestamps" in sel:
        sel["timestamps"] = tuple(sel["timestamps"])
    return v.indices(FrameSelection(**sel))


@pytest.fixture(scope="module")
def clip() -> Video:
    return Video(vfr(), LIMITS)


def test_variable_frame_rate_probe(clip: Video) -> None:
    i = clip.info
    assert (i.num_frames, i.width, i.height) == (6, 32, 24)
    assert i.frame_times == pytest.approx(TIMES, abs=1e-6)
    assert i.duration == pytest.approx(4.0, abs=1e-6)  # not 3.9 + 1 / average rate
    assert i.fps == pytest.approx(6 / 4.0)


def test_variable_frame_rate_fps_edges(clip: Video) -> None:
    assert pick(clip, fps=1.0) == [0, 2, 3, 4]  # at 0, 1, 2, 3 s; none "at 4 s"
    assert pick(clip, fps=0.5) == [0, 3]  # at 0 and 2 s
    assert pick(clip, fps=0.25) == [0]  # one sample, at 0 s
    assert pick(clip, fps=1e-9) == [0]
    assert pick(clip, fps=16.0) == [0, 1, 2, 3, 4, 5]  # 64 samples, each frame once
    # 65 samples before 4.0 s, over the limit of 64: thinned to 64 uniform, every frame once
    assert pick(clip, fps=16.25) == [0, 1, 2, 3, 4, 5]


def test_variable_frame_rate_timestamps(clip: Video) -> None:
    asked = [0.0, 0.05, 0.1, 0.19, 1.9999, 2.0, 2.05, 3.8999, 3.9, 3.9999]
    assert pick(clip, timestamps=asked) == [0, 0, 1, 1, 2, 3, 3, 4, 5, 5]
    for t in (4.0, 4.0000001, 4.57, 1e9, math.inf):
        with pytest.raises(VideoError, match=r"(at or beyond|not a time).*\b4 s\b") as e:
            pick(clip, timestamps=[1.0, t])
        assert e.value.field == "timestamps"
    for t in (-0.001, -1.0, math.nan, -math.inf):
        with pytest.raises(VideoError, match=r"not a time in the video .*\b4 s\b") as e:
            pick(clip, timestamps=[t])
        assert e.value.field == "timestamps"


def test_num_frames_edges(clip: Video) -> None:
    assert pick(clip, num_frames=1) == [3]
    assert pick(clip, num_frames=2) == [1, 4]
    assert pick(clip, num_frames=3) == [1, 3, 5]
    assert pick(clip, num_frames=6) == pick(clip, num_frames=64) == list(range(6))
    with pytest.raises(VideoError, match="num_frames must be >= 1"):
        pick(clip, num_frames=0)
    with pytest.raises(VideoError, match="limit is 64 frames"):
        pick(clip, num_frames=65)


def test_constant_frame_rate_edges() -> None:
    v = Video(encode_video(marked_frames(12, 32, 24), fps=10), LIMITS)
    assert v.info.duration == pytest.approx(1.2) and v.info.fps == pytest.approx(10.0)
    assert v.info.frame_times == pytest.approx([k / 10 for k in range(12)])
    assert pick(v, timestamps=[0.0, 0.0999, 0.1, 1.1, 1.1999]) == [0, 0, 1, 11, 11]
    with pytest.raises(VideoError, match=r"1\.2 s is at or beyond the video's duration \(1\.2 s\)"):
        pick(v, timestamps=[1.2])
    assert pick(v, fps=10.0) == pick(v, fps=20.0) == list(range(12))
    assert pick(v, fps=5.0) == [0, 2, 4, 6, 8, 10]
    assert pick(v, fps=1.0) == [0, 10]  # at 0 and 1 s
    assert pick(v, num_frames=4) == [1, 4, 7, 10]


def test_frames_are_those_shown_at_the_times() -> None:
    src = marked_frames(6, 16, 8)
    data = encode_video(src, codec="png", pix_fmt="rgb24", fmt="mov", pts=PTS_MS, end=END_MS)
    v = Video(data, LIMITS)
    asked = [0.15, 1.0, 2.0, 2.5, 3.95]
    ims = v.frames(pick(v, timestamps=asked))
    for t, im in zip(asked, ims, strict=True):
        shown = max(k for k, ms in enumerate(PTS_MS) if ms <= t * 1000)
        assert np.array_equal(np.asarray(im), src[shown]), t


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gaps=st.lists(st.integers(1, 1500), min_size=1, max_size=7),
    last=st.integers(1, 1500),
    where=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=5),
)
def test_any_variable_frame_rate(gaps: list[int], last: int, where: list[float]) -> None:
    pts = [0]
    for g in gaps[:-1]:
        pts.append(pts[-1] + g)
    end = pts[-1] + last
    src = marked_frames(len(pts), 8, 8)
    data = encode_video(src, codec="png", pix_fmt="rgb24", fmt="mov", pts=pts, end=end)
    v = Video(data, LIMITS)
    assert v.info.frame_times == pytest.approx([p / 1000 for p in pts], abs=1e-6)
    assert v.info.duration == pytest.approx(end / 1000, abs=1e-6)
    asked = [math.floor(w * end) / 1000 for w in where]  # whole milliseconds before the end
    got = pick(v, timestamps=asked)
    assert got == [max(k for k, p in enumerate(pts) if p <= t * 1000) for t in asked]
    for i, im in zip(got, v.frames(got), strict=True):
        assert np.array_equal(np.asarray(im), src[i])
    with pytest.raises(VideoError, match="at or beyond"):
        pick(v, timestamps=[end / 1000])


def test_container_longer_than_the_video() -> None:
    """An audio track lasts 5 s: the container does too, and the last frame stays shown."""
    data = vfr(audio_seconds=5.0)
    assert container_seconds(data) == pytest.approx((5.0, 4.0), abs=0.01)
    v = Video(data, LIMITS)
    assert v.info.frame_times == pytest.approx(TIMES, abs=1e-6)
    assert v.info.duration == pytest.approx(5.0, abs=0.01)
    assert v.info.fps == pytest.approx(1.5)  # the video's own frames over its own span
    assert pick(v, timestamps=[4.5, 4.99]) == [5, 5]
    assert pick(v, fps=1.0) == [0, 2, 3, 4, 5]
    with pytest.raises(VideoError, match="at or beyond"):
        pick(v, timestamps=[5.0])


def test_container_shorter_than_the_video() -> None:
    """The MP4 headers claim 2.3 s for frames up to 3.9 s: the frames' own timing wins."""
    data = set_mp4_duration(vfr(), 2.3)
    assert container_seconds(data) == pytest.approx((2.3, 2.3), abs=0.01)
    v = Video(data, LIMITS)
    assert v.info.frame_times == pytest.approx(TIMES, abs=1e-6)
    assert v.info.duration == pytest.approx(4.0, abs=1e-6)
    assert pick(v, fps=1.0) == [0, 2, 3, 4]
    assert len(v.frames(range(6))) == 6


def test_container_ending_inside_the_last_frame() -> None:
    """The headers end the video 50 ms into its last frame: that is its duration."""
    v = Video(set_mp4_duration(vfr(), 3.95), LIMITS)
    assert v.info.duration == pytest.approx(3.95, abs=1e-6)
    assert pick(v, timestamps=[3.94]) == [5]
    with pytest.raises(VideoError, match=r"3\.95 s is at or beyond"):
        pick(v, timestamps=[3.95])


def test_b_frames_at_a_variable_rate() -> None:
    """x264 reorders frames (B-frames): times are presentation times, not decode order."""
    v = Video(vfr(options={}), LIMITS)
    assert v.info.frame_times == pytest.approx(TIMES, abs=1e-6)
    assert v.info.duration == pytest.approx(4.0, abs=1e-6)
    assert pick(v, fps=1.0) == [0, 2, 3, 4]
    assert len(v.frames(range(6))) == 6


@pytest.mark.parametrize(
    "kw",
    [
        {"fmt": "matroska"},
        {"fmt": "mov", "codec": "png", "pix_fmt": "rgb24", "options": {}},
        {"fmt": "mp4", "codec": "mpeg4", "options": {}},
    ],
    ids=str,
)
def test_variable_frame_rate_in_other_containers(kw: dict) -> None:
    v = Video(vfr(**kw), LIMITS)
    assert v.info.frame_times == pytest.approx(TIMES, abs=1e-3)
    assert v.info.duration == pytest.approx(4.0, abs=1e-3)
    assert pick(v, fps=1.0) == [0, 2, 3, 4]


@pytest.mark.parametrize("fmt", ["mp4", "matroska", "mov"])
@pytest.mark.parametrize("tb", [Fraction(1, 10), Fraction(1, 90000), Fraction(1, 30000)], ids=str)
def test_variable_frame_rate_at_any_time_base(tb: Fraction, fmt: str) -> None:
    """The issue's clip written in ticks of 0.1 s, 1/90000 s and 1/30000 s."""
    pts = [round(Fraction(ms, 1000) / tb) for ms in PTS_MS]
    data = vfr(pts=pts, end=round(Fraction(END_MS, 1000) / tb), time_base=tb, fmt=fmt)
    v = Video(data, LIMITS)
    assert v.info.frame_times == pytest.approx(TIMES, abs=1e-6)
    assert v.info.duration == pytest.approx(4.0, abs=1e-6)
    assert pick(v, fps=1.0) == [0, 2, 3, 4]
    assert pick(v, timestamps=[3.999]) == [5]
    with pytest.raises(VideoError, match=r"4 s is at or beyond the video's duration \(4 s\)"):
        pick(v, timestamps=[4.0])


@pytest.mark.parametrize("fmt", ["mpegts", "mpeg"])
def test_streams_that_start_late_are_timed_from_the_start(fmt: str) -> None:
    """MPEG-TS and MPEG-PS put the first frame at a positive time (and the PS muxer's
    container duration covers one frame only)."""
    codec = "mpeg2video" if fmt == "mpeg" else "libx264"
    v = Video(encode_video(marked_frames(5, 32, 24), fmt=fmt, codec=codec), LIMITS)
    assert v.info.frame_times == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4], abs=1e-6)
    assert v.info.duration == pytest.approx(0.5, abs=1e-6)
    assert pick(v, timestamps=[0.45]) == [4]


# ---- through the API ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(make_engine):
    settings_ = ServerSettings(max_video_bytes=200_000, max_video_frames=16, max_video_side=640)
    with TestClient(create_app(make_engine(max_total_tokens=8192), settings_)) as c:
        yield c


def upload(client: TestClient, data: bytes) -> dict:
    r = client.post("/v1/videos", files={"file": ("v.mp4", data, "video/mp4")})
    assert r.status_code == 200, r.text
    return r.json()


def qa(client: TestClient, vid: str, body: dict | str):
    if isinstance(body, dict):
        body = json.dumps({"questions": ["What?"], "max_tokens": 1, "temperature": 0, **body})
    return client.post(
        f"/v1/videos/{vid}/qa", content=body, headers={"Content-Type": "application/json"}
    )


def refused(r, param: str, *needles: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_frame_selection", err
    for s in needles:
        assert s in err["message"], err


def test_api_reports_and_samples_presentation_times(client: TestClient) -> None:
    info = upload(client, vfr())
    assert (info["num_frames"], info["duration"], info["fps"]) == (6, 4.0, 1.5)
    r = qa(client, info["id"], {"fps": 1})
    assert r.status_code == 200, r.text
    head = json.loads(r.text.splitlines()[0])
    assert [f["frame_index"] for f in head["frames"]] == [0, 2, 3, 4]
    assert [f["timestamp"] for f in head["frames"]] == pytest.approx([0.0, 0.2, 2.0, 2.1])
    r = qa(client, info["id"], {"timestamps": [3.95, 0.15]})
    head = json.loads(r.text.splitlines()[0])
    assert [(f["frame_index"], f["timestamp"]) for f in head["frames"]] == [(5, 3.9), (1, 0.1)]
    longer = upload(client, vfr(audio_seconds=5.0))
    assert longer["duration"] == pytest.approx(5.0, abs=0.01) and longer["num_frames"] == 6
    head = json.loads(qa(client, longer["id"], {"timestamps": [4.5]}).text.splitlines()[0])
    assert [(f["frame_index"], f["timestamp"]) for f in head["frames"]] == [(5, 3.9)]


def test_api_refuses_times_outside_the_video(client: TestClient) -> None:
    vid = upload(client, vfr())["id"]
    refused(qa(client, vid, {"timestamps": [4.0]}), "timestamps", "4 s", "at or beyond")
    refused(qa(client, vid, {"timestamps": [0.5, 7.25]}), "timestamps", "7.25", "4 s")
    refused(qa(client, vid, {"timestamps": [-0.5]}), "timestamps", "-0.5", "4 s")
    # NaN and Infinity are not JSON: the body parser refuses them, naming the element
    for literal in ("NaN", "Infinity"):
        r = qa(client, vid, '{"questions": ["What?"], "timestamps": [' + literal + "]}")
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "timestamps[0]" and literal in err["message"], err
    refused(qa(client, vid, {"num_frames": 17}), "num_frames", "limit is 16 frames")
    head = json.loads(qa(client, vid, {"fps": 16.25}).text.splitlines()[0])  # thinned
    assert [f["frame_index"] for f in head["frames"]] == [0, 1, 2, 3, 4, 5]
    part = {"type": "video_url", "video_url": {"url": vid, "timestamps": [4.0]}}
    chat = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    r = client.post("/v1/chat/completions", json=chat)
    refused(r, "messages[0].content[0].video_url.timestamps", "4 s", "at or beyond")
    part["video_url"]["timestamps"] = [3.95]
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    part["video_url"] = {"url": vid, "fps": 1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert client.get("/health").status_code == 200
