"""Images with more than 8 bits per sample (I;16*, I, F) are scaled to 8-bit grey as a
viewer shows them, not clipped to white; a 16-bit image and its 8-bit version are one
image (same key, same answer)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from PIL import Image

from mmserve.vision.hashing import image_key
from mmserve.vision.image import ImageLimits, decode_image, to_8bit
from tests.helpers import greedy, png_bytes, user

NAN, INF = float("nan"), float("inf")
# (mode, numpy dtype of the raw bytes, values, expected 8-bit values)
SIXTEEN = [0, 128, 129, 257, 385, 386, 65535, 32896]
SIXTEEN_8 = [0, 0, 1, 1, 1, 2, 255, 128]  # round(v / 257): 128/257 = 0.498, 129/257 = 0.502
CASES = {
    "I;16": ("<u2", SIXTEEN, SIXTEEN_8),
    "I;16L": ("<u2", SIXTEEN, SIXTEEN_8),
    "I;16B": (">u2", SIXTEEN, SIXTEEN_8),
    "I;16N": ("=u2", SIXTEEN, SIXTEEN_8),
    "I in 0..65535": ("<i4", SIXTEEN, SIXTEEN_8),
    # outside 0..65535: min..max stretched; 35000 * 255 / 70000 = 127.5 rounds up
    "I stretched": ("<i4", [-100, 0, 100, 1000], [0, 23, 46, 255]),
    "I stretched half": ("<i4", [0, 35000, 70000, 70000], [0, 128, 255, 255]),
    "I constant": ("<i4", [-7, -7, -7, -7], [128, 128, 128, 128]),
    "I 65536": ("<i4", [0, 32768, 65536, 1], [0, 128, 255, 0]),
    "F": ("<f4", [0.0, 0.25, 0.5, 1.0], [0, 64, 128, 255]),
    "F constant": ("<f4", [3.5, 3.5, 3.5, 3.5], [128, 128, 128, 128]),
    # NaN and -inf read as 0, +inf as 255; neither takes part in min..max
    "F nan inf": ("<f4", [NAN, INF, -INF, 2.0, 4.0, 3.0], [0, 255, 0, 0, 255, 128]),
    "F all nan": ("<f4", [NAN, NAN], [0, 0]),
    "F only inf": ("<f4", [INF, -INF], [255, 0]),
    "F huge span": ("<f4", [-3.4e38, 0.0, 3.4e38, 3.4e38], [0, 128, 255, 255]),
}


def make(mode: str, dtype: str, values: list, shape: tuple[int, int] | None = None) -> Image.Image:
    mode = mode.split()[0]
    a = np.asarray(values, dtype=dtype)
    h, w = shape or (1, a.size)
    return Image.frombytes(mode, (w, h), a.tobytes())


def encodings(im: Image.Image) -> dict[str, bytes]:
    """Every format of PNG and TIFF that Pillow can write this mode in."""
    out = {}
    for fmt in ("PNG", "TIFF"):
        try:
            out[fmt] = png_bytes(im, fmt)
        except (OSError, KeyError, ValueError):  # e.g. PNG cannot hold I, F, I;16L, I;16N
            pass
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_each_mode_is_scaled_as_specified(case: str) -> None:
    dtype, values, want = CASES[case]
    im = make(case, dtype, values)
    out = to_8bit(im)
    assert out.mode == "L" and out.size == im.size
    np.testing.assert_array_equal(np.asarray(out)[0], np.asarray(want, dtype=np.uint8))
    # the same through decode_image, from every file format that can hold the mode
    for fmt, data in encodings(im).items():
        got = decode_image(data, ImageLimits())
        assert got.mode == "L", (case, fmt)
        np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(want, dtype=np.uint8))


def test_every_deep_mode_is_covered_and_8_bit_modes_are_untouched() -> None:
    from PIL import ImageMode

    def bits(mode: str) -> int:
        typestr = ImageMode.getmode(mode).typestr
        return 1 if typestr.endswith("b1") else 8 * int(typestr[-1])

    deep = {m for m in Image.MODES if bits(m) > 8}
    assert {"I;16", "I;16B", "I;16L", "I;16N", "I", "F"} <= deep
    assert {c.split()[0] for c in CASES} == deep  # every mode Pillow has is tested above
    for mode in set(Image.MODES) - deep:
        im = Image.new(mode, (3, 2))
        assert to_8bit(im) is im


@pytest.fixture(scope="module")
def eng(make_engine):
    return make_engine(disable_radix_cache=True)


@pytest.fixture(scope="module")
def gray8(photos) -> Image.Image:
    return Image.open(io.BytesIO(photos["cat.png"])).convert("L")


def deep_versions(gray8: Image.Image) -> dict[str, Image.Image]:
    """The 8-bit grey image stored as v * 257 in every deep integer mode."""
    v = np.asarray(gray8).astype(np.uint32) * 257
    h, w = v.shape
    return {
        mode: Image.frombytes(mode, (w, h), v.astype(dtype).tobytes())
        for mode, dtype in (("I;16", "<u2"), ("I;16B", ">u2"), ("I;16L", "<u2"), ("I", "<i4"))
    }


def test_16_bit_and_8_bit_versions_have_one_key(eng, gray8) -> None:
    want = eng.processor.prepare_image(png_bytes(gray8)).key
    seen = 0
    for mode, im in deep_versions(gray8).items():
        for fmt, data in encodings(im).items():
            got = eng.processor.prepare_image(data)
            assert got.key == want, (mode, fmt)
            assert got.image.mode == "L"
            seen += 1
    assert seen >= 5  # PNG: I;16, I;16B; TIFF: I;16, I;16B, I;16L, I


def test_16_bit_and_8_bit_versions_get_the_same_answer(eng, gray8) -> None:
    msgs = user(None, "What is this?")
    answers = []
    for data in (png_bytes(gray8), png_bytes(deep_versions(gray8)["I;16"])):
        img = eng.processor.prepare_image(data)
        (res,) = eng.generate(
            [eng.processor.make_request(messages=msgs, images=[img], params=greedy(6))]
        )
        answers.append(res)
    assert answers[0].output_ids == answers[1].output_ids
    for a, b in zip(answers[0].logits, answers[1].logits, strict=True):
        assert np.array_equal(a.numpy(), b.numpy())


def test_depth_map_is_not_answered_like_a_white_image(eng) -> None:
    # a depth-map-like gradient over the whole 16-bit range, near to far
    w, h = 256, 192
    y, x = np.mgrid[0:h, 0:w]
    depth = ((0.7 * x / (w - 1) + 0.3 * y / (h - 1)) * 65535).round().astype("<u2")
    im16 = Image.frombytes("I;16", (w, h), depth.astype("<u2").tobytes())
    white = Image.new("L", (w, h), 255)
    as8 = Image.fromarray(((depth.astype(np.uint32) * 2 + 257) // 514).astype(np.uint8))
    # what plain conversion (and transformers) does: nearly every pixel clips to white
    clipped = np.asarray(Image.frombytes("I;16", (w, h), depth.tobytes()).convert("L"))
    assert (clipped == 255).mean() > 0.99
    img = eng.processor.prepare_image(png_bytes(im16))
    assert img.image.mode == "L" and (np.asarray(img.image) == 255).mean() < 0.05
    msgs = user(None, "What is this?")

    def answer(data: bytes):
        x = eng.processor.prepare_image(data)
        return eng.generate(
            [eng.processor.make_request(messages=msgs, images=[x], params=greedy(4))]
        )[0]

    got, same, blank = answer(png_bytes(im16)), answer(png_bytes(as8)), answer(png_bytes(white))
    assert (
        eng.processor.prepare_image(png_bytes(im16)).key
        != eng.processor.prepare_image(png_bytes(white)).key
    )
    assert got.output_ids == same.output_ids
    assert not np.allclose(got.logits[0].numpy(), blank.logits[0].numpy(), atol=1e-3)


SHAPES = st.tuples(st.integers(1, 6), st.integers(1, 6))


@settings(max_examples=60, deadline=None)
@given(
    a=arrays(np.uint16, SHAPES),
    layout=st.sampled_from([("I;16", "<u2"), ("I;16B", ">u2"), ("I;16L", "<u2"), ("I", "<i4")]),
)
def test_property_16_bit_is_rounded_and_monotone(a: np.ndarray, layout: tuple) -> None:
    mode, dtype = layout
    h, w = a.shape
    out = np.asarray(to_8bit(Image.frombytes(mode, (w, h), a.astype(dtype).tobytes())))
    assert out.dtype == np.uint8 and out.shape == a.shape
    assert np.all(np.abs(out.astype(np.float64) * 257 - a) <= 128.5)  # nearest of v/257
    order = np.argsort(a, axis=None, kind="stable")
    assert np.all(np.diff(out.ravel()[order].astype(int)) >= 0)


@settings(max_examples=60, deadline=None)
@given(v=arrays(np.uint8, SHAPES))
def test_property_8_bit_times_257_round_trips_to_the_same_key(v: np.ndarray) -> None:
    h, w = v.shape
    gray = Image.fromarray(v)
    im16 = Image.frombytes("I;16", (w, h), (v.astype(np.uint32) * 257).astype("<u2").tobytes())
    out = to_8bit(im16)
    np.testing.assert_array_equal(np.asarray(out), v)
    assert image_key(out, b"fp") == image_key(gray, b"fp")
    dec = decode_image(png_bytes(im16), ImageLimits(max_resized_side=10**9))
    assert image_key(dec, b"fp") == image_key(gray, b"fp")


@settings(max_examples=80, deadline=None)
@given(
    a=arrays(
        np.float32,
        SHAPES,
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    )
)
def test_property_float_is_stretched_without_crashing(a: np.ndarray) -> None:
    h, w = a.shape
    out = np.asarray(to_8bit(Image.frombytes("F", (w, h), a.astype("<f4").tobytes())))
    assert out.dtype == np.uint8 and out.shape == a.shape
    assert np.all(out[np.isnan(a)] == 0) and np.all(out[a == -INF] == 0)
    assert np.all(out[a == INF] == 255)
    finite = np.isfinite(a)
    if finite.any():
        lo, hi = a[finite].min(), a[finite].max()
        if lo == hi:
            assert np.all(out[finite] == 128)
        else:
            assert np.all(out[finite & (a == lo)] == 0) and np.all(out[finite & (a == hi)] == 255)
            order = np.argsort(a[finite], kind="stable")
            assert np.all(np.diff(out[finite][order].astype(int)) >= 0)
