"""LLaVA-OneVision only: base-tile and video token counts from transformers' processor,
several images as base tiles, videos as pooled frames equal to
``LlavaOnevisionForConditionalGeneration.generate``, the Qwen2 decoder (q/k/v biases, tied
embeddings, a padded vocabulary), and video frames keyed and cached one by one. Greedy
equality on text and images for every family is in tests/test_families.py."""

from __future__ import annotations

import io

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.model.families.base import BASE_MODE, FRAME_MODE, IMAGE_MODE
from mmserve.vision.frames import FramePrep, prepare_frames
from mmserve.vision.hashing import VIDEO_NEWLINE_ID
from tests.helpers import (
    CACHE_CONFIGS,
    MODEL,
    chat_json,
    check_against_reference,
    data_url,
    image_part,
    reference_generate,
    user,
)

MAX_NEW = 8


@pytest.fixture(scope="module")
def ov(families):
    """The tiny OneVision checkpoint (``TinyFamily``: model_dir, loaded, ref, make_engine)."""
    return families["llava-onevision"]


@pytest.fixture(scope="module")
def ov_loaded(ov):
    return ov.loaded


@pytest.fixture(scope="module")
def make_ov_engine(ov):
    return ov.make_engine


# --- the family and the decoder ---------------------------------------------------------


def test_base_tile_and_video_token_counts_equal_the_processors(ov) -> None:
    ov_loaded, (_, processor) = ov.loaded, ov.ref
    image_id = processor.image_token_id
    sizes = [(w, h) for w in (1, 30, 97, 98, 99, 200, 333, 640) for h in (1, 57, 98, 250, 481)]
    for w, h in sizes:
        # an image of a two-image prompt: the base tile and one newline, whatever its size
        two = [[Image.new("RGB", (w, h)), Image.new("RGB", (5, 7))]]
        ids = list(processor(images=two, text="<image>x<image>")["input_ids"][0])
        run = next(i for i in range(len(ids)) if ids[i] != image_id)
        assert ov_loaded.image_tokens(w, h, BASE_MODE) == run == ids.count(image_id) // 2
    tile = ov_loaded.config.vision_config.image_size
    for frames in (1, 8):
        want = processor._get_num_multimodal_tokens(video_sizes=[[frames, tile, tile]])
        per = ov_loaded.family.video_frame_tokens()
        assert frames * per + 1 == want["num_video_tokens"][0]


def test_video_tokens_are_counted_where_the_processor_counts_none(ov, monkeypatch) -> None:
    """transformers 5.17's processor answers no ``num_video_tokens`` (the GPU check's image
    failed to load OneVision on it): the family counts them by the processor's own rule."""
    from transformers.processing_utils import MultiModalData

    from mmserve.model.families.llava_onevision import video_token_counts

    loaded = ov.loaded
    cfg, proc = loaded.config, loaded.family.processor
    want = video_token_counts(cfg, proc)
    assert want[1] - want[0] == loaded.family.video_frame_tokens()
    monkeypatch.setattr(
        type(proc), "_get_num_multimodal_tokens", lambda self, **kw: MultiModalData()
    )
    assert video_token_counts(cfg, proc) == want
    assert type(loaded.family)(cfg, proc).video_frame_tokens() == want[1] - want[0]


def test_decoder_is_qwen2_shaped(ov_loaded) -> None:
    shape = ov_loaded.decoder.shape
    assert (shape.qkv_bias, shape.o_bias, shape.tie_word_embeddings) == (True, False, True)
    assert shape.rope_theta == 1e6
    attn = ov_loaded.decoder.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    # seeded non-zero (q, k and v rows alike), so dropping them would show
    assert (attn.qkv_proj.bias.view(-1, attn.d).abs().sum(-1) > 0).all()
    assert ov_loaded.decoder.lm_head.weight is ov_loaded.decoder.embed_tokens.weight
    tok = ov_loaded.tokenizer
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>"
    assert ov_loaded.eos_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert ov_loaded.image_token_id == ov_loaded.config.image_token_index
    assert ov_loaded.video_token_id == ov_loaded.config.video_token_index
    assert {ov_loaded.image_token_id, ov_loaded.video_token_id} <= set(ov_loaded.never_sample_ids)
    assert "<|im_start|>" in tok.all_special_tokens


