"""Videos that FFmpeg decodes are accepted with the right frames: small and odd sizes,
pixel formats, codecs and containers, display rotation, single frames.

The oracle is PyAV's own decode of the same file (``frame.to_ndarray("rgb24")``), turned
by numpy as the display matrix says, and for lossless files the frames that were
encoded. decord, the previous decoder, refused many of these files; where it decodes,
it gives the same bytes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.vision.video import (
    FrameSelection,
    Video,
    VideoError,
    VideoLimits,
    display_matrix,
    rotation_matrix,
)
from mmserve.vision.video import decode as video_module
from tests.videos import (
    corner_colours,
    encode_video,
    exif_transposed,
    jpeg_frames_video,
    marked_frames,
    pillow_animation,
    pyav_frames,
    with_thumbnail_track,
)

pytest.importorskip("av")

LIMITS = VideoLimits()
SOURCE_CORNERS = "RGB."  # marked_frames: red top-left, green top-right, blue bottom-left

# (width, height, codec, pixel format, container)
H264 = ("libx264", "yuv420p", "mp4")
SIZES = [
    (8, 8, *H264),
    (12, 12, *H264),
    (16, 16, *H264),
    (24, 16, *H264),
    (48, 64, *H264),
    (72, 48, *H264),
    (16, 12, *H264),
    (2, 2, *H264),
    (64, 48, *H264),
    (10, 6, *H264),
    (13, 7, "libx264", "yuv444p", "mp4"),
    (48, 72, "libx264", "yuv444p", "mp4"),
    (9, 9, "png", "rgb24", "mov"),
    (1, 1, "png", "rgb24", "mov"),
    (64, 48, "png", "rgb24", "mov"),
    (15, 33, "mpeg4", "yuv420p", "avi"),
    (24, 8, "mjpeg", "yuvj444p", "avi"),
    (40, 30, "libvpx-vp9", "yuv420p", "webm"),
    (20, 14, "libx264", "yuv420p", "matroska"),
    (32, 18, "libx264", "yuv420p", "mpegts"),
    (16, 16, "libx264", "yuv420p10le", "mp4"),
    (24, 12, "libx264", "gray", "mp4"),
    (12, 8, "libvpx", "yuv420p", "webm"),
    (72, 48, "mpeg2video", "yuv420p", "mpegts"),
    (13, 7, "ffv1", "yuv420p", "matroska"),
    (8, 8, "qtrle", "rgb24", "mov"),
    (12, 12, "rawvideo", "bgr24", "avi"),  # AVI stores raw RGB as BGR
    (16, 12, "utvideo", "gbrp", "avi"),
    (24, 16, "prores", "yuv422p10le", "mov"),
    (48, 16, "tiff", "rgb24", "mov"),  # frames carry EXIF side data (FFmpeg 8)
]


def decode_all(data: bytes) -> tuple[Video, list[np.ndarray]]:
    v = Video(data, LIMITS)
    got = v.decode(range(v.info.num_frames))
    assert not got.failed, got.failed
    return v, [np.asarray(got.images[i]) for i in range(v.info.num_frames)]


@pytest.mark.parametrize(("w", "h", "codec", "pix", "fmt"), SIZES, ids=lambda x: str(x))
def test_every_size_and_format_decodes_as_pyav_does(
    w: int, h: int, codec: str, pix: str, fmt: str
) -> None:
    src = marked_frames(3, w, h)
    data = encode_video(src, codec=codec, pix_fmt=pix, fmt=fmt)
    v, frames = decode_all(data)
    assert (v.info.num_frames, v.info.width, v.info.height) == (3, w, h)
    assert v.info.duration == pytest.approx(0.3, abs=1e-3)
    assert v.info.frame_times == pytest.approx((0.0, 0.1, 0.2), abs=1e-3)
    theirs = pyav_frames(data)
    assert len(theirs) == 3
    for ours, ref in zip(frames, theirs, strict=True):
        assert ours.shape == (h, w, 3) and ours.dtype == np.uint8
        assert np.array_equal(ours, ref)
    if pix in ("rgb24", "bgr24"):  # lossless: the very frames encoded
        assert all(np.array_equal(a, b) for a, b in zip(frames, src, strict=True))
    elif min(w, h) >= 8 and pix != "gray":  # lossy, but the marks stay where they were
        assert corner_colours(frames[0]) == SOURCE_CORNERS
    # any frame by itself, in any order, gives the same pixels
    again = Video(data, LIMITS).frames([2, 0])
    assert np.array_equal(np.asarray(again[0]), frames[2])
    assert np.array_equal(np.asarray(again[1]), frames[0])


# degrees counter-clockwise, mirrors after it -> (numpy turn of the stored frame, corners)
ROTATIONS = {
    (90, False, False): (lambda a: np.rot90(a, 1), "G.RB"),
    (180, False, False): (lambda a: np.rot90(a, 2), ".BGR"),
    (270, False, False): (lambda a: np.rot90(a, 3), "BR.G"),
    (-90, False, False): (lambda a: np.rot90(a, 3), "BR.G"),
    (0, True, False): (lambda a: a[:, ::-1], "GR.B"),
    (0, False, True): (lambda a: a[::-1], "B.RG"),
    (90, True, False): (lambda a: np.rot90(a, 1)[:, ::-1], ".GBR"),
}


@pytest.mark.parametrize("size", [(64, 48), (16, 12), (96, 64)], ids=str)
@pytest.mark.parametrize("turn", list(ROTATIONS), ids=str)
def test_display_rotation_is_applied(size: tuple[int, int], turn: tuple) -> None:
    w, h = size
    deg, hflip, vflip = turn
    data = encode_video(marked_frames(2, w, h), rotation=deg, hflip=hflip, vflip=vflip)
    as_displayed, corners = ROTATIONS[turn]
    v, frames = decode_all(data)
    quarter = deg % 180 != 0
    assert (v.info.width, v.info.height) == ((h, w) if quarter else (w, h))
    for ours, stored in zip(frames, pyav_frames(data), strict=True):
        assert np.array_equal(ours, as_displayed(stored))
        assert corner_colours(ours) == corners


def test_rotated_png_in_mov_is_exact() -> None:
    src = marked_frames(2, 12, 8)
    data = encode_video(src, codec="png", pix_fmt="rgb24", fmt="mov", rotation=90)
    v, frames = decode_all(data)
    assert (v.info.width, v.info.height) == (8, 12)
    assert all(np.array_equal(a, np.rot90(b)) for a, b in zip(frames, src, strict=True))


@pytest.mark.parametrize(("codec", "pix", "fmt"), [H264, ("png", "rgb24", "mov")])
def test_single_frame_video(codec: str, pix: str, fmt: str) -> None:
    data = encode_video(marked_frames(1, 24, 16), codec=codec, pix_fmt=pix, fmt=fmt)
    v, frames = decode_all(data)
    assert (v.info.num_frames, v.info.frame_times) == (1, (0.0,))
    assert v.info.duration == pytest.approx(0.1, abs=1e-3)
    assert v.indices(FrameSelection()) == [0]
    assert v.indices(FrameSelection(timestamps=(0.0, 0.05))) == [0, 0]
    assert v.indices(FrameSelection(fps=30.0)) == [0]
    assert np.array_equal(frames[0], pyav_frames(data)[0])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    w=st.integers(1, 72),
    h=st.integers(1, 72),
    n=st.integers(1, 4),
    turn=st.sampled_from([None, 90, 180, 270]),
)
def test_any_size_lossless_round_trip(w: int, h: int, n: int, turn: int | None) -> None:
    src = marked_frames(n, w, h)
    data = encode_video(src, codec="png", pix_fmt="rgb24", fmt="mov", rotation=turn)
    v, frames = decode_all(data)
    k = (turn or 0) // 90
    assert (v.info.width, v.info.height) == ((h, w) if k % 2 else (w, h))
    assert all(np.array_equal(a, np.rot90(b, k)) for a, b in zip(frames, src, strict=True))


@pytest.mark.parametrize("fmt", ["avi", "mov"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_of_jpeg_frames_is_applied(orientation: int, fmt: str) -> None:
    """Camera MJPEG: each JPEG frame has EXIF. FFmpeg 8 turns the orientation tag into a
    display matrix and keeps the rest as side data PyAV 18.1 does not name, which made
    listing the frame's side data raise (a 500). Every orientation, mirrors included, is
    shown as Pillow shows the same pixels with that tag."""
    data = jpeg_frames_video(marked_frames(3, 32, 24), orientation, fmt)
    v, frames = decode_all(data)
    turned = orientation >= 5
    assert (v.info.width, v.info.height) == ((24, 32) if turned else (32, 24))
    stored = pyav_frames(data)
    for ours, raw in zip(frames, stored, strict=True):
        assert np.array_equal(ours, exif_transposed(raw, orientation))
    # the marks of the first frame land where a viewer sees them
    want = {1: "RGB.", 3: ".BGR", 6: "BR.G", 8: "G.RB", 2: "GR.B", 4: "B.RG", 5: "RBG.", 7: ".GBR"}
    assert corner_colours(frames[0]) == want[orientation]


def test_apng_with_exif_is_exact() -> None:
    """A lossless APNG whose EXIF says orientation 6 (turn 90 degrees clockwise)."""
    from PIL import Image

    src = marked_frames(3, 16, 12)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = pillow_animation(src, "PNG", [100, 100, 100], exif=exif)
    v, frames = decode_all(data)
    assert (v.info.width, v.info.height, v.info.num_frames) == (12, 16, 3)
    assert all(np.array_equal(a, np.rot90(b, -1)) for a, b in zip(frames, src, strict=True))
    # FFmpeg attaches the orientation to the first frame only; a later frame decoded by
    # itself is turned the same way
    alone = Video(data, LIMITS).frames([2])[0]
    assert np.array_equal(np.asarray(alone), np.rot90(src[2], -1))


@pytest.mark.parametrize("deg", [90, 180, 270, -90])
def test_rotation_matrix_is_the_stored_matrix_of_a_pure_rotation(deg: int) -> None:
    av = pytest.importorskip("av")
    data = encode_video(marked_frames(1, 16, 8), rotation=deg)
    with av.open(io.BytesIO(data)) as c:
        frame = next(c.decode(video=0))
    stored = display_matrix(frame)
    assert stored is not None
    assert rotation_matrix(frame.rotation) == pytest.approx(stored, abs=2)
    assert rotation_matrix(0) is None and rotation_matrix(360) is None


def test_side_data_that_cannot_be_listed_falls_back_to_the_rotation() -> None:
    class Frame:
        rotation = -90

        @property
        def side_data(self):
            raise ValueError("31 is not a valid Type")

    assert display_matrix(Frame()) == rotation_matrix(-90)
    frame = np.arange(24, dtype=np.uint8).reshape(2, 4, 3)
    shown = video_module.orient(frame, display_matrix(Frame()))
    assert np.array_equal(shown, np.rot90(frame, -1))  # 90 degrees clockwise


def test_a_frame_that_cannot_be_converted_is_not_decodable(monkeypatch) -> None:
    """Any failure turning a decoded frame into RGB pixels is that frame's failure (a 400
    naming it), never an exception of another type (a 500)."""
    data = encode_video(marked_frames(3, 16, 16))

    def broken(frame: object) -> None:
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(video_module, "display_matrix", broken)
    with pytest.raises(VideoError, match="no frame decodes.*could not be converted to RGB"):
        Video(data, LIMITS)


def test_raw_elementary_streams_decode_as_pyav_does() -> None:
    """An H.264 or MPEG-4 Part 2 elementary stream has no container timing: frames are
    matched in output order and spaced by FFmpeg's guessed rate."""
    for codec, fmt in [("libx264", "h264"), ("mpeg4", "m4v")]:
        data = encode_video(marked_frames(5, 24, 16), codec=codec, fmt=fmt)
        av = pytest.importorskip("av")
        with av.open(io.BytesIO(data)) as c:
            theirs = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        v, ours = decode_all(data)
        assert (v.info.num_frames, v.info.width, v.info.height) == (5, 24, 16)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
        assert v.info.frame_times == tuple(sorted(v.info.frame_times))
        assert np.array_equal(np.asarray(v.frames([3])[0]), theirs[3])


