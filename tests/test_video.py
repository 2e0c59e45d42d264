"""Frame sampling (a pure function) and decoding videos into hashed frame images."""

from __future__ import annotations

import pytest

from api.video_store import VideoStore
from mmserve.vision.image import ImageLimits
from mmserve.vision.video import (
    FrameSelection,
    Video,
    VideoError,
    VideoLimits,
    sample_frame_indices,
)
from tests.helpers import ROOT, png_bytes
from tests.videos import encode_mp4, frameless, rgb_frames

pytest.importorskip("av")

LIMITS = VideoLimits()


def sampled(engine, data: bytes, n: int) -> list:
    """``n`` frames of ``data`` as the front end samples them (decoded images kept)."""
    proc = engine.processor
    return proc.sample_frames(proc.open_video(data, LIMITS), FrameSelection(num_frames=n))[0]


def idx(sel: FrameSelection, n: int = 12, fps: float = 10.0, **kw) -> list[int]:
    return sample_frame_indices(n, fps, n / fps, sel, kw.pop("max_frames", 64), **kw)


# ---- selection --------------------------------------------------------------------------


def test_num_frames_uniform_and_capped_at_the_video() -> None:
    assert idx(FrameSelection(num_frames=4)) == [1, 4, 7, 10]
    assert idx(FrameSelection(num_frames=1)) == [6]
    assert idx(FrameSelection(num_frames=12)) == list(range(12))
    assert idx(FrameSelection(num_frames=8), n=3) == [0, 1, 2]  # only 3 exist
    assert idx(FrameSelection()) == [0, 2, 3, 5, 6, 8, 9, 11]  # default: 8 frames


def test_fps_and_timestamps() -> None:
    assert idx(FrameSelection(fps=2.0)) == [0, 5, 10]
    assert idx(FrameSelection(fps=100.0), n=4) == [0, 1, 2, 3]  # repeats dropped
    assert idx(FrameSelection(timestamps=(0.0, 0.45, 1.1, 0.1))) == [0, 4, 11, 1]
    # variable frame rate: each time picks the frame on screen then
    times = [0.0, 0.1, 0.5, 0.6, 1.5]
    got = sample_frame_indices(5, 4.0, 1.6, FrameSelection(timestamps=(0.3, 0.55, 1.59)), 64, times)
    assert got == [1, 2, 4]


@pytest.mark.parametrize(
    ("sel", "msg"),
    [
        (FrameSelection(timestamps=(1.3,)), "beyond the video's duration"),
        (FrameSelection(timestamps=(-1.0,)), "not a time"),
        (FrameSelection(timestamps=()), "empty"),
        (FrameSelection(num_frames=65), "limit is 64 frames"),
        (FrameSelection(num_frames=0), "num_frames must be"),
        (FrameSelection(fps=0.0), "fps must be"),
        (FrameSelection(num_frames=2, fps=1.0), "give one of"),
    ],
)
def test_bad_selections(sel: FrameSelection, msg: str) -> None:
    with pytest.raises(VideoError, match=msg):
        idx(sel)


def test_zero_frames() -> None:
    with pytest.raises(VideoError, match="no frames"):
        idx(FrameSelection(), n=0)


# ---- decoding -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip12() -> bytes:
    return encode_mp4(rgb_frames(12), fps=10)


def test_probe_and_frames(clip12: bytes) -> None:
    v = Video(clip12, LIMITS)
    i = v.info
    assert (i.num_frames, i.fps, i.width, i.height) == (12, 10.0, 64, 48)
    assert i.duration == pytest.approx(1.2, abs=1e-3)
    ims = v.frames([3, 0, 3])
    assert [im.size for im in ims] == [(64, 48)] * 3 and ims[0].mode == "RGB"
    assert ims[0].tobytes() == ims[2].tobytes() != ims[1].tobytes()


def test_frames_hash_like_images(engine, clip12: bytes) -> None:

    frames = sampled(engine, clip12, 4)
    assert [f.index for f in frames] == [1, 4, 7, 10]
    assert len({f.image.key for f in frames}) == 4
    again = engine.processor.prepare_image(png_bytes(frames[0].image.image))
    assert again.key == frames[0].image.key  # a frame and its PNG are one image


def test_static_video_has_one_key(engine) -> None:
    data = encode_mp4([rgb_frames(1)[0]] * 12)
    frames = sampled(engine, data, 12)
    assert len(frames) == 12 and len({f.image.key for f in frames}) == 1


