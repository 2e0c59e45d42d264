"""Odd and broken input files for the image and video tests, written by our own code.

:func:`write_cases` writes every file named in :data:`CASES` into a folder. The
output is deterministic: fixed seeds, no timestamps, single-threaded video encoding.
Run ``python -m tests.cases OUT`` from the repository root to look at the files.
"""

from __future__ import annotations

import io
import struct
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, PngImagePlugin

from tests.videos import encode_video, marked_frames, rgb_frames, set_mp4_duration

# File name -> what the file is. Names used by the tests must not change.
CASES: dict[str, str] = {
    # content keys
    "exif-orientation-6.jpg": "RGB JPEG stored 24x16 with EXIF orientation 6 (viewer sees 16x24)",
    "bytes-30x150.png": "RGB 30x150; the same raw pixel bytes as bytes-150x30.png",
    "bytes-150x30.png": "RGB 150x30; the same raw pixel bytes as bytes-30x150.png",
    "same-size-a.png": "RGB 64x64 warm noise; same size as same-size-b.png, other content",
    "same-size-b.png": "RGB 64x64 cool stripes; same size as same-size-a.png, other content",
    "pixel-base.png": "RGB 32x32 noise",
    "pixel-changed.png": "pixel-base.png with one bit of one pixel flipped",
    "pixel-base-copy.jpg.png": "pixel-base.png's pixels in other bytes (compression, text chunk)",
    # odd but valid modes and sizes
    "gray-224.jpg": "grayscale JPEG 224x224 (mode L)",
    "palette.png": "palette PNG 48x32 with 16 colours (mode P)",
    "rgba-64.png": "RGBA PNG 64x64 with an alpha gradient",
    "cmyk.jpg": "CMYK JPEG 48x32",
    "gray16.png": "16-bit grayscale PNG 256x64 (mode I;16), a gradient 0..65535",
    "one-by-one.png": "RGB PNG 1x1",
    "one-pixel-high.png": "RGB PNG 900x1 (aspect ratio too extreme to resize)",
    "animated.gif": "GIF 32x32 with three frames: red, green, blue (mode P)",
    # every other PIL mode that a file can hold
    "mode-1.png": "bilevel PNG 40x24 (mode 1)",
    "mode-la.png": "grayscale + alpha PNG 40x24 (mode LA)",
    "mode-pa.tif": "palette + alpha TIFF 40x24 (mode PA; PNG cannot hold PA)",
    "mode-i32.tif": "32-bit signed int TIFF 40x24 (mode I), values 0..1000000 (PNG holds 16 bits)",
    "mode-f.tif": "32-bit float TIFF 40x24 (mode F), values 0.0..1.0",
    "mode-i16b.tif": "16-bit big-endian grayscale TIFF 40x24 (mode I;16B), values 0..65535",
    "mode-rgbx.jpg": "JPEG 40x24 saved from mode RGBX (reads back as RGB)",
    "mode-ycbcr.tif": "TIFF 40x24 in mode YCbCr",
    # broken or hostile
    "truncated.png": "a valid RGB PNG 64x64 cut in half (header intact, pixels missing)",
    "empty.png": "0 bytes",
    "not-an-image.jpg": "plain text with a .jpg name",
    "bomb-header-50000.png": "a 65-byte PNG whose IHDR claims 50000x50000 pixels",
    # videos (H.264 in MP4)
    "three-frames.mp4": "H.264 MP4 64x48, 3 distinct frames",
    "one-frame.mp4": "H.264 MP4 64x48, 1 frame",
    "static-12.mp4": "H.264 MP4 64x48, 12 identical frames (lossless, decode identically)",
    "truncated.mp4": "the first half of a 30-frame MP4 with its moov atom at the end (no index)",
    # valid videos that decord refused, and display rotation (marked_frames corners)
    "tiny-8x8.mp4": "H.264 MP4 8x8, 3 frames",
    "odd-13x7-yuv444.mp4": "H.264 4:4:4 MP4 13x7 (odd sizes), 3 frames",
    "png-rgb24.mov": "PNG (rgb24, lossless) in MOV 48x32, 3 frames",
    "rotated-90.mp4": "H.264 MP4 stored 64x48, display matrix 90 deg counter-clockwise (48x64)",
    "rotated-180.mp4": "H.264 MP4 stored 64x48, display matrix 180 deg",
    "rotated-270.mp4": "H.264 MP4 stored 64x48, display matrix 270 deg counter-clockwise (48x64)",
    # variable frame rate: frames at 0, 0.1, 0.2, 2.0, 2.1 and 3.9 s
    "vfr.mp4": "H.264 MP4 32x24, variable frame rate, lasts 4.0 s",
    "vfr-audio-5s.mp4": "vfr.mp4 with a 5 s silent AAC track (container 5.0 s, video 4.0 s)",
    "vfr-header-2.3s.mp4": "vfr.mp4 whose mvhd and mdhd headers claim 2.3 s",
}