@pytest.mark.parametrize("size", [(8, 8), (13, 7), (72, 48)], ids=str)
def test_animated_gif_and_apng(size: tuple[int, int]) -> None:
    """Pillow's animations: a GIF (palette) decodes as PyAV decodes it, an APNG exactly;
    each frame lasts what the file says."""
    w, h = size
    src = marked_frames(4, w, h)
    durations = [100, 200, 50, 300]
    for fmt in ("GIF", "PNG"):
        data = pillow_animation(src, fmt, durations)
        v, frames = decode_all(data)
        assert (v.info.num_frames, v.info.width, v.info.height) == (4, w, h), fmt
        assert v.info.frame_times == pytest.approx((0.0, 0.1, 0.3, 0.35)), fmt
        assert v.info.duration == pytest.approx(0.65), fmt
        assert all(np.array_equal(a, b) for a, b in zip(frames, pyav_frames(data), strict=True))
        if fmt == "PNG":
            assert all(np.array_equal(a, b) for a, b in zip(frames, src, strict=True))
        assert v.indices(FrameSelection(timestamps=(0.29, 0.3, 0.64))) == [1, 2, 3]


def test_the_video_stream_is_the_one_ffmpeg_picks() -> None:
    """A thumbnail track before the video: the video is read, not the thumbnail (FFmpeg's
    choice, ``av_find_best_stream``; a stream marked default would come first)."""
    av = pytest.importorskip("av")
    data = with_thumbnail_track(marked_frames(10, 64, 48), marked_frames(1, 16, 16)[0])
    v, frames = decode_all(data)
    assert (v.info.num_frames, v.info.width, v.info.height) == (10, 64, 48)
    assert v.info.duration == pytest.approx(1.0)
    with av.open(io.BytesIO(data)) as c:
        assert [s.width for s in c.streams.video] == [16, 64]
        theirs = [f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[1])]
    assert all(np.array_equal(a, b) for a, b in zip(frames, theirs, strict=True))
    assert np.array_equal(np.asarray(v.frames([7])[0]), theirs[7])


