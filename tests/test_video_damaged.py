"""A damaged video through the HTTP API: QA answers from the frames that decode (the
same pixels as the sound file) and lists exactly the ones it skipped; where nothing usable
is left, or in a chat prompt (which cannot skip a frame), a 400 names them; no message shows
a server-side path."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.vision.image import clean_decoder_message
from mmserve.vision.video import Video, VideoError, VideoLimits
from tests.helpers import ROOT, upload_video, video_qa
from tests.live_server import app_client

av = pytest.importorskip("av")

SAMPLE = ROOT / "samples" / "video" / "pans.mp4"  # 40 frames at 10 fps, key frames 0, 20, 30
DAMAGE = 4096  # bytes zeroed at a third of the file: inside the first GOP's P-frames
GREEDY = {"max_tokens": 1, "temperature": 0.0}
LEAKS = re.compile(r"/github|workspace|\.cc\b|\.cpp\b|\.so\b|\[bt\]|stack trace", re.IGNORECASE)


def damage(data: bytes) -> bytes:
    at = len(data) // 3
    return data[:at] + bytes(DAMAGE) + data[at + DAMAGE :]


def decode_all(data: bytes) -> tuple[dict[int, np.ndarray], list[Exception]]:
    """Every frame PyAV returns for ``data`` (by index: pts at 10 fps), decoding the whole
    stream in one pass on one thread, and the errors it raised on the way."""
    frames: dict[int, np.ndarray] = {}
    errors: list[Exception] = []
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        s.codec_context.thread_count = 1
        for packet in c.demux(s):
            try:
                for f in packet.decode():
                    frames[round(float(f.pts * s.time_base) * 10)] = f.to_ndarray(format="rgb24")
            except av.FFmpegError as e:
                errors.append(e)
    return frames, errors


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The sample video with a run of zeroed bytes, written at run time (no binary in git)."""
    path: Path = tmp_path_factory.mktemp("video") / "pans-damaged.mp4"
    path.write_bytes(damage(SAMPLE.read_bytes()))
    return path.read_bytes()


@pytest.fixture(scope="module")
def failing(damaged: bytes) -> dict[int, Exception]:
    """Frame index -> PyAV's error, for every frame of the damaged video that is lost:
    PyAV does not return it, or returns other pixels than it does for the sound file
    (FFmpeg conceals the damage in frames that predict from a lost one). The oracle is
    the sound file, not the server's rule."""
    good, _ = decode_all(SAMPLE.read_bytes())
    got, errors = decode_all(damaged)
    assert sorted(good) == list(range(40)) and errors
    out = {i: errors[0] for i in range(40) if i not in got or not np.array_equal(got[i], good[i])}
    # the damage really loses a run of frames, and others still decode
    assert 0 < len(out) < 40 and 0 not in out and 39 not in out, sorted(out)
    # and some of the lost frames do come back from the decoder, concealed
    assert any(i in got for i in out), sorted(out)
    return out


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=16384)


@pytest.fixture(scope="module")
def client(engine):
    limits = {"max_video_bytes": 200_000, "max_video_frames": 40, "max_video_side": 640}
    with app_client(engine, **limits) as c:
        yield c


def upload(client: TestClient, data: bytes) -> dict:
    r = upload_video(client, data)
    assert r.status_code == 200, r.text
    return r.json()


def qa(client: TestClient, vid: str, **body) -> list[dict]:
    return video_qa(client, vid, **{**GREEDY, "questions": ["What is this?"], **body})


def assert_clean(msg: str) -> None:
    """No server-side path, source or library file, or native stack trace."""
    assert msg and "/" not in msg and not LEAKS.search(msg), msg


def error(r) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_video", err
    assert_clean(err["message"])
    return err["message"]


def names_frames(msg: str, indices: list[int]) -> bool:
    listed = {int(i) for i in re.findall(r"frame (\d+) at [\d.]+ s", msg)}
    return listed == set(indices)


def test_qa_answers_from_the_frames_that_decode_and_lists_exactly_the_skipped(
    client: TestClient, damaged: bytes, failing: dict
) -> None:
    info = upload(client, damaged)
    assert info["num_frames"] == 40 and (info["width"], info["height"]) == (320, 240)
    events = qa(client, info["id"], num_frames=40)
    summary, head = events[-1], events[0]
    skipped = summary["skipped_frames"]
    assert [s["index"] for s in skipped] == sorted(failing)
    assert [s["timestamp"] for s in skipped] == pytest.approx([i / 10 for i in sorted(failing)])
    assert head["skipped_frames"] == skipped
    for s in skipped:
        assert_clean(s["reason"])
    answered = [f["frame_index"] for f in head["frames"]]
    assert answered == [i for i in range(40) if i not in failing]
    answers = [e for e in events if e["type"] == "answer"]
    assert sorted(a["frame_index"] for a in answers) == answered
    assert summary["frames"] == summary["answers"] == 40 - len(failing)


