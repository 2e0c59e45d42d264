"""Image decoding, content keys and pseudo-tokens (invariants 1 and 2), on the shared cases."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
from PIL import Image

from mmserve.frontend.processor import RequestError
from mmserve.vision.hashing import image_key, processor_fingerprint, pseudo_token_ids
from mmserve.vision.image import ImageError, ImageLimits, decode_image
from tests.helpers import assert_same_generation, check_against_reference, greedy, png_bytes, user


@pytest.fixture(scope="module")
def eng(make_engine):
    return make_engine()


def read(cases_dir, name: str) -> bytes:
    return (cases_dir / name).read_bytes()


def test_exif_orientation_hashes_rotated_pixels(eng, cases_dir) -> None:
    img = eng.processor.prepare_image(read(cases_dir, "exif-orientation-6.jpg"))
    assert img.image.size == (16, 24)  # stored 24x16, shown rotated
    raw = Image.open(cases_dir / "exif-orientation-6.jpg")
    raw.load()
    rotated = raw.transpose(Image.Transpose.ROTATE_270)
    assert image_key(rotated, eng.processor.fingerprint) == img.key


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("bytes-30x150.png", "bytes-150x30.png", False),
        ("same-size-a.png", "same-size-b.png", False),
        ("pixel-base.png", "pixel-changed.png", False),
        ("pixel-base.png", "pixel-base-copy.jpg.png", True),
    ],
)
def test_key_depends_on_pixels_and_shape_only(eng, cases_dir, a, b, same) -> None:
    ka = eng.processor.prepare_image(read(cases_dir, a)).key
    kb = eng.processor.prepare_image(read(cases_dir, b)).key
    assert (ka == kb) is same


def test_reencoded_sample_photo_same_id_one_pixel_differs(eng, photos) -> None:
    original = eng.processor.prepare_image(photos["cat.png"])
    resaved = eng.processor.prepare_image(png_bytes(original.image.copy()))
    assert resaved.id == original.id
    arr = np.array(original.image)
    arr[0, 0, 0] ^= 1
    changed = eng.processor.prepare_image(png_bytes(Image.fromarray(arr)))
    assert changed.id != original.id


def test_processor_settings_change_the_key(eng) -> None:
    proc = eng.model.processor.image_processor
    other = copy.deepcopy(proc)
    other.image_mean = [0.5, 0.5, 0.5]
    im = Image.new("RGB", (8, 8), (10, 20, 30))
    assert image_key(im, processor_fingerprint(proc)) != image_key(im, processor_fingerprint(other))


def test_palette_is_part_of_the_key() -> None:
    a = Image.new("P", (4, 4), 0)
    b = a.copy()
    a.putpalette([255, 0, 0] * 256)
    b.putpalette([0, 0, 255] * 256)
    assert a.tobytes() == b.tobytes()
    assert image_key(a, b"fp") != image_key(b, b"fp")


def test_pseudo_ids_are_negative_distinct_and_stable() -> None:
    key = bytes(range(16))
    ids = pseudo_token_ids(key, 576)
    assert len(set(ids)) == 576 and all(-(2**63) <= i < 0 for i in ids)
    assert ids == pseudo_token_ids(key, 576)
    assert set(ids).isdisjoint(pseudo_token_ids(bytes(16), 576))


@pytest.mark.parametrize(
    "name, words",
    [
        ("empty.png", "empty"),
        ("truncated.png", "truncated"),
        ("not-an-image.jpg", "not a decodable image"),
        ("bomb-header-50000.png", "refused before decoding.*2500000000 pixels"),
        ("one-pixel-high.png", "aspect ratio"),
    ],
)
def test_bad_images_are_refused_with_a_reason(cases_dir, name, words) -> None:
    with pytest.raises(ImageError, match=words):
        decode_image(read(cases_dir, name), ImageLimits())


def test_byte_limit() -> None:
    with pytest.raises(ImageError, match="limit is 10 bytes"):
        decode_image(b"x" * 11, ImageLimits(max_bytes=10))


@pytest.mark.parametrize(
    "name",
    [
        "gray-224.jpg",
        "palette.png",
        "rgba-64.png",
        "cmyk.jpg",
        "gray16.png",
        "animated.gif",
        "one-by-one.png",
        "exif-orientation-6.jpg",
    ],
)
def test_odd_modes_are_answered_like_transformers(eng, ref_model, cases_dir, name) -> None:
    img = eng.processor.prepare_image(read(cases_dir, name))
    msgs = user(None, "What is this?")
    check_against_reference(eng, ref_model, msgs, [img], name, max_new=4)


def test_similar_image_after_another_gets_no_wrong_hit(make_engine, cases_dir) -> None:
    msgs = user(None, "Describe it.")
    answers = {}
    for disable in (False, True):
        e = make_engine(disable_radix_cache=disable)
        out = []
        for name in ("same-size-a.png", "same-size-b.png"):
            img = e.processor.prepare_image(read(cases_dir, name))
            out.append(
                e.generate(
                    [e.processor.make_request(messages=msgs, images=[img], params=greedy(6))]
                )[0]
            )
        answers[disable] = out
    cached_b = answers[False][1]
    assert cached_b.cached_tokens < 10  # only the text before the image
    for a, b in zip(answers[False], answers[True], strict=True):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "a then b")
    assert answers[True][0].output_ids != answers[True][1].output_ids


def test_literal_placeholder_in_text_is_refused(eng, photos) -> None:
    img = eng.processor.prepare_image(photos["cat.png"])
    with pytest.raises(RequestError, match="reserved image placeholder"):
        eng.processor.make_request(messages=user(None, "what is <image> here?"), images=[img])


def test_placeholder_count_must_match_images(eng, photos) -> None:
    img = eng.processor.prepare_image(photos["cat.png"])
    with pytest.raises(RequestError, match="1 image placeholders but 2 images"):
        eng.processor.make_request(prompt="USER: <image>\nhi ASSISTANT:", images=[img, img])


def test_text_ids_and_image_ids_are_disjoint(eng, photos) -> None:
    img = eng.processor.prepare_image(photos["cat.png"])
    req = eng.processor.make_request(messages=user(None, "hello"), images=[img])
    span = req.spans[0]
    text = req.input_ids[: span.start] + req.input_ids[span.end :]
    assert all(0 <= t < eng.model.decoder.shape.vocab_size for t in text)
    assert all(t < 0 for t in req.input_ids[span.start : span.end])


def test_unpaired_surrogate_is_a_request_error(eng) -> None:
    with pytest.raises(RequestError, match="not valid Unicode"):
        eng.processor.make_request(messages=[{"role": "user", "content": "bad \ud800 text"}])


def test_huge_text_is_refused_before_tokenizing(eng) -> None:
    text = "ab " * (eng.processor.prompts.max_chars // 3 + 1)
    with pytest.raises(RequestError, match="more than the model's context"):
        eng.processor.make_request(messages=[{"role": "user", "content": text}])


@pytest.mark.parametrize("mode, trns", [("L", 7), ("RGB", (7, 7, 7))])
def test_a_transparency_colour_is_part_of_the_key(make_engine, mode, trns) -> None:
    # the processor composites a tRNS colour on white, so the features differ: keys must too
    eng = make_engine()
    im = Image.new(mode, (16, 16), trns if mode == "L" else trns)
    plain = png_bytes(im)
    im.info["transparency"] = trns
    buf = io.BytesIO()
    im.save(buf, "PNG", transparency=trns)
    a, b = eng.processor.prepare_image(plain), eng.processor.prepare_image(buf.getvalue())
    assert "transparency" in b.image.info
    assert a.key != b.key