# ---- the previous decoder ------------------------------------------------------------


def decord_frames(data: bytes) -> list[np.ndarray]:
    decord = pytest.importorskip("decord")
    vr = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0), num_threads=1)
    return list(vr.get_batch(list(range(len(vr)))).asnumpy())


@pytest.mark.parametrize(
    ("w", "h", "kw"),
    [
        (64, 48, {}),
        (96, 64, {}),
        (320, 240, {}),
        (64, 48, {"pix_fmt": "yuv444p"}),
        (64, 48, {"codec": "png", "pix_fmt": "rgb24", "fmt": "mov"}),
        (96, 64, {"rotation": 90}),
        (96, 64, {"rotation": 180}),
        (96, 64, {"rotation": 270}),
    ],
    ids=str,
)
def test_same_bytes_as_decord_where_it_decodes(w: int, h: int, kw: dict) -> None:
    data = encode_video(marked_frames(3, w, h), **kw)
    _, ours = decode_all(data)
    theirs = decord_frames(data)
    assert len(theirs) == 3
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a, b)


def test_decord_refused_what_we_accept() -> None:
    """The fault this decoder fixes: decord cannot copy out a frame 8 pixels wide."""
    data = encode_video(marked_frames(2, 8, 8))
    with pytest.raises(Exception, match="size must exactly match"):
        decord_frames(data)
    _, frames = decode_all(data)
    assert frames[0].shape == (8, 8, 3)


