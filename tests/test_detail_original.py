"""``detail: "original"``: the image at its own resolution within the family's limits.

Any-resolution families (LLaVA-NeXT, OneVision): the grid of whole tiles that covers the
image without downscaling, capped by the checkpoint's largest grid; that is what
transformers does for a checkpoint whose ``image_grid_pinpoints`` holds that one grid, so
counts and greedy tokens are compared with transformers so configured. LLaVA-1.5: as
"high". Its own cache key; accepted by chat, Responses, /ask and reported by uploads.
"""

from __future__ import annotations

import copy
import io
from contextlib import contextmanager

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.model.families.base import IMAGE_MODE, ORIGINAL_MODE
from mmserve.model.families.llava_next import original_pinpoint
from tests.helpers import MODEL, TINY_FAMILIES, assert_same_generation, greedy, upload, user

#: small and large images (width, height): below one tile, a few tiles, past the grid
SIZES = [(40, 40), (97, 250), (300, 200), (640, 99), (1024, 768), (3000, 400)]
MAX_NEW = 6


def _image(photos: dict[str, bytes], size: tuple[int, int]) -> Image.Image:
    return Image.open(io.BytesIO(photos["astronaut.png"])).convert("RGB").resize(size)


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


@contextmanager
def _reference_on_grid(ref, grid: list[int]):
    """transformers' model and processor with ``image_grid_pinpoints`` = ``[grid]`` (the
    session's reference model, restored after)."""
    model, processor = ref
    proc = copy.copy(processor)
    proc.image_processor = copy.copy(processor.image_processor)
    proc.image_processor.image_grid_pinpoints = [grid]
    configs = {id(c): c for c in (model.config, model.model.config)}.values()
    saved = [c.image_grid_pinpoints for c in configs]
    for c in configs:
        c.image_grid_pinpoints = [grid]
    try:
        yield model, proc
    finally:
        for c, s in zip(configs, saved, strict=True):
            c.image_grid_pinpoints = s


def _count(processor, im: Image.Image) -> int:
    ids = processor(images=[[im]], text="<image>x")["input_ids"][0]
    return list(ids).count(processor.image_token_id)


def test_original_grids() -> None:
    """Whole tiles covering the image, capped per side and in all by the largest grid."""

    class V:
        image_size = 112

    class C:  # tiny LLaVA-NeXT's grid: 1x2, 2x1, 2x2, 3x1, 1x3 tiles of 112
        vision_config = V
        image_grid_pinpoints = [[112, 224], [224, 112], [224, 224], [112, 336], [336, 112]]

    assert original_pinpoint(C, 40, 40) == [112, 112]  # one tile, not the 2-tile pinpoint
    assert original_pinpoint(C, 112, 113) == [224, 112]
    assert original_pinpoint(C, 97, 250) == [336, 112]
    # past 4 tiles: the capped grid keeping the most resolution
    assert original_pinpoint(C, 300, 200) == [224, 224]  # 2x2 (scale 0.75), not 1x3 (0.56)
    assert original_pinpoint(C, 3000, 400) == [112, 336]  # 1x3 (scale 0.11), not 2x2 (0.07)
    assert original_pinpoint(C, 400, 3000) == [336, 112]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_original_counts_equal_transformers(families, photos, family) -> None:
    tf = families[family]
    loaded, proc = tf.loaded, tf.make_engine().processor
    mode = proc.image_mode(1, "original")
    assert proc.image_mode(3, "original") == mode
    for w, h in SIZES:
        im = _image(photos, (w, h))
        got = loaded.image_tokens(w, h, mode)
        high = loaded.image_tokens(w, h, proc.image_mode(1, "high"))
        if family == "llava":  # one view: "original" is "high"
            assert mode == IMAGE_MODE and got == high
            continue
        assert mode == ORIGINAL_MODE
        grid = original_pinpoint(loaded.config, w, h)
        with _reference_on_grid(tf.ref, grid) as (_, ref_proc):
            assert got == _count(ref_proc, im), (family, w, h, grid)