def test_nothing_assumes_384_px(ov_loaded) -> None:
    vc = ov_loaded.config.vision_config
    assert (vc.image_size, vc.patch_size) == (98, 14)  # 7 x 7 patches, pooled to 4 x 4
    assert ov_loaded.family.video_frame_tokens() == 16


def test_two_images_take_base_tiles(make_ov_engine, shapes, photos) -> None:
    eng = make_ov_engine()
    imgs = [
        eng.processor.prepare_image(shapes["wide"]),
        eng.processor.prepare_image(photos["cat.png"]),
    ]
    req = eng.processor.make_request(messages=user(None, "and", None, "Hi"), images=imgs)
    assert [s.image.mode for s in req.spans] == [BASE_MODE, BASE_MODE]
    assert {s.image.key for s in req.spans}.isdisjoint({i.key for i in imgs})


# --- through the API --------------------------------------------------------------------


def test_an_image_alone_and_among_others_share_no_image_kv(make_ov_engine, shapes) -> None:
    eng = make_ov_engine()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        url, other = (image_part(data_url(shapes[k])) for k in ("square", "tall"))
        chat_json(c, [url, {"type": "text", "text": "Hi"}], max_tokens=MAX_NEW)
        b = chat_json(c, [url, other, {"type": "text", "text": "Hi"}], max_tokens=MAX_NEW)
        img = eng.processor.prepare_image(shapes["square"])
        prefix = eng.processor.make_request(messages=user(None), images=[img]).spans[0].start
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] <= prefix


def test_typed_video_placeholder_is_refused(make_ov_engine) -> None:
    eng = make_ov_engine()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a <video> here"}], "max_tokens": 2},
        )
        assert r.status_code == 400 and "<video>" in r.json()["error"]["message"]
        typed = chat_json(c, "<|im_start|>system", max_tokens=2)  # plain text
        assert typed["usage"]["completion_tokens"] == 2


def test_modes_have_distinct_keys(ov_loaded, shapes) -> None:
    from mmserve.vision.inputs import ImageInput

    fam = ov_loaded.family
    img = ImageInput(b"k" * 16, Image.open(io.BytesIO(shapes["wide"])))
    keys = {fam.mode_item(img, m).key for m in (IMAGE_MODE, BASE_MODE, FRAME_MODE)}
    assert len(keys) == 3 and img.key in keys
    assert VIDEO_NEWLINE_ID == -1


# --- video: pooled frames, each keyed and cached on its own ---------------------------


@pytest.fixture(scope="module")
def clip12() -> bytes:
    from tests.videos import encode_mp4, rgb_frames

    pytest.importorskip("av")
    return encode_mp4(rgb_frames(12, seed=11), fps=10)


def decoded_frames(eng, data: bytes, indices: list[int]) -> list:
    """The frames the server decodes, hashed as it hashes them."""
    from mmserve.vision.hashing import image_key
    from mmserve.vision.inputs import ImageInput
    from mmserve.vision.video import Video, VideoLimits

    return [
        ImageInput(image_key(im, eng.processor.fingerprint), im)
        for im in Video(data, VideoLimits()).frames(indices)
    ]


def test_frame_preparation_follows_the_processors(ov, photos) -> None:
    _, processor = ov.ref
    prep = FramePrep.from_processor(processor.video_settings)
    assert (prep.height, prep.width, prep.resample) == (98, 98, 3)
    assert prep.image_mean == prep.image_std == (0.5, 0.5, 0.5)
    square = Image.open(io.BytesIO(photos["cat.png"])).convert("RGB").resize((150, 150))
    ours = prepare_frames([square, square], prep)
    assert ours.shape == (2, 3, 98, 98) and ours.dtype == torch.float32
    # a square frame is what the PIL image processor makes of a square image in a
    # multi-image prompt (no padding needed): resize, rescale, normalise
    theirs = processor.image_processor(images=[[square, square]], return_tensors="pt")
    assert torch.allclose(ours[0], theirs["pixel_values"][0, 0], atol=1e-6)
    wide = Image.new("RGB", (64, 48), (255, 0, 0))  # resized, not padded: one colour
    px = prepare_frames([wide], prep)[0]
    assert torch.allclose(px[0], torch.ones(98, 98)) and torch.allclose(px[1], -torch.ones(98, 98))
    with pytest.raises(ValueError):
        prepare_frames([], prep)


