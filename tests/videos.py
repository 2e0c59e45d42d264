"""Tiny test videos encoded with PyAV (H.264 in MP4), in memory."""

from __future__ import annotations

import io
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import pytest


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


def encode_mp4(
    frames: Sequence[np.ndarray], fps: int = 10, pts_ms: Sequence[int] | None = None
) -> bytes:
    """H.264 MP4 bytes of RGB ``frames``; ``pts_ms`` gives a variable frame rate."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        if pts_ms is not None:
            s.codec_context.time_base = Fraction(1, 1000)
            s.time_base = Fraction(1, 1000)
        for i, f in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            if pts_ms is not None:
                vf.pts = pts_ms[i]
                vf.time_base = Fraction(1, 1000)
            for p in s.encode(vf):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


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