def test_shared_cases(cases_dir) -> None:
    def open_case(name: str) -> tuple[Video, list[np.ndarray]]:
        return decode_all((cases_dir / name).read_bytes())

    for name, size, corners in [
        ("tiny-8x8.mp4", (8, 8), SOURCE_CORNERS),
        ("odd-13x7-yuv444.mp4", (13, 7), None),
        ("png-rgb24.mov", (48, 32), SOURCE_CORNERS),
        ("rotated-90.mp4", (48, 64), "G.RB"),
        ("rotated-180.mp4", (64, 48), ".BGR"),
        ("rotated-270.mp4", (48, 64), "BR.G"),
    ]:
        v, frames = open_case(name)
        assert (v.info.width, v.info.height, v.info.num_frames) == (*size, 3), name
        assert all(f.shape == (size[1], size[0], 3) for f in frames), name
        if corners:
            assert corner_colours(frames[0]) == corners, name
    _, frames = open_case("png-rgb24.mov")
    assert all(np.array_equal(a, b) for a, b in zip(frames, marked_frames(3, 48, 32), strict=True))
    times = (0.0, 0.1, 0.2, 2.0, 2.1, 3.9)
    for name, duration in [
        ("vfr.mp4", 4.0),
        ("vfr-audio-5s.mp4", 5.0),
        ("vfr-header-2.3s.mp4", 4.0),
    ]:
        v, _ = open_case(name)
        assert v.info.frame_times == pytest.approx(times, abs=1e-6), name
        assert v.info.duration == pytest.approx(duration, abs=0.01), name


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"fmt": "matroska"},
        {"fmt": "mpegts"},
        {"fmt": "webm", "codec": "libvpx-vp9", "options": {"g": "6"}},
        {"fmt": "avi", "codec": "mpeg4", "options": {"g": "6", "bf": "2"}},
    ],
    ids=str,
)
def test_frames_far_apart_seek_and_match_a_full_decode(kw: dict) -> None:
    """Frames in distant groups of pictures are reached by seeking; each is the frame a
    decode of the whole file gives at that index."""
    kw = {"options": {"g": "6", "keyint_min": "6"}, **kw}
    data = encode_video(marked_frames(60, 32, 24), **kw)
    theirs = pyav_frames(data)
    v = Video(data, LIMITS)
    assert v.info.num_frames == 60
    asked = [59, 3, 40, 41, 3, 17, 0]
    got = v.frames(asked)
    for i, im in zip(asked, got, strict=True):
        assert np.array_equal(np.asarray(im), theirs[i]), i


def test_frame_count_is_bounded() -> None:
    data = encode_video(marked_frames(12, 16, 16))
    with pytest.raises(VideoError, match="more than 5 frames; the limit is 5"):
        Video(data, VideoLimits(max_video_frames=5))
    assert Video(data, VideoLimits(max_video_frames=12)).info.num_frames == 12
