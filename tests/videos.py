"""Tiny test videos encoded with PyAV, in memory: H.264 MP4s, and any codec, container,
pixel format, size, display rotation or variable frame rate (:func:`encode_video`)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import pytest

#: Colours of the corner marks of :func:`marked_frames` (RGB).
RED, GREEN, BLUE = (230, 20, 20), (20, 220, 20), (20, 20, 230)


def rgb_frames(n: int, w: int = 64, h: int = 48, seed: int = 0) -> list[np.ndarray]:
    """``n`` distinct frames: smooth gradients with a moving block (compress well, decode
    distinctly)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    base = np.kron(base, np.ones((8, 8, 1), dtype=np.uint8))
    out = []
    for i in range(n):
        f = base.copy()
        x = (i * 5) % max(1, w - 16)
        f[8:24, x : x + 16] = (255 - 20 * (i % 12), 40 * (i % 6), 200)
        out.append(f)
    return out


def marked_frames(n: int, w: int, h: int) -> list[np.ndarray]:
    """``n`` distinct ``h x w`` frames of any size (1 pixel up) whose orientation shows:
    a red top-left, a green top-right and a blue bottom-left block (a third of each side,
    at least 1 pixel) on a grey that changes from frame to frame."""
    bw, bh = max(1, w // 3), max(1, h // 3)
    out = []
    for i in range(n):
        f = np.full((h, w, 3), 90 + (37 * i) % 100, dtype=np.uint8)
        f[:bh, :bw] = RED
        f[:bh, w - bw :] = GREEN
        f[h - bh :, :bw] = BLUE
        out.append(f)
    return out


def corner_colours(frame: np.ndarray) -> str:
    """The colour at each corner of an RGB frame, top-left, top-right, bottom-left,
    bottom-right: ``R``, ``G``, ``B`` for a mark of :func:`marked_frames`, ``.`` for grey."""

    def name(px: np.ndarray) -> str:
        r, g, b = (int(v) for v in px)
        if max(r, g, b) - min(r, g, b) < 80:
            return "."
        return "RGB"[int(np.argmax([r, g, b]))]

    return "".join(name(frame[y, x]) for y, x in ((0, 0), (0, -1), (-1, 0), (-1, -1)))


def encode_video(
    frames: Sequence[np.ndarray],
    *,
    fps: int = 10,
    codec: str = "libx264",
    fmt: str = "mp4",
    pix_fmt: str = "yuv420p",
    pts: Sequence[int] | None = None,
    end: int | None = None,
    time_base: Fraction = Fraction(1, 1000),
    rotation: float | None = None,
    hflip: bool = False,
    vflip: bool = False,
    options: dict[str, str] | None = None,
    audio_seconds: float | None = None,
) -> bytes:
    """Encode RGB ``frames`` with PyAV (one thread, so the bytes are the same anywhere).

    Args:
        frames: ``(h, w, 3)`` uint8 arrays, all the same shape.
        fps: nominal frame rate (frames are ``1/fps`` apart unless ``pts`` is given).
        codec, fmt, pix_fmt: encoder, container format and the stream's pixel format.
        pts: each frame's presentation time in ``time_base`` units (a variable frame
            rate); each packet's duration is set to the gap to the next frame.
        end: when the last frame ends, in ``time_base`` units (default its pts + 1/fps);
            with ``pts``, the video stream lasts until then.
        time_base: the unit of ``pts`` and ``end``.
        rotation: display rotation in degrees counter-clockwise (stored as the stream's
            display matrix, with ``hflip``/``vflip`` mirrors after it).
        options: encoder options (e.g. ``{"bf": "0"}``, ``{"qp": "0"}``).
        audio_seconds: add a silent AAC track this long (the container then lasts as
            long as the longer track).

    Returns:
        The file's bytes.
    """
    av = pytest.importorskip("av")
    h, w = frames[0].shape[:2]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps, options=dict(options or {}))
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        s.codec_context.thread_count = 1
        if rotation is not None or hflip or vflip:
            s.set_display_rotation(rotation or 0, hflip=hflip, vflip=vflip)
        audio = c.add_stream("aac", rate=8000) if audio_seconds else None
        gaps: dict[int, int] = {}
        if pts is not None:
            s.codec_context.time_base = time_base
            s.time_base = time_base
            last = end if end is not None else pts[-1] + int(1 / (fps * time_base))
            gaps = {t: b - t for t, b in zip(pts, [*pts[1:], last], strict=True)}
        packets = []
        for i, f in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            if pts is not None:
                vf.pts, vf.time_base = pts[i], time_base
            packets += s.encode(vf)
        packets += s.encode()
        for p in packets:
            if p.pts in gaps:
                p.duration = gaps[p.pts]
            c.mux(p)
        if audio is not None:
            samples = round(8000 * audio_seconds)
            for k in range(0, samples, 1024):
                n = min(1024, samples - k)
                af = av.AudioFrame.from_ndarray(
                    np.zeros((1, n), dtype=np.float32), format="fltp", layout="mono"
                )
                af.sample_rate, af.pts, af.time_base = 8000, k, Fraction(1, 8000)
                for p in audio.encode(af):
                    c.mux(p)
            for p in audio.encode():
                c.mux(p)
    return buf.getvalue()