@pytest.mark.parametrize("mode", ["per_frame", "clip"])
def test_a_partial_selection_skips_only_its_failing_frames(
    client: TestClient, damaged: bytes, failing: dict, mode: str
) -> None:
    vid = upload(client, damaged)["id"]
    bad = sorted(failing)
    picked = [0, bad[0], bad[-1], 25, bad[0]]  # a repeat is skipped once
    events = qa(client, vid, mode=mode, timestamps=[i / 10 for i in picked])
    assert [s["index"] for s in events[-1]["skipped_frames"]] == sorted({bad[0], bad[-1]})
    assert [f["frame_index"] for f in events[0]["frames"]] == [0, 25]
    assert events[-1]["answers"] == (2 if mode == "per_frame" else 1)


def test_nothing_usable_is_a_400_that_names_the_frames(
    client: TestClient, damaged: bytes, failing: dict
) -> None:
    vid = upload(client, damaged)["id"]
    bad = sorted(failing)
    r = client.post(
        f"/v1/videos/{vid}/qa",
        json={"questions": ["Hm?"], "timestamps": [i / 10 for i in bad]},
    )
    msg = error(r)
    assert names_frames(msg, bad), msg
    assert f"{len(bad)} of the {len(bad)} selected frames could not be decoded" in msg


def test_video_url_in_chat_cannot_skip_and_names_the_frames(
    client: TestClient, damaged: bytes, failing: dict
) -> None:
    vid = upload(client, damaged)["id"]
    n = 8
    indices = [int((k + 0.5) * 40 / n) for k in range(n)]  # what num_frames=8 picks
    want = [i for i in indices if i in failing]
    assert want  # the selection meets the damage
    data_url = "data:video/mp4;base64," + base64.b64encode(damaged).decode()
    for url in (vid, data_url):
        content = [
            {"type": "video_url", "video_url": {"url": url, "num_frames": n}},
            {"type": "text", "text": "What happens?"},
        ]
        body = {**GREEDY, "messages": [{"role": "user", "content": content}]}
        msg = error(client.post("/v1/chat/completions", json=body))
        assert names_frames(msg, want), msg
    # frames that all decode are fine in a prompt
    good = [0.0, 2.5]
    content[0]["video_url"] = {"url": vid, "timestamps": good}
    r = client.post(
        "/v1/chat/completions", json={**GREEDY, "messages": [{"role": "user", "content": content}]}
    )
    assert r.status_code == 200, r.text


def test_upload_of_a_video_without_a_decodable_key_frame_is_refused(client: TestClient) -> None:
    data = bytearray(SAMPLE.read_bytes())
    av = pytest.importorskip("av")
    with av.open(io.BytesIO(bytes(data))) as c:
        keys = [(p.pos, p.size) for p in c.demux(video=0) if p.size and p.is_keyframe]
    for pos, size in keys:
        data[pos : pos + min(size, 400)] = bytes(min(size, 400))
    r = client.post("/v1/videos", files={"file": ("v.mp4", bytes(data), "video/mp4")})
    msg = error(r)
    assert "no frame decodes (tried frames 0, 20, 30)" in msg, msg


def test_first_gop_damaged_upload_still_works(client: TestClient) -> None:
    data = bytearray(SAMPLE.read_bytes())
    data[48:300] = bytes(252)  # the start of the mdat payload: frame 0's key frame
    info = upload(client, bytes(data))  # probed from the next key frame
    assert (info["width"], info["height"]) == (320, 240)
    events = qa(client, info["id"], timestamps=[0.5, 2.5])
    assert [s["index"] for s in events[-1]["skipped_frames"]] == [5]
    assert_clean(events[-1]["skipped_frames"][0]["reason"])
    r = client.post(f"/v1/videos/{info['id']}/qa", json={"questions": ["?"], "timestamps": [0.0]})
    assert names_frames(error(r), [0])


def test_decoder_errors_lose_paths_and_traces(damaged: bytes, failing: dict) -> None:
    raw = str(next(iter(failing.values())))
    cleaned = clean_decoder_message(raw)
    assert cleaned and not LEAKS.search(cleaned) and "/" not in cleaned, cleaned
    if LEAKS.search(raw):  # a decoder's own text may show its build directory
        assert len(cleaned) < len(raw)
    v = Video(damaged, VideoLimits())
    with pytest.raises(VideoError) as e:
        v.frames([0, *sorted(failing)[:2]])
    assert_clean(str(e.value))
    assert names_frames(str(e.value), sorted(failing)[:2])


def test_frames_kept_are_the_sound_files_pixels(damaged: bytes, failing: dict) -> None:
    good, _ = decode_all(SAMPLE.read_bytes())
    got = Video(damaged, VideoLimits()).decode(range(40))
    assert [f.index for f in got.failed] == sorted(failing)
    assert sorted(got.images) == [i for i in range(40) if i not in failing]
    for i, im in got.images.items():
        assert np.array_equal(np.asarray(im), good[i]), i
    for f in got.failed:
        assert f.timestamp == pytest.approx(f.index / 10)
        assert_clean(f.reason)