def test_video_of_8_frames_equals_reference(make_ov_engine, ov, clip12) -> None:
    eng = make_ov_engine()
    frames = decoded_frames(eng, clip12, list(range(8)))
    msgs = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}
    ]
    req = eng.processor.make_request(messages=msgs, videos=[frames])
    per = eng.model.family.video_frame_tokens()
    assert [s.length for s in req.spans] == [per] * 8
    assert [s.image.mode for s in req.spans] == [FRAME_MODE] * 8
    assert req.input_ids[req.spans[-1].end] == VIDEO_NEWLINE_ID
    check_against_reference(eng, ov.ref, msgs, [], "8-frame video", videos=[frames])


def qa(c: TestClient, vid: str, **body) -> list[dict]:
    import json

    r = c.post(f"/v1/videos/{vid}/qa", json={"temperature": 0, "max_tokens": MAX_NEW, **body})
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line]


VIDEO_Q = "What happens in this clip?"


@pytest.fixture(scope="module")
def video_reference(make_ov_engine, ov, clip12) -> tuple[str, int]:
    """transformers' answer (text, prompt length) for 8 uniform frames of ``clip12``."""
    from mmserve.vision.video import FrameSelection, Video, VideoLimits

    eng = make_ov_engine()
    indices = Video(clip12, VideoLimits()).indices(FrameSelection(num_frames=8))
    frames = [f.image for f in decoded_frames(eng, clip12, indices)]
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": VIDEO_Q}]}]
    text = eng.processor.prompts.render_chat(msgs)
    ids, _, n = reference_generate(
        ov.ref, text, [], eng.model.never_sample_ids, MAX_NEW, videos=[frames]
    )
    return eng.model.tokenizer.decode(ids, skip_special_tokens=True), n


@pytest.mark.parametrize("cfg", CACHE_CONFIGS)
def test_api_video_clip_and_video_url_equal_reference_cache_on_and_off(
    make_ov_engine, video_reference, clip12, cfg
) -> None:
    want, ref_len = video_reference
    eng = make_ov_engine(**cfg)
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        vid = c.post("/v1/videos", files={"file": ("v.mp4", clip12)}).json()["id"]
        for _ in range(2):  # the second one hits the cache (when on)
            events = qa(c, vid, questions=[VIDEO_Q], mode="clip", num_frames=8)
            (answer,) = [e for e in events if e["type"] == "answer"]
            assert (answer["text"], answer["prompt_tokens"]) == (want, ref_len)
            url = {"url": vid, "num_frames": 8}
            parts = [{"type": "video_url", "video_url": url}, {"type": "text", "text": VIDEO_Q}]
            out = chat_json(c, parts, max_tokens=MAX_NEW)
            assert out["choices"][0]["message"]["content"] == want
            assert out["usage"]["prompt_tokens"] == ref_len
            b64 = data_url(clip12, "video/mp4")
            parts[0] = {"type": "video_url", "video_url": {"url": b64, "num_frames": 8}}
            out = chat_json(c, parts, max_tokens=MAX_NEW)
            assert out["choices"][0]["message"]["content"] == want


def test_overlapping_clips_share_their_first_frames(make_ov_engine, clip12) -> None:
    eng = make_ov_engine(page_size=16)
    per = eng.model.family.video_frame_tokens()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        vid = c.post("/v1/videos", files={"file": ("v.mp4", clip12)}).json()["id"]
        first = [round(0.1 * i, 2) for i in range(8)]
        second = [round(0.1 * i, 2) for i in (0, 1, 2, 3, 8, 9, 10, 11)]
        a = qa(c, vid, questions=[VIDEO_Q], mode="clip", timestamps=first, max_tokens=2)
        b = qa(c, vid, questions=[VIDEO_Q], mode="clip", timestamps=second, max_tokens=2)
        assert [f["frame_index"] for f in b[0]["frames"]] == [0, 1, 2, 3, 8, 9, 10, 11]
        assert a[-1]["vision_tower_runs"] == 8 and b[-1]["vision_tower_runs"] == 4
        frames = decoded_frames(eng, clip12, [0, 1, 2, 3, 8, 9, 10, 11])
        msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": VIDEO_Q}]}]
        start = eng.processor.make_request(messages=msgs, videos=[frames]).spans[0].start
        (answer,) = [e for e in b if e["type"] == "answer"]
        assert answer["cached_tokens"] == (start + 4 * per) // 16 * 16 > 3 * per


