"""OpenAI's image ``detail`` acted on: "low" is the family's single base view (LLaVA-NeXT and
OneVision: the downscaled whole image and a newline, no tiles; LLaVA-1.5: its only view),
"high" and "auto" what the family does. Counts equal transformers' processor for the view,
greedy tokens equal transformers' on the low view, a low view never shares KV with the
high view of the same image (and two low views do), through chat, Responses and /ask.
"""

from __future__ import annotations

import io

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.model.families.base import BASE_MODE, IMAGE_MODE
from tests.helpers import (
    MODEL,
    TINY_FAMILIES,
    assert_same_generation,
    chat_json,
    greedy,
    upload,
    user,
)

#: (width, height) of the images whose counts are checked; 1024 x 768 is the issue's photo
SIZES = [(1024, 768), (768, 1024), (300, 200), (97, 250), (40, 40), (640, 99)]
MAX_NEW = 8


def _image(photos: dict[str, bytes], size: tuple[int, int]) -> Image.Image:
    return Image.open(io.BytesIO(photos["astronaut.png"])).convert("RGB").resize(size)


def _processor_count(processor, images: list[Image.Image], text: str) -> int:
    """Image tokens transformers' processor puts in ``text`` for ``images`` (one prompt)."""
    ids = processor(images=[images], text=text)["input_ids"][0]
    return list(ids).count(processor.image_token_id)


def _next_low_features(ref_model, im: Image.Image) -> torch.Tensor:
    """transformers' LLaVA-NeXT on the base tile alone: its tower, projector and
    ``pack_image_features`` (which packs a one-tile image as its features and a newline)
    on the first tile its image processor makes. ``[tokens, hidden]``."""
    model, processor = ref_model
    cfg = model.config
    out = processor.image_processor(images=[im], return_tensors="pt")
    base = out["pixel_values"][0, :1]
    with torch.no_grad():
        hidden = model.model.vision_tower(base, output_hidden_states=True).hidden_states
        feats = hidden[cfg.vision_feature_layer]
        if cfg.vision_feature_select_strategy == "default":
            feats = feats[:, 1:]
        feats = model.model.multi_modal_projector(feats)
        packed, _ = model.model.pack_image_features(
            [feats], out["image_sizes"], cfg.vision_feature_select_strategy,
            image_newline=model.model.image_newline,
        )  # fmt: skip
    return packed[0]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_counts_per_detail_equal_transformers(families, photos, family) -> None:
    """high and auto: the processor's count for the image alone; low: LLaVA-1.5 the same,
    OneVision the processor's count for an image of a multi-image prompt (its base view),
    NeXT the length transformers' packing gives the base tile alone."""
    tf = families[family]
    loaded, (_, processor) = tf.loaded, tf.ref
    proc = tf.make_engine().processor
    for w, h in SIZES:
        im = _image(photos, (w, h))
        alone = _processor_count(processor, [im], "<image>x")
        for detail in ("high", "auto"):
            mode = proc.image_mode(1, detail)
            assert mode == IMAGE_MODE
            assert loaded.image_tokens(w, h, mode) == alone, (family, w, h, detail)
        low = proc.image_mode(1, "low")
        got = loaded.image_tokens(w, h, low)
        if family == "llava":
            assert (low, got) == (IMAGE_MODE, alone)
        elif family == "llava-onevision":
            two = _processor_count(processor, [im, im], "<image>x<image>")
            assert low == BASE_MODE and got == two // 2 < alone
        else:
            assert low == BASE_MODE and got == _next_low_features(tf.ref, im).shape[0] < alone
        # a prompt of several images: "high" is what the family does today there, and
        # "low" is never more than it
        for detail in ("high", "auto"):
            assert proc.image_mode(3, detail) == loaded.family.image_mode(3)
        assert loaded.image_tokens(w, h, proc.image_mode(3, "low")) <= loaded.image_tokens(
            w, h, proc.image_mode(3, "high")
        )


def test_next_low_features_equal_transformers(families, photos) -> None:
    """Our LLaVA-NeXT base view (the image processor asked for one tile) gives the same
    features as transformers' modules on the base tile of its full any-resolution output."""
    tf = families["llava-next"]
    vision = tf.loaded.vision
    for size in [(1024, 768), (97, 250)]:
        im = _image(photos, size)
        (ours,) = vision.encode_pixels(vision.preprocess([im], BASE_MODE))
        ref = _next_low_features(tf.ref, im)
        torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-4, atol=1e-4)