def test_variable_frame_rate() -> None:
    data = encode_mp4(rgb_frames(5), pts_ms=[0, 100, 500, 600, 1500])
    v = Video(data, LIMITS)
    assert v.info.frame_times == pytest.approx((0.0, 0.1, 0.5, 0.6, 1.5), abs=1e-3)
    assert v.indices(FrameSelection(timestamps=(0.3, 1.0, 1.59))) == [1, 3, 4]
    assert v.info.duration == pytest.approx(1.6)  # the last frame lasts 1/fps
    with pytest.raises(VideoError, match=r"timestamp 1.6 s is at or beyond the video.s duration"):
        v.indices(FrameSelection(timestamps=(1.6,)))
    assert v.indices(FrameSelection(fps=2.0)) == [0, 2, 3, 4]


def test_bad_videos(clip12: bytes) -> None:
    cases = {
        b"": "empty",
        clip12[: len(clip12) // 3]: "not a decodable video",
        b"this is plain text, not a video\n": "not a decodable video",
        b"\x00" * 4096: "not a decodable video",
    }
    for data, msg in cases.items():
        with pytest.raises(VideoError, match=msg):
            Video(data, LIMITS)
    with pytest.raises(VideoError, match="no video stream"):
        Video(frameless("mp4"), LIMITS)
    with pytest.raises(VideoError, match="without video frames"):
        Video(frameless("matroska"), LIMITS)
    with pytest.raises(VideoError, match="limit is 100 bytes"):
        Video(clip12, VideoLimits(max_bytes=100))
    with pytest.raises(VideoError, match="64x48 pixels; limits are 32 per side"):
        Video(clip12, VideoLimits(max_side=32))
    with pytest.raises(VideoError, match="video frames: image is 64x48"):
        Video(clip12, LIMITS, ImageLimits(max_side=40))


def test_shared_cases(cases_dir, engine) -> None:
    if not (cases_dir / "static-12.mp4").exists():
        pytest.skip("video cases need PyAV")

    def frames(name: str, n: int) -> list:
        data = (cases_dir / name).read_bytes()
        return sampled(engine, data, n)

    assert [f.index for f in frames("three-frames.mp4", 8)] == [0, 1, 2]
    assert [f.index for f in frames("one-frame.mp4", 8)] == [0]
    assert len({f.image.key for f in frames("static-12.mp4", 12)}) == 1
    with pytest.raises(VideoError, match="not a decodable video"):
        frames("truncated.mp4", 8)
    for name in ("not-an-image.jpg", "empty.png", "truncated.png"):
        with pytest.raises(VideoError):
            frames(name, 8)


def test_store_is_bounded_and_idempotent(clip12: bytes) -> None:
    store = VideoStore(max_videos=2)
    info = Video(clip12, LIMITS).info
    a = store.put(clip12, info)
    assert store.put(clip12, info) is a and len(store) == 1
    b = store.put(clip12 + b"x", info)
    c = store.put(clip12 + b"yy", info)
    assert len(store) == 2 and store.get(a.id) is None and store.get(b.id) is b
    assert store.delete(c.id) and not store.delete(c.id)
    assert store.total_bytes == len(b.data)
    small = VideoStore(max_videos=10, max_bytes=len(clip12) + 1)
    small.put(clip12, info)
    small.put(clip12 + b"x", info)
    assert len(small) == 1


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=8192)


def test_fps_over_the_frame_limit_is_thinned_evenly() -> None:
    """fps selecting more than the limit takes the limit's count, as num_frames would."""
    uniform = idx(FrameSelection(num_frames=64), n=1200)
    assert idx(FrameSelection(fps=1000.0), n=1200) == uniform
    assert len(uniform) == 64 and uniform[0] == 9 and uniform[-1] == 1190
    assert idx(FrameSelection(fps=1e308)) == list(range(12))  # every frame, each once
    assert idx(FrameSelection(fps=1e-300)) == [0]


def test_sample_video() -> None:
    v = Video((ROOT / "samples" / "video" / "pans.mp4").read_bytes(), LIMITS)
    assert (v.info.num_frames, v.info.fps, v.info.width, v.info.height) == (40, 10.0, 320, 240)
    assert v.info.duration == pytest.approx(4.0, abs=1e-3)