def write_cases(out: Path) -> Path:
    """Write every file of :data:`CASES` into ``out`` (created if missing).

    Args:
        out: the folder to write into.

    Returns:
        ``out``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {**_image_cases(), **_mode_cases(), **_broken_cases(), **_video_cases()}
    assert files.keys() == CASES.keys(), set(files) ^ set(CASES)
    for name, data in files.items():
        (out / name).write_bytes(data)
    return out


def encode(im: Image.Image, fmt: str, **params: object) -> bytes:
    """Encode ``im`` as ``fmt`` with Pillow's save ``params``."""
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk: length, type, payload and the CRC of type + payload."""
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def bomb_png(width: int, height: int) -> bytes:
    """A tiny RGB PNG whose IHDR claims ``width`` x ``height`` and whose IDAT is empty."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"", 9))
        + png_chunk(b"IEND", b"")
    )


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _gradient(w: int, h: int) -> np.ndarray:
    """An RGB gradient, different along each axis (so rotations and flips change it)."""
    y, x = np.mgrid[0:h, 0:w]
    r = x * 255 // max(1, w - 1)
    g = y * 255 // max(1, h - 1)
    b = (x + 2 * y) * 7 % 256
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


def _image_cases() -> dict[str, bytes]:
    cases: dict[str, bytes] = {}

    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    stored = Image.fromarray(_gradient(24, 16))
    cases["exif-orientation-6.jpg"] = encode(stored, "JPEG", quality=95, exif=exif.tobytes())

    raw = _rng(1).integers(0, 256, 30 * 150 * 3, dtype=np.uint8).tobytes()
    cases["bytes-30x150.png"] = encode(Image.frombytes("RGB", (30, 150), raw), "PNG")
    cases["bytes-150x30.png"] = encode(Image.frombytes("RGB", (150, 30), raw), "PNG")

    warm = _rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    warm[..., 0] = np.maximum(warm[..., 0], 160)
    warm[..., 2] //= 4
    stripes = np.zeros((64, 64, 3), dtype=np.uint8)
    stripes[:, :, 2] = 230
    stripes[::8] = (20, 200, 255)
    stripes[1::8] = (20, 200, 255)
    cases["same-size-a.png"] = encode(Image.fromarray(warm), "PNG")
    cases["same-size-b.png"] = encode(Image.fromarray(stripes), "PNG")

    base = _rng(4).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    changed = base.copy()
    changed[5, 7, 1] ^= 1
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "the pixels of pixel-base.png, saved again")
    cases["pixel-base.png"] = encode(Image.fromarray(base), "PNG", compress_level=1)
    cases["pixel-changed.png"] = encode(Image.fromarray(changed), "PNG", compress_level=1)
    cases["pixel-base-copy.jpg.png"] = encode(
        Image.fromarray(base), "PNG", compress_level=9, pnginfo=info
    )
    assert cases["pixel-base.png"] != cases["pixel-base-copy.jpg.png"]

    y, x = np.mgrid[0:224, 0:224]
    gray = ((x + y) * 255 // 446 + 40 * ((x // 28 + y // 28) % 2)).clip(0, 255)
    cases["gray-224.jpg"] = encode(Image.fromarray(gray.astype(np.uint8), "L"), "JPEG")

    index = (np.mgrid[0:32, 0:48].sum(axis=0) // 5) % 16
    pal = Image.frombytes("P", (48, 32), index.astype(np.uint8).tobytes())
    colours = _rng(5).integers(0, 256, (16, 3), dtype=np.uint8)
    pal.putpalette(colours.tobytes())
    cases["palette.png"] = encode(pal, "PNG")

    rgba = np.dstack([_gradient(64, 64), np.mgrid[0:64, 0:64][1].astype(np.uint8) * 4])
    cases["rgba-64.png"] = encode(Image.fromarray(rgba, "RGBA"), "PNG")

    cmyk = np.dstack([_gradient(48, 32), np.full((32, 48), 30, np.uint8)])
    cases["cmyk.jpg"] = encode(Image.frombytes("CMYK", (48, 32), cmyk.tobytes()), "JPEG")

    ramp = np.linspace(0, 65535, 256).round().astype(np.uint16)
    gray16 = Image.fromarray(np.tile(ramp, (64, 1)))
    assert gray16.mode == "I;16", gray16.mode
    cases["gray16.png"] = encode(gray16, "PNG")

    cases["one-by-one.png"] = encode(Image.new("RGB", (1, 1), (200, 100, 50)), "PNG")
    cases["one-pixel-high.png"] = encode(Image.fromarray(_gradient(900, 1)), "PNG")

    frames = []
    for colour in ((230, 30, 30), (30, 200, 40), (40, 60, 230)):
        f = Image.new("RGB", (32, 32), colour)
        f.paste((255, 255, 255), (4, 4, 12, 12))
        frames.append(f.convert("P", palette=Image.Palette.ADAPTIVE, colors=4))
    cases["animated.gif"] = encode(
        frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0
    )
    return cases


def _mode_cases() -> dict[str, bytes]:
    w, h = 40, 24
    y, x = np.mgrid[0:h, 0:w]
    ramp = (x * h + y) / (w * h - 1)  # 0.0 .. 1.0, different along each axis
    gray = (ramp * 255).round().astype(np.uint8)

    def gray_with(mode: str, other: np.ndarray) -> Image.Image:
        return Image.frombytes(mode, (w, h), np.dstack([gray, other]).tobytes())

    pa = gray_with("PA", (255 - gray)).copy()
    pa.putpalette(_rng(6).integers(0, 256, 768, dtype=np.uint8).tobytes())
    i32 = Image.fromarray((ramp * 1_000_000).round().astype(np.int32), "I")
    i16b = Image.frombytes("I;16B", (w, h), (ramp * 65535).round().astype(">u2").tobytes())
    rgb = Image.fromarray(_gradient(w, h))
    cases = {
        "mode-1.png": encode(Image.fromarray((x // 4 + y // 4) % 2 == 0), "PNG"),
        "mode-la.png": encode(gray_with("LA", 255 - gray), "PNG"),
        "mode-pa.tif": encode(pa, "TIFF"),
        "mode-i32.tif": encode(i32, "TIFF"),
        "mode-f.tif": encode(Image.fromarray(ramp.astype(np.float32), "F"), "TIFF"),
        "mode-i16b.tif": encode(i16b, "TIFF"),
        "mode-rgbx.jpg": encode(rgb.convert("RGBX"), "JPEG"),
        "mode-ycbcr.tif": encode(rgb.convert("YCbCr"), "TIFF"),
    }
    expected = {"1", "LA", "PA", "I", "F", "I;16B", "RGB", "YCbCr"}
    assert {Image.open(io.BytesIO(d)).mode for d in cases.values()} == expected
    return cases


def _broken_cases() -> dict[str, bytes]:
    whole = encode(Image.fromarray(_rng(7).integers(0, 256, (64, 64, 3), dtype=np.uint8)), "PNG")
    bomb = bomb_png(50_000, 50_000)
    assert len(bomb) < 100
    text = b"This is plain text, not a JPEG, whatever its name says.\n" * 4
    return {
        "truncated.png": whole[: len(whole) // 2],
        "empty.png": b"",
        "not-an-image.jpg": text,
        "bomb-header-50000.png": bomb,
    }


def mp4(frames: Sequence[np.ndarray], fps: int = 10, **x264: str) -> bytes:
    """H.264 MP4 bytes of RGB ``frames``, encoded on one thread (same bytes on any machine).

    Args:
        frames: ``(h, w, 3)`` uint8 arrays, all the same shape.
        fps: frame rate.
        x264: extra libx264 options (e.g. ``qp="0"`` for lossless).

    Returns:
        The file's bytes, with the moov atom (the index) after the media data.
    """
    import av  # noqa: F401 - a test dependency; missing it must fail, not skip

    return encode_video(frames, fps=fps, options=x264)


def mp4_boxes(data: bytes) -> list[bytes]:
    """Types of the complete top-level boxes (atoms) in MP4 ``data``, in order."""
    kinds, pos = [], 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if size == 1 and pos + 16 <= len(data):
            size = struct.unpack(">Q", data[pos + 8 : pos + 16])[0]
        if size < 8 or pos + size > len(data):
            break
        kinds.append(kind)
        pos += size
    return kinds


def _video_cases() -> dict[str, bytes]:
    static = [rgb_frames(1, seed=3)[0]] * 12
    noisy = [
        f ^ _rng(8 + i).integers(0, 64, f.shape, np.uint8) for i, f in enumerate(rgb_frames(30))
    ]
    longer = mp4(noisy)
    assert mp4_boxes(longer)[-1] == b"moov", mp4_boxes(longer)
    truncated = longer[: len(longer) // 2]
    assert b"moov" not in mp4_boxes(truncated)
    vfr = {"pts": [0, 100, 200, 2000, 2100, 3900], "end": 4000, "options": {"bf": "0"}}
    marked = marked_frames(6, 32, 24)
    return {
        "three-frames.mp4": mp4(rgb_frames(3, seed=1)),
        "one-frame.mp4": mp4(rgb_frames(1, seed=2)),
        "static-12.mp4": mp4(static, qp="0"),
        "truncated.mp4": truncated,
        "tiny-8x8.mp4": encode_video(marked_frames(3, 8, 8)),
        "odd-13x7-yuv444.mp4": encode_video(marked_frames(3, 13, 7), pix_fmt="yuv444p"),
        "png-rgb24.mov": encode_video(
            marked_frames(3, 48, 32), codec="png", pix_fmt="rgb24", fmt="mov"
        ),
        **{
            f"rotated-{deg}.mp4": encode_video(marked_frames(3, 64, 48), rotation=deg)
            for deg in (90, 180, 270)
        },
        "vfr.mp4": encode_video(marked, **vfr),
        "vfr-audio-5s.mp4": encode_video(marked, audio_seconds=5.0, **vfr),
        "vfr-header-2.3s.mp4": set_mp4_duration(encode_video(marked, **vfr), 2.3),
    }


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.cases OUT_DIR", file=sys.stderr)
        return 2
    out = write_cases(Path(argv[0]))
    for name, what in CASES.items():
        print(f"{(out / name).stat().st_size:8d}  {name}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