def test_server_stays_healthy_and_a_sound_video_works(
    client: TestClient,
    engine,
    damaged: bytes,
) -> None:
    vid = upload(client, damaged)["id"]
    assert qa(client, vid, num_frames=10)[-1]["skipped_frames"]  # after a damaged one...
    assert client.get("/health").status_code == 200
    stats = client.get("/v1/cache/stats").json()
    assert stats["running_requests"] == stats["waiting_requests"] == 0
    assert engine.pool.allocator.num_free + engine.tree.num_pages() == engine.pool.num_pages
    vid = upload(client, SAMPLE.read_bytes())["id"]  # ...a sound video still works
    events = qa(client, vid, num_frames=8)
    assert events[-1]["skipped_frames"] == [] and events[-1]["answers"] == 8


# ---- any corruption: a clear VideoError or the frames that decode ------------------------

_SOURCES: dict[str, bytes] = {}


def _source(kind: str) -> bytes:
    """A 12-frame 32x24 clip, key frame every 4 (encoded once per test session)."""
    if kind not in _SOURCES:
        from tests.videos import encode_video, marked_frames

        fmt, codec, pix = kind.split("/")
        _SOURCES[kind] = encode_video(
            marked_frames(12, 32, 24), fmt=fmt, codec=codec, pix_fmt=pix, options={"g": "4"}
        )
    return _SOURCES[kind]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(
        [
            "mp4/libx264/yuv420p",
            "matroska/libx264/yuv420p",
            "webm/libvpx-vp9/yuv420p",
            "mov/png/rgb24",
            "avi/mjpeg/yuvj420p",
        ]
    ),
    cut=st.floats(0.0, 1.0),
    flips=st.lists(
        st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 255)), max_size=6
    ),
    prefix=st.binary(max_size=64),
)
def test_corrupt_input_is_a_clear_video_error_or_decodes(
    kind: str, cut: float, flips: list[tuple[float, int]], prefix: bytes
) -> None:
    """Truncated, bit-flipped or garbage-prefixed files: either a VideoError whose message
    says what is wrong (no path, no trace), or a video whose frames decode at its size or
    are reported as not decodable; never another exception."""
    data = bytearray(_source(kind)[: max(1, round(len(_source(kind)) * cut))])
    for where, value in flips:
        data[int(where * len(data))] = value
    data = prefix + bytes(data)
    try:
        v = Video(data, VideoLimits())
    except VideoError as e:
        msg = str(e)
        assert re.search(r"decodable|corrupt|truncated|no video stream|no frames", msg), msg
        assert not LEAKS.search(msg), msg
        return
    got = v.decode(range(v.info.num_frames))
    assert len(got.images) + len(got.failed) == v.info.num_frames
    # damage can change a frame's size (a broken header); it stays within the limits
    assert all(0 < im.width <= 3840 and 0 < im.height <= 3840 for im in got.images.values())
    for f in got.failed:
        assert not LEAKS.search(f.reason), f.reason


def test_a_codec_nobody_decodes_is_a_video_error() -> None:
    """A Matroska file whose codec id was damaged: PyAV opens it without a decoder."""
    from tests.videos import encode_video, marked_frames

    data = encode_video(marked_frames(3, 16, 16), fmt="matroska")
    assert data.count(b"V_MPEG4/ISO/AVC") == 1
    with pytest.raises(VideoError, match="codec cannot be decoded"):
        Video(data.replace(b"V_MPEG4/ISO/AVC", b"V_MPEG4/ISO/XYZ"), VideoLimits())


def test_any_other_failure_inside_pyav_is_the_datas_fault(monkeypatch) -> None:
    """Whatever PyAV raises on hostile data, the caller gets a VideoError (a 400) naming the
    problem, or the frames listed as not decodable; never another exception (a 500)."""
    from mmserve.vision.video import decode as video_module
    from tests.videos import encode_video, marked_frames

    data = encode_video(marked_frames(3, 16, 16))
    v = Video(data, VideoLimits())

    def run(self):
        raise UnicodeDecodeError("utf-8", b"\xc7", 0, 1, "invalid continuation byte")

    monkeypatch.setattr(video_module._Pass, "run", run)
    got = v.decode([2, 0])
    assert got.images == {} and [f.index for f in got.failed] == [0, 2]
    assert "invalid continuation byte" in got.failed[0].reason
    with pytest.raises(VideoError, match="2 of the 2 selected frames could not be decoded"):
        v.frames([0, 2])
    with pytest.raises(VideoError, match="not a decodable video.*invalid continuation"):
        Video(data, VideoLimits())