@pytest.mark.parametrize("family", ["llava-next", "llava-onevision"])
def test_original_key_differs_from_high_where_the_tiling_differs(families, photos, family):
    tf = families[family]
    eng = tf.make_engine()
    fam = eng.model.family
    differing = []
    for w, h in SIZES:
        img = eng.processor.prepare_image(_png(_image(photos, (w, h))))
        high = fam.mode_item(img, eng.processor.image_mode(1, "high"))
        orig = fam.mode_item(img, eng.processor.image_mode(1, "original"))
        assert orig.key != high.key and orig.mode == ORIGINAL_MODE
        high_tiles = eng.model.vision.preprocess([img.image], IMAGE_MODE)[0].values.shape[0]
        orig_tiles = eng.model.vision.preprocess([img.image], ORIGINAL_MODE)[0].values.shape[0]
        if high_tiles != orig_tiles:
            differing.append((w, h))
    if family == "llava-next":  # below one tile: one tile, where "high" takes two
        assert (40, 40) in differing
    # OneVision's pinpoints hold every grid up to 4x4, so "high" already picks the covering
    # grid: the views tile alike (the key still differs: a view of its own)


@pytest.mark.parametrize("family", ["llava-next", "llava-onevision"])
@pytest.mark.parametrize("size", [(97, 250), (1024, 768)])
def test_original_greedy_equals_transformers_on_its_grid(families, photos, family, size):
    tf = families[family]
    engine = tf.make_engine()
    im = _image(photos, size)
    img = engine.processor.prepare_image(_png(im))
    msgs = user(None, "What is in the picture?")
    req = engine.processor.make_request(
        messages=msgs, images=[img], params=greedy(MAX_NEW), details=["original"]
    )
    (res,) = engine.generate([req])
    text = engine.processor.prompts.render_chat(msgs)
    grid = original_pinpoint(engine.model.config, *size)
    never = engine.model.never_sample_ids
    with _reference_on_grid(tf.ref, grid) as (model, proc):
        inputs = proc(images=[[im]], text=text, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **inputs, max_new_tokens=MAX_NEW, do_sample=False, suppress_tokens=never,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
    n = inputs["input_ids"].shape[1]
    logits = [lg[0].float() for lg in out.logits]
    for lg in logits:
        lg[never] = float("-inf")
    assert res.prompt_tokens == n
    assert_same_generation(
        res.output_ids, out.sequences[0, n:].tolist(), res.logits, logits, f"{family} {size}"
    )


@pytest.fixture(scope="module", params=["llava", "llava-next", "llava-onevision"])
def api(request, families):
    engine = families[request.param].make_engine()
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        c.engine = engine
        yield c


def test_original_through_every_endpoint(api, photos) -> None:
    r = upload(api, _png(_image(photos, (300, 200))))
    assert r.status_code == 200, r.text
    info = r.json()
    by = info["num_image_tokens_by_detail"]
    assert set(by) == {"auto", "low", "high", "original"}
    proc = api.engine.processor
    assert by["original"] == api.engine.model.image_tokens(300, 200, proc.image_mode(1, "original"))
    if api.engine.model.family.name == "llava":
        assert by["original"] == by["high"]
    image_id = info["id"]
    prompts = {}
    for detail in ("high", "original"):
        part = {"type": "image_url", "image_url": {"url": image_id, "detail": detail}}
        body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        r = api.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        prompts[detail] = r.json()["usage"]["prompt_tokens"]
    assert prompts["original"] - prompts["high"] == by["original"] - by["high"]
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=api, max_retries=0
    )
    part = {"type": "input_image", "image_url": image_id, "detail": "original"}
    resp = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": [part]}], max_output_tokens=2
    )
    assert resp.usage.input_tokens == prompts["original"]
    r = api.post(
        f"/v1/images/{image_id}/ask",
        json={"questions": ["What?"], "detail": "original", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    ask = r.json()["answers"][0]["usage"]["prompt_tokens"]
    body = {"questions": ["What?"], "detail": "high", "max_tokens": 2}
    r = api.post(f"/v1/images/{image_id}/ask", json=body)
    assert ask - r.json()["answers"][0]["usage"]["prompt_tokens"] == by["original"] - by["high"]