def _reference_low(tf, engine, msgs, im, n):
    """transformers' greedy generation on the low view of ``im`` (``n`` image tokens)."""
    model, processor = tf.ref
    text = engine.processor.prompts.render_chat(msgs).replace("<image>", "<image>" * n)
    ids = processor.tokenizer(text, return_tensors="pt")
    never = engine.model.never_sample_ids
    kw = dict(max_new_tokens=MAX_NEW, do_sample=False, suppress_tokens=never,
              output_logits=True, return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        if tf.family == "llava-onevision":
            # transformers' own base view: an image of a multi-image prompt
            # (batch_num_images > 1 turns the tiles off), here the only image of its prompt
            two = processor(images=[[im, im]], text="<image><image>", return_tensors="pt")
            out = model.generate(
                **ids, pixel_values=two["pixel_values"][:1], image_sizes=two["image_sizes"][:1],
                batch_num_images=torch.tensor([2]), **kw,
            )  # fmt: skip
            seq = out.sequences[0, ids["input_ids"].shape[1] :]
        else:  # NeXT's processor always tiles: its base-tile features go in as embeddings
            embeds = model.get_input_embeddings()(ids["input_ids"])
            slots = ids["input_ids"][0] == model.config.image_token_index
            embeds[0, slots] = _next_low_features(tf.ref, im).to(embeds.dtype)
            out = model.generate(inputs_embeds=embeds, attention_mask=ids["attention_mask"], **kw)
            seq = out.sequences[0]
    logits = [lg[0].float() for lg in out.logits]
    for lg in logits:
        lg[never] = float("-inf")
    return seq.tolist(), logits, ids["input_ids"].shape[1]


@pytest.mark.parametrize("family", ["llava-next", "llava-onevision"])
def test_low_view_greedy_equals_transformers(families, photos, family) -> None:
    tf = families[family]
    engine = tf.make_engine()
    pil = _image(photos, (1024, 768))
    buf = io.BytesIO()
    pil.save(buf, "PNG")
    img = engine.processor.prepare_image(buf.getvalue())
    msgs = user(None, "What is in the picture?")
    req = engine.processor.make_request(
        messages=msgs, images=[img], params=greedy(MAX_NEW), details=["low"]
    )
    (res,) = engine.generate([req])
    ref_ids, ref_logits, ref_len = _reference_low(tf, engine, msgs, pil, req.spans[0].length)
    assert res.prompt_tokens == ref_len
    assert_same_generation(res.output_ids, ref_ids, res.logits, ref_logits, f"{family} low")


# ---- through the API: low never shares KV with high --------------------------------------


@pytest.fixture(scope="module", params=["llava-next", "llava-onevision"])
def api(request, families):
    engine = families[request.param].make_engine()
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        c.engine = engine
        yield c


def _image_id(api: TestClient, photos: dict[str, bytes]) -> tuple[str, dict]:
    buf = io.BytesIO()
    _image(photos, (1024, 768)).save(buf, "PNG")
    r = upload(api, buf.getvalue())
    assert r.status_code == 200, r.text
    return r.json()["id"], r.json()


def _part(url: str, detail: str | None) -> dict:
    image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image_url}


def test_upload_reports_tokens_per_detail(api, photos) -> None:
    _, info = _image_id(api, photos)
    by = info["num_image_tokens_by_detail"]
    assert set(by) == {"auto", "low", "high", "original"}
    assert by["auto"] == by["high"] == info["num_image_tokens"] > by["low"]
    loaded = api.engine.model
    assert by["low"] == loaded.image_tokens(1024, 768, BASE_MODE)


def test_low_and_high_never_share_image_kv(api, photos) -> None:
    """The image sits at the same position in every request, so a view sharing another's
    KV would show as cached tokens past that position."""
    image_id, info = _image_id(api, photos)
    by = info["num_image_tokens_by_detail"]
    text = {"type": "text", "text": "Describe it."}
    usage = {}
    for detail in ("high", "low", "low", None, "high", "low"):
        out = chat_json(api, [_part(image_id, detail), text], max_tokens=2)
        u = out["usage"]
        usage.setdefault(detail or "auto", []).append(u)
    prompt = {d: us[0]["prompt_tokens"] for d, us in usage.items()}
    assert prompt["high"] == prompt["auto"] == prompt["low"] - by["low"] + by["high"]
    img_start = (
        api.engine.processor.make_request(
            messages=user(None, "Describe it."),
            images=[api.engine.processor.prepare_image(_png(photos))],
        )
        .spans[0]
        .start
    )
    first_low = usage["low"][0]["prompt_tokens_details"]["cached_tokens"]
    assert first_low <= img_start  # the high view's KV is not the low view's
    for u in usage["low"][1:]:  # two lows share it
        assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] - 1
    for u in [*usage["high"][1:], *usage["auto"]]:  # high and auto are one view
        assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] - 1


def _png(photos: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    _image(photos, (1024, 768)).save(buf, "PNG")
    return buf.getvalue()


def test_responses_and_ask_take_detail(api, photos) -> None:
    image_id, info = _image_id(api, photos)
    by = info["num_image_tokens_by_detail"]
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=api, max_retries=0
    )
    prompts = {}
    for detail in ("low", "high"):
        part = {"type": "input_image", "image_url": image_id, "detail": detail}
        r = client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [part]}], max_output_tokens=2
        )
        prompts[detail] = r.usage.input_tokens
    assert prompts["high"] - prompts["low"] == by["high"] - by["low"]
    asked = {}
    for detail in ("low", "high"):
        r = api.post(
            f"/v1/images/{image_id}/ask",
            json={"questions": ["What?", "Where?"], "detail": detail, "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        asked[detail] = [a["usage"]["prompt_tokens"] for a in r.json()["answers"]]
    assert [h - lo for h, lo in zip(asked["high"], asked["low"], strict=True)] == [
        by["high"] - by["low"]
    ] * 2


@pytest.mark.parametrize(
    "body_part, param",
    [
        (
            {"image_url": {"url": "IMG", "detail": "medium"}},
            "messages[0].content[0].image_url.detail",
        ),
        ({"image_url": {"url": "IMG", "detail": "LOW"}}, "messages[0].content[0].image_url.detail"),
    ],
)
def test_an_unknown_detail_is_a_400_naming_it(api, photos, body_part, param) -> None:
    image_id, _ = _image_id(api, photos)
    part = {"type": "image_url", **body_part}
    part["image_url"]["url"] = image_id
    r = api.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "'low'" in err["message"]
    r = api.post(f"/v1/images/{image_id}/ask", json={"questions": ["x"], "detail": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "detail"