def encode_mp4(
    frames: Sequence[np.ndarray], fps: int = 10, pts_ms: Sequence[int] | None = None
) -> bytes:
    """H.264 MP4 bytes of RGB ``frames``; ``pts_ms`` gives a variable frame rate (no
    B-frames; the last frame lasts ``1/fps``)."""
    if pts_ms is not None:
        return encode_video(frames, fps=fps, pts=pts_ms, options={"bf": "0"})
    return encode_video(frames, fps=fps)


def frameless(fmt: str) -> bytes:
    """A container with an empty H.264 stream and a short audio stream (zero video frames)."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        a = c.add_stream("aac", rate=8000)
        fr = av.AudioFrame.from_ndarray(
            np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono"
        )
        fr.sample_rate = 8000
        for p in [*a.encode(fr), *a.encode(), *s.encode()]:
            c.mux(p)
    return buf.getvalue()


def pyav_frames(data: bytes) -> list[np.ndarray]:
    """PyAV's own decode of every frame, in presentation order, as stored (no display
    rotation): ``frame.to_ndarray(format="rgb24")``."""
    av = pytest.importorskip("av")
    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(video=0))
    return [f.to_ndarray(format="rgb24") for f in sorted(frames, key=lambda f: f.pts)]


def set_mp4_duration(data: bytes, seconds: float) -> bytes:
    """MP4 ``data`` whose movie and media headers (``mvhd``, ``mdhd``, version 0, first
    track) claim ``seconds``, whatever the frames' times say (FFmpeg then reads that as the
    container's and the stream's duration)."""
    for box in (b"mvhd", b"mdhd"):
        at = data.index(box) + 4
        assert data[at] == 0, "version 1 headers (64-bit fields) are not handled"
        scale = int.from_bytes(data[at + 12 : at + 16], "big")
        field = round(seconds * scale).to_bytes(4, "big")
        data = data[: at + 16] + field + data[at + 20 :]
    return data


def jpeg_frames_video(
    frames: Sequence[np.ndarray], orientation: int = 1, fmt: str = "avi", fps: int = 10
) -> bytes:
    """Motion JPEG whose frames are JPEGs written by Pillow, each with an EXIF orientation
    tag (1-8, as a camera writes them), muxed unchanged (FFmpeg 8 reads the tag as the
    frame's display matrix and keeps the rest of the EXIF as side data PyAV 18.1 does not
    name)."""
    av = pytest.importorskip("av")
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x010F] = "mmserve test camera"  # Make: EXIF left over once the orientation is read
    h, w = frames[0].shape[:2]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream("mjpeg", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuvj420p"
        for i, f in enumerate(frames):
            jpeg = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(f)).save(jpeg, "JPEG", quality=95, exif=exif)
            p = av.Packet(jpeg.getvalue())
            p.stream, p.pts, p.dts, p.time_base = s, i, i, Fraction(1, fps)
            p.is_keyframe = True
            c.mux(p)
    return buf.getvalue()


def pillow_animation(
    frames: Sequence[np.ndarray], fmt: str, durations_ms: Sequence[int], **params: object
) -> bytes:
    """An animated GIF or APNG written by Pillow, each frame lasting its ``durations_ms``
    (a variable frame rate); ``params`` go to ``Image.save`` (e.g. ``exif=``)."""
    from PIL import Image

    ims = [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
    buf = io.BytesIO()
    ims[0].save(
        buf, fmt, save_all=True, append_images=ims[1:], duration=list(durations_ms), **params
    )
    return buf.getvalue()


def exif_transposed(stored: np.ndarray, orientation: int) -> np.ndarray:
    """How Pillow shows a stored ``(h, w, 3)`` frame tagged with an EXIF ``orientation``
    (``ImageOps.exif_transpose``): the oracle for decoded frames with that tag."""
    from PIL import Image, ImageOps

    im = Image.fromarray(stored)
    im.getexif()[0x0112] = orientation
    return np.asarray(ImageOps.exif_transpose(im))


def with_thumbnail_track(
    frames: Sequence[np.ndarray], thumb: np.ndarray, fmt: str = "matroska", fps: int = 10
) -> bytes:
    """H.264 ``frames`` in a file whose first video stream is a one-frame MJPEG thumbnail
    (as some cameras and phones write): FFmpeg's default stream is the H.264 one."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        t = c.add_stream("mjpeg", rate=1)
        t.width, t.height, t.pix_fmt = thumb.shape[1], thumb.shape[0], "yuvj420p"
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        s.codec_context.thread_count = 1
        packets = t.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(thumb), "rgb24"))
        packets += t.encode()
        for f in frames:
            packets += s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), "rgb24"))
        packets += s.encode()
        for p in packets:
            c.mux(p)
    return buf.getvalue()
