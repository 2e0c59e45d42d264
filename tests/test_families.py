"""Every model family against transformers' ``generate`` on its tiny checkpoint: prompt
lengths and greedy output equal (text only, an image in several aspect ratios, two
images, a chat with an image), through the engine and through the API with the cache
on and off; image-token counts equal the processor's; checkpoints rebuild byte for byte.

What only one family does is tested in tests/test_reference.py (LLaVA-1.5),
tests/test_llava_next.py and tests/test_llava_onevision.py.
"""

from __future__ import annotations

import hashlib
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.testing.checkpoints import make_checkpoint
from tests.helpers import (
    CACHE_CONFIGS,
    MODEL,
    TINY_FAMILIES,
    chat_json,
    check_against_reference,
    data_url,
    greedy,
    image_part,
    reference_generate,
    upload,
    user,
)

MAX_NEW = 8
#: the families whose images take a grid of tiles ("anyres") and so a size-dependent
#: number of tokens, with the shapes (tests/conftest.py ``shapes``) each is asked about
ANY_RES = {
    "llava-next": ("square", "wide", "tall"),
    "llava-onevision": ("square", "wide", "tall", "large"),
}
#: the image whose whole run a second question reuses: OneVision's large one has its
#: grid features shrunk
UPLOADED = {"llava-next": "tall", "llava-onevision": "large"}
#: images per API request: OneVision's second request takes its multi-image (base tile) path
API_CASES = {
    "llava-next": (["wide"], ["tall"]),
    "llava-onevision": (["tall"], ["wide", "square"]),
}


# ---- greedy equality with transformers, in the engine -----------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_text_only(families, family: str) -> None:
    fam = families[family]
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colours of a sunset."},
    ]
    check_against_reference(fam.make_engine(), fam.ref, msgs, [], "text only")


@pytest.mark.parametrize(
    ("family", "shape"), [(f, s) for f, names in ANY_RES.items() for s in names]
)
def test_one_image_in_each_aspect_ratio(families, shapes, family: str, shape: str) -> None:
    fam = families[family]
    eng = fam.make_engine()
    img = eng.processor.prepare_image(shapes[shape])
    check_against_reference(eng, fam.ref, user(None, "What is in this photo?"), [img], shape)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_two_images_of_different_sizes(families, shapes, photos, family: str) -> None:
    fam = families[family]
    eng = fam.make_engine()
    imgs = [eng.processor.prepare_image(d) for d in (shapes["wide"], photos["cat.png"])]
    msgs = user(None, "and", None, "Which is brighter?")
    check_against_reference(eng, fam.ref, msgs, imgs, "two images")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_multi_turn_chat_with_an_image(families, photos, family: str) -> None:
    fam = families[family]
    eng = fam.make_engine()
    img = eng.processor.prepare_image(photos["coffee.png"])
    msgs = user(None, "What is in the cup?") + [
        {"role": "assistant", "content": "Coffee with milk foam."},
        {"role": "user", "content": "What colour is the saucer?"},
    ]
    check_against_reference(eng, fam.ref, msgs, [img], "multi-turn")


@pytest.mark.parametrize("family", sorted(ANY_RES))
def test_different_images_and_questions_give_different_answers(
    families, shapes, family: str
) -> None:
    eng = families[family].make_engine()
    answers = set()
    for name in ANY_RES[family]:
        img = eng.processor.prepare_image(shapes[name])
        for q in ("What is this?", "Where is it?"):
            req = eng.processor.make_request(messages=user(None, q), images=[img], params=greedy(6))
            answers.add(tuple(eng.generate([req])[0].output_ids))
    assert len(answers) == 2 * len(ANY_RES[family])


# ---- image-token counts -------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(ANY_RES))
def test_token_counts_equal_the_processors(families, family: str) -> None:
    fam = families[family]
    loaded, (_, processor) = fam.loaded, fam.ref
    tile = loaded.config.vision_config.image_size
    sizes = [
        (w, h)
        for w in (1, 30, tile - 1, tile, tile + 1, 200, 333, 640)
        for h in (1, 57, tile, 250, 481)
    ]
    for w, h in sizes:
        ids = processor(images=[Image.new("RGB", (w, h))], text="<image>")["input_ids"][0]
        assert loaded.image_tokens(w, h) == list(ids).count(processor.image_token_id), (w, h)
    assert len({loaded.image_tokens(w, h) for w, h in sizes}) > 5  # not a fixed count


@pytest.mark.parametrize("family", sorted(ANY_RES))
def test_aspect_ratios_choose_different_grids(families, shapes, family: str) -> None:
    loaded = families[family].loaded
    counts = {
        k: loaded.image_tokens(*Image.open(io.BytesIO(shapes[k])).size) for k in ANY_RES[family]
    }
    assert len(set(counts.values())) == len(counts), counts


# ---- the checkpoint -----------------------------------------------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_rebuild_is_byte_identical(families, tmp_path, family: str) -> None:
    built = families[family].model_dir
    again = make_checkpoint(tmp_path / "again", "tiny", family=family)
    names = sorted(p.name for p in built.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    for name in names:
        a, b = (d / name for d in (built, again))
        assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()


# ---- through the API ------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CACHE_CONFIGS)
@pytest.mark.parametrize("family", sorted(API_CASES))
def test_api_equals_reference_cache_on_and_off(families, shapes, family: str, cfg) -> None:
    fam = families[family]
    eng = fam.make_engine(**cfg)
    tok = eng.model.tokenizer
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        for names in API_CASES[family]:
            imgs = [eng.processor.prepare_image(shapes[k]) for k in names]
            msgs = user(*([None] * len(names)), "What is in this photo?")
            text = eng.processor.prompts.render_chat(msgs)
            ref_ids, _, ref_len = reference_generate(
                fam.ref, text, [i.image for i in imgs], eng.model.never_sample_ids, MAX_NEW
            )
            want = tok.decode(ref_ids, skip_special_tokens=True)
            parts = [image_part(data_url(shapes[k])) for k in names]
            parts.append({"type": "text", "text": "What is in this photo?"})
            for _ in range(2):  # the second one hits the cache (when on)
                out = chat_json(c, parts, max_tokens=MAX_NEW)
                assert out["usage"]["prompt_tokens"] == ref_len
                assert out["choices"][0]["message"]["content"] == want, names


@pytest.mark.parametrize("family", sorted(UPLOADED))
def test_uploaded_image_second_question_caches_its_whole_run(families, shapes, family) -> None:
    eng = families[family].make_engine(page_size=16)
    data = shapes[UPLOADED[family]]
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        info = upload(c, data).json()
        img = eng.processor.prepare_image(data)
        n = eng.processor.image_tokens(img)
        assert info["num_image_tokens"] == n
        first, second = (
            eng.processor.make_request(messages=user(None, q), images=[img]).input_ids
            for q in ("What is it?", "Why?")
        )
        shared = next(k for k, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        r = c.post(
            f"/v1/images/{info['id']}/ask", json={"questions": ["What is it?"], "max_tokens": 4}
        )
        assert r.status_code == 200, r.text
        runs = eng.runner.vision_tower_images
        r = c.post(f"/v1/images/{info['id']}/ask", json={"questions": ["Why?"], "max_tokens": 4})
        cached = r.json()["answers"][0]["usage"]["prompt_tokens_details"]["cached_tokens"]
        # the whole pages of the image and the text around it that both prompts share
        assert cached == shared // 16 * 16 >= n - 16
        assert eng.runner.vision_tower_images == runs  # no tower run for the second question