def test_static_video_runs_the_tower_once(make_ov_engine) -> None:
    from tests.videos import encode_mp4, rgb_frames

    pytest.importorskip("av")
    eng = make_ov_engine()
    static = encode_mp4([rgb_frames(1, seed=5)[0]] * 12)
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        vid = c.post("/v1/videos", files={"file": ("s.mp4", static)}).json()["id"]
        events = qa(c, vid, questions=[VIDEO_Q], mode="clip", num_frames=12, max_tokens=2)
        assert events[-1]["distinct_frames"] == 1 and events[-1]["vision_tower_runs"] == 1
        (answer,) = [e for e in events if e["type"] == "answer"]
        assert answer["prompt_tokens"] > 12 * eng.model.family.video_frame_tokens()


def test_per_frame_mode_stays_one_image_per_prompt(make_ov_engine, clip12) -> None:
    eng = make_ov_engine()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        vid = c.post("/v1/videos", files={"file": ("v.mp4", clip12)}).json()["id"]
        events = qa(c, vid, questions=["What is here?"], num_frames=3, max_tokens=2)
        answers = [e for e in events if e["type"] == "answer"]
        assert len(answers) == 3 and events[-1]["vision_tower_runs"] == 3
        frame = decoded_frames(eng, clip12, [events[0]["frames"][0]["frame_index"]])[0]
        want = eng.processor.make_request(messages=user(None, "What is here?"), images=[frame])
        assert {a["prompt_tokens"] for a in answers if a["frame"] == 0} == {want.prompt_len}
        assert want.spans[0].image.mode == IMAGE_MODE  # the image path: its grid


def test_loader_reads_a_onevision_dir_without_torchvision(ov, tmp_path) -> None:
    import json
    import shutil

    from mmserve.model.loader import CheckpointError, load_processor

    pytest.importorskip("PIL")
    try:
        import torchvision  # noqa: F401

        has_torchvision = True
    except ImportError:
        has_torchvision = False
    if not has_torchvision:  # the reason for the family's own processor loading
        from transformers import AutoProcessor

        with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises
            AutoProcessor.from_pretrained(ov.model_dir)
    proc = load_processor(ov.model_dir)
    assert proc.num_image_tokens == 49 and proc.vision_aspect_ratio == "anyres_max_9"
    # a legacy layout: no video config anywhere -> the video processor reads the
    # image processor's file, as transformers does
    legacy = tmp_path / "legacy"
    shutil.copytree(ov.model_dir, legacy)
    (legacy / "video_preprocessor_config.json").unlink()
    cfg = json.loads((legacy / "processor_config.json").read_text())
    del cfg["video_processor"]
    (legacy / "processor_config.json").write_text(json.dumps(cfg))
    assert load_processor(legacy).video_settings.size["height"] == 98
    (legacy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_processor(legacy)


def test_padded_vocabulary_loads_and_equals_reference(ov, tmp_path) -> None:
    """Qwen2 checkpoints pad the embedding matrix past the tokenizer (151,646 tokens in
    152,000 rows): such a directory loads and still equals transformers."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import LlavaOnevisionForConditionalGeneration

    from mmserve.config import EngineConfig
    from mmserve.frontend.frontend import Engine
    from mmserve.model.loader import load_model

    padded = tmp_path / "padded"
    shutil.copytree(ov.model_dir, padded)
    weights = load_file(str(padded / "model.safetensors"))
    key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    rows = weights[key]
    weights[key] = torch.cat([rows, torch.randn(48, rows.shape[1]) * 0.1])
    save_file(weights, str(padded / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((padded / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = rows.shape[0] + 48
    (padded / "config.json").write_text(json.dumps(cfg))
    model = load_model(padded)
    assert model.decoder.shape.vocab_size == len(model.tokenizer) + 48
    eng = Engine(EngineConfig(model_path=str(padded)), model=model)
    ref = (
        LlavaOnevisionForConditionalGeneration.from_pretrained(padded).eval(),
        eng.model.processor,
    )
    msgs = [{"role": "user", "content": "Say something."}]
    check_against_reference(eng, ref, msgs, [], "padded vocab")
