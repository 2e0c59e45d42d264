"""LLaVA-NeXT: token counts from transformers' processor, greedy equality with
``LlavaNextForConditionalGeneration.generate``, variable-length image runs in the cache."""

from __future__ import annotations

import base64
import hashlib
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.model.make_checkpoint import make_checkpoint
from tests.comparator import assert_same_generation, reference_generate
from tests.conftest import greedy, png_bytes, user

MAX_NEW = 8


@pytest.fixture(scope="module")
def shapes(photos) -> dict[str, bytes]:  # noqa: ANN001
    """Three aspect ratios, so that three different tile grids are chosen."""
    im = Image.open(io.BytesIO(photos["astronaut.png"])).convert("RGB")
    return {
        "square": png_bytes(im.resize((200, 190))),
        "wide": png_bytes(im.resize((260, 130))),
        "tall": png_bytes(im.resize((90, 270))),
    }


def check(engine, ref, messages, images, what: str) -> None:  # noqa: ANN001
    text = engine.processor.prompts.render_chat(messages)
    req = engine.processor.make_request(messages=messages, images=images, params=greedy(MAX_NEW))
    (res,) = engine.generate([req])
    never = engine.model.never_sample_ids
    ref_ids, ref_logits, ref_len = reference_generate(
        ref, text, [i.image for i in images], never, MAX_NEW
    )
    assert res.prompt_tokens == ref_len, f"{what}: prompt length {res.prompt_tokens} vs {ref_len}"
    assert_same_generation(res.output_ids, ref_ids, res.logits, ref_logits, what)


def test_token_counts_equal_the_processors(next_loaded, next_ref_model) -> None:  # noqa: ANN001
    _, processor = next_ref_model
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    sizes = [(w, h) for w in (1, 30, 111, 112, 113, 200, 333, 640) for h in (1, 57, 112, 250, 481)]
    for w, h in sizes:
        ids = processor(images=[Image.new("RGB", (w, h))], text="<image>")["input_ids"][0]
        assert next_loaded.image_tokens(w, h) == list(ids).count(image_id), (w, h)
    assert len({next_loaded.image_tokens(w, h) for w, h in sizes}) > 5  # not a fixed count


def test_text_only(make_next_engine, next_ref_model) -> None:  # noqa: ANN001
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colours of a sunset."},
    ]
    check(make_next_engine(), next_ref_model, msgs, [], "text only")


@pytest.mark.parametrize("shape", ["square", "wide", "tall"])
def test_one_image_in_three_aspect_ratios(make_next_engine, next_ref_model, shapes, shape) -> None:  # noqa: ANN001
    eng = make_next_engine()
    img = eng.processor.prepare_image(shapes[shape])
    check(eng, next_ref_model, user(None, "What is in this photo?"), [img], shape)


def test_aspect_ratios_choose_different_grids(next_loaded, shapes) -> None:  # noqa: ANN001
    counts = {
        k: next_loaded.image_tokens(*Image.open(io.BytesIO(v)).size) for k, v in shapes.items()
    }
    assert len(set(counts.values())) == 3, counts


def test_two_images_of_different_sizes(make_next_engine, next_ref_model, shapes, photos) -> None:  # noqa: ANN001
    eng = make_next_engine()
    imgs = [
        eng.processor.prepare_image(shapes["wide"]),
        eng.processor.prepare_image(photos["cat.png"]),
    ]
    check(eng, next_ref_model, user(None, "and", None, "Which is brighter?"), imgs, "two images")


def test_multi_turn_chat_with_an_image(make_next_engine, next_ref_model, photos) -> None:  # noqa: ANN001
    eng = make_next_engine()
    img = eng.processor.prepare_image(photos["coffee.png"])
    msgs = user(None, "What is in the cup?") + [
        {"role": "assistant", "content": "Coffee with milk foam."},
        {"role": "user", "content": "What colour is the saucer?"},
    ]
    check(eng, next_ref_model, msgs, [img], "multi-turn")


def test_different_images_and_questions_give_different_answers(make_next_engine, shapes) -> None:  # noqa: ANN001
    eng = make_next_engine()
    answers = set()
    for data in shapes.values():
        img = eng.processor.prepare_image(data)
        for q in ("What is this?", "Where is it?"):
            req = eng.processor.make_request(messages=user(None, q), images=[img], params=greedy(6))
            answers.add(tuple(eng.generate([req])[0].output_ids))
    assert len(answers) == 6


def test_rebuild_is_byte_identical(next_model_dir, tmp_path) -> None:  # noqa: ANN001
    again = make_checkpoint(tmp_path / "again", "tiny", family="llava-next")
    for name in ("model.safetensors", "tokenizer.model", "tokenizer.json", "config.json"):
        a, b = (d / name for d in (next_model_dir, again))
        assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def ask(c: TestClient, parts: list, max_tokens: int = MAX_NEW) -> dict:
    r = c.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": parts}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "cfg",
    [
        {"page_size": 1},
        {"page_size": 16},
        {"page_size": 1, "disable_radix_cache": True},
        {"page_size": 16, "disable_radix_cache": True},
    ],
)
def test_api_equals_reference_cache_on_and_off(
    make_next_engine, next_ref_model, shapes, cfg
) -> None:  # noqa: ANN001
    eng = make_next_engine(**cfg)
    tok = eng.model.tokenizer
    with TestClient(create_app(eng, ServerSettings(served_model_name="next"))) as c:
        for shape in ("wide", "tall"):
            img = eng.processor.prepare_image(shapes[shape])
            msgs = user(None, "What is in this photo?")
            text = eng.processor.prompts.render_chat(msgs)
            ref_ids, _, ref_len = reference_generate(
                next_ref_model, text, [img.image], eng.model.never_sample_ids, MAX_NEW
            )
            parts = [
                {"type": "image_url", "image_url": {"url": data_url(shapes[shape])}},
                {"type": "text", "text": "What is in this photo?"},
            ]
            for _ in range(2):  # the second one hits the cache (when on)
                out = ask(c, parts)
                assert out["usage"]["prompt_tokens"] == ref_len
                want = tok.decode(ref_ids, skip_special_tokens=True)
                assert out["choices"][0]["message"]["content"] == want, shape


def test_uploaded_image_second_question_caches_its_whole_run(make_next_engine, shapes) -> None:  # noqa: ANN001
    eng = make_next_engine(page_size=16)
    with TestClient(create_app(eng, ServerSettings(served_model_name="next"))) as c:
        info = c.post("/v1/images", files={"file": ("t.png", shapes["tall"])}).json()
        img = eng.processor.prepare_image(shapes["tall"])
        n = eng.processor.image_tokens(img)
        assert info["num_image_tokens"] == n
        req = eng.processor.make_request(messages=user(None, "What is it?"), images=[img])
        end = req.spans[0].end
        r = c.post(
            f"/v1/images/{info['id']}/ask", json={"questions": ["What is it?"], "max_tokens": 4}
        )
        assert r.status_code == 200, r.text
        runs = eng.runner.vision_tower_images
        r = c.post(f"/v1/images/{info['id']}/ask", json={"questions": ["Why?"], "max_tokens": 4})
        cached = r.json()["answers"][0]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (end // 16) * 16 >= n - 16
        assert eng.runner.vision_tower_images == runs  # no tower run for the second question


def test_two_images_of_different_sizes_never_share_image_kv(make_next_engine, shapes) -> None:  # noqa: ANN001
    eng = make_next_engine()
    with TestClient(create_app(eng, ServerSettings(served_model_name="next"))) as c:
        a = ask(c, [{"type": "image_url", "image_url": {"url": data_url(shapes["wide"])}}])
        b = ask(c, [{"type": "image_url", "image_url": {"url": data_url(shapes["square"])}}])
        img = eng.processor.prepare_image(shapes["square"])
        prefix = eng.processor.make_request(messages=user(None), images=[img]).spans[0].start
        # only the text before the image (the chat template's opening) can be shared
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] <= prefix
        assert a["usage"]["prompt_tokens"] != b["usage"]["prompt_tokens"]


def test_too_many_image_tokens_is_a_400_before_any_tower_run(make_next_engine, shapes) -> None:  # noqa: ANN001
    eng = make_next_engine(max_image_tokens_per_request=300)
    with TestClient(create_app(eng, ServerSettings(served_model_name="next"))) as c:
        parts = [
            {"type": "image_url", "image_url": {"url": data_url(shapes[k])}}
            for k in ("wide", "tall")
        ]
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": parts}], "max_tokens": 2},
        )
        err = r.json()["error"]
        assert r.status_code == 400 and "--max-image-tokens-per-request" in err["message"], err
        sizes = [
            eng.processor.image_tokens(eng.processor.prepare_image(shapes[k]))
            for k in ("wide", "tall")
        ]
        assert f"{sizes[0]}, {sizes[1]} tokens" in err["message"]
        assert eng.runner.vision_tower_images == 0
        assert ask(c, [{"type": "text", "text": "hello"}], 2)["usage"]["completion_tokens"] == 2


def test_video_per_frame_qa_on_next(make_next_engine) -> None:  # noqa: ANN001
    from pathlib import Path

    eng = make_next_engine()
    video = (Path(__file__).resolve().parents[1] / "samples" / "video" / "pans.mp4").read_bytes()
    with TestClient(create_app(eng, ServerSettings(served_model_name="next"))) as c:
        vid = c.post("/v1/videos", files={"file": ("v.mp4", video)}).json()["id"]
        r = c.post(
            f"/v1/videos/{vid}/qa",
            json={"questions": ["What is here?"], "num_frames": 3, "max_tokens": 3},
        )
        assert r.status_code == 200, r.text
        events = [ln for ln in r.text.splitlines() if ln.strip()]
        assert sum('"answer"' in e for e in events) == 3, events[:4]
        assert eng.runner.vision_tower_images == 3
