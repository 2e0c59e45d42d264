"""LLaVA-NeXT-Video only: greedy tokens equal ``LlavaNextVideoForConditionalGeneration``'s
(fp32, tiny checkpoint) for images, a video and both in one prompt; the per-frame token
count (pooled, no video newline); frames keyed and cached one by one; the API's video
paths; the load-time refusals of a video path whose prompt would not fit its features."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from api.app import ServerSettings, create_app
from mmserve.model.families.base import BASE_MODE, FRAME_MODE, IMAGE_MODE
from mmserve.model.loader import load_model
from mmserve.model.weights import CheckpointError
from mmserve.vision.hashing import VIDEO_NEWLINE_ID
from mmserve.vision.inputs import media_tokens
from tests.helpers import (
    MODEL,
    chat_json,
    check_against_reference,
    data_url,
    image_part,
    reference_generate,
    user,
    video_qa,
)

MAX_NEW = 8
VIDEO_Q = "What happens in this clip?"


@pytest.fixture(scope="module")
def nv(families):
    """The tiny LLaVA-NeXT-Video checkpoint (``TinyFamily``)."""
    return families["llava-next-video"]


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


def video_msgs(images: int = 0, text: str = VIDEO_Q) -> list[dict]:
    parts = [{"type": "image"}] * images + [{"type": "video"}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


# ---- token counts ---------------------------------------------------------------------


def test_frame_tokens_are_the_pooled_grid_and_the_processors(nv) -> None:
    loaded, (_, processor) = nv.loaded, nv.ref
    cfg = loaded.config
    side = cfg.vision_config.image_size // cfg.vision_config.patch_size
    assert (side, cfg.spatial_pool_stride) == (8, 2)
    assert loaded.family.video_frame_tokens() == (side // 2) ** 2 == 16
    assert loaded.family.video_newline is False
    assert loaded.video_token_id == cfg.video_token_index == processor.video_token_id
    assert {loaded.image_token_id, loaded.video_token_id} <= set(loaded.never_sample_ids)
    for frames in (1, 3, 8):
        video = torch.zeros(1, frames, 3, 112, 112)
        text = processor.replace_video_token({"pixel_values_videos": video}, 0)
        assert text.count("<video>") == frames * 16
    # images: LLaVA-NeXT's count, asked of the processor
    for w, h in ((200, 190), (260, 130), (90, 270), (1, 1)):
        want = processor._get_num_multimodal_tokens(image_sizes=[[h, w]])["num_image_tokens"][0]
        assert loaded.family.num_image_tokens(w, h) == want
    assert loaded.family.mode_tokens(300, 40, BASE_MODE) == 8 * 8 + 1


def test_real_shapes_pool_24x24_to_144_per_frame() -> None:
    from mmserve.testing.checkpoints import checkpoint_spec

    spec = checkpoint_spec("llava-next-video-7b", "llava-next-video")
    cfg = spec["config"]
    assert cfg["vision_config"]["image_size"] // cfg["vision_config"]["patch_size"] == 24
    assert (cfg["spatial_pool_mode"], cfg["spatial_pool_stride"]) == ("average", 2)
    assert (24 // 2) ** 2 == 144
    assert (cfg["video_token_index"], cfg["image_token_index"]) == (32000, 32001)
    assert spec["video_processor"]["crop_size"] == {"height": 336, "width": 336}


def test_a_video_is_its_frames_and_no_newline(nv, clip12) -> None:
    eng = nv.make_engine()
    frames = decoded_frames(eng, clip12, [0, 1, 2])
    req = eng.processor.make_request(messages=video_msgs(), videos=[frames])
    assert [s.length for s in req.spans] == [16] * 3
    assert [s.image.mode for s in req.spans] == [FRAME_MODE] * 3
    assert VIDEO_NEWLINE_ID not in req.input_ids
    assert req.spans[1].start == req.spans[0].end  # frames back to back
    assert media_tokens(req.input_ids, req.spans) == (0, 48)
    # the budget rule: frames x per-frame tokens, nothing per video
    cost = eng.processor.frame_cost(64, 48)
    assert (cost.per_frame, cost.per_video, cost.tokens(5)) == (16, 0, 80)


def test_a_picture_as_image_low_view_and_frame_has_three_keys(nv, shapes) -> None:
    import io

    from mmserve.vision.inputs import ImageInput

    fam = nv.loaded.family
    img = ImageInput(b"k" * 16, Image.open(io.BytesIO(shapes["wide"])))
    items = {m: fam.mode_item(img, m) for m in (IMAGE_MODE, BASE_MODE, FRAME_MODE)}
    assert len({it.key for it in items.values()}) == 3 and items[IMAGE_MODE].key == img.key
    assert fam.detail_mode("low", 1) == BASE_MODE and fam.detail_mode("high", 2) == IMAGE_MODE
    # a frame's pixels: one tile, whatever the picture's size (resize + centre crop)
    (px,) = fam.preprocess([items[FRAME_MODE].image], FRAME_MODE)
    assert px.values.shape == (1, 3, 112, 112) and px.mode == FRAME_MODE


# ---- greedy equality with transformers (fp32) -----------------------------------------


def test_image_equals_reference(nv, shapes) -> None:
    eng = nv.make_engine()
    img = eng.processor.prepare_image(shapes["wide"])
    req = eng.processor.make_request(messages=user(None, "x"), images=[img])
    assert req.spans[0].image.mode == IMAGE_MODE
    check_against_reference(eng, nv.ref, user(None, "What is in this photo?"), [img], "image")


def test_two_images_equal_reference(nv, shapes, photos) -> None:
    eng = nv.make_engine()
    imgs = [eng.processor.prepare_image(d) for d in (shapes["tall"], photos["cat.png"])]
    check_against_reference(eng, nv.ref, user(None, "and", None, "Which?"), imgs, "two images")


def test_video_equals_reference(nv, clip12) -> None:
    eng = nv.make_engine()
    frames = decoded_frames(eng, clip12, list(range(0, 12, 2)))
    check_against_reference(eng, nv.ref, video_msgs(), [], "6-frame video", videos=[frames])


def test_image_and_video_in_one_prompt_equal_reference(nv, shapes, clip12) -> None:
    eng = nv.make_engine()
    img = eng.processor.prepare_image(shapes["square"])
    frames = decoded_frames(eng, clip12, [1, 4, 7, 10])
    msgs = video_msgs(images=1, text="Is the picture in the clip?")
    req = eng.processor.make_request(messages=msgs, images=[img], videos=[frames])
    assert [s.modality for s in req.spans] == ["image"] + ["video"] * 4
    check_against_reference(eng, nv.ref, msgs, [img], "image + video", videos=[frames])


# ---- frames keyed and cached one by one -----------------------------------------------


def test_repeated_frames_run_the_tower_once_and_a_second_question_is_cached(nv) -> None:
    from tests.videos import encode_mp4, rgb_frames

    pytest.importorskip("av")
    eng = nv.make_engine(page_size=16)
    static = encode_mp4([rgb_frames(1, seed=5)[0]] * 12)
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        vid = c.post("/v1/videos", files={"file": ("s.mp4", static)}).json()["id"]
        first = video_qa(c, vid, questions=[VIDEO_Q], mode="clip", num_frames=12, max_tokens=2)
        assert first[-1]["distinct_frames"] == 1 and first[-1]["vision_tower_runs"] == 1
        (answer,) = [e for e in first if e["type"] == "answer"]
        prompt = answer["prompt_tokens"]
        assert prompt > 12 * 16
        again = video_qa(c, vid, questions=["Anything else?"], mode="clip", num_frames=12,
                         max_tokens=2)  # fmt: skip
        assert again[-1]["vision_tower_runs"] == 0
        (second,) = [e for e in again if e["type"] == "answer"]
        # cached: whole pages of the prefix up to the question (template start, 12 frames)
        indices = [f["frame_index"] for f in again[0]["frames"]]
        frames = decoded_frames(eng, static, indices)
        end = eng.processor.make_request(messages=video_msgs(), videos=[frames]).spans[-1].end
        assert second["cached_tokens"] >= end // 16 * 16 >= 12 * 16
        assert answer["cached_tokens"] == 0


# ---- the API ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def video_reference(nv, clip12) -> tuple[str, int]:
    """transformers' answer (text, prompt length) for 8 uniform frames of ``clip12``."""
    from mmserve.vision.video import FrameSelection, Video, VideoLimits

    eng = nv.make_engine()
    indices = Video(clip12, VideoLimits()).indices(FrameSelection(num_frames=8))
    frames = [f.image for f in decoded_frames(eng, clip12, indices)]
    text = eng.processor.prompts.render_chat(video_msgs())
    ids, _, n = reference_generate(
        nv.ref, text, [], eng.model.never_sample_ids, MAX_NEW, videos=[frames]
    )
    return eng.model.tokenizer.decode(ids, skip_special_tokens=True), n


def test_api_chat_video_part_and_video_qa_equal_reference(nv, video_reference, clip12) -> None:
    want, ref_len = video_reference
    eng = nv.make_engine()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        vid = c.post("/v1/videos", files={"file": ("v.mp4", clip12)}).json()["id"]
        events = video_qa(c, vid, questions=[VIDEO_Q], mode="clip", num_frames=8,
                          max_tokens=MAX_NEW)  # fmt: skip
        (answer,) = [e for e in events if e["type"] == "answer"]
        assert (answer["text"], answer["prompt_tokens"]) == (want, ref_len)
        b64 = data_url(clip12, "video/mp4")
        parts = [{"type": "video_url", "video_url": {"url": b64, "num_frames": 8}},
                 {"type": "text", "text": VIDEO_Q}]  # fmt: skip
        out = chat_json(c, parts, max_tokens=MAX_NEW)
        assert out["choices"][0]["message"]["content"] == want
        assert out["usage"]["prompt_tokens"] == ref_len


def test_api_image_and_video_in_one_request(nv, shapes, clip12) -> None:
    eng = nv.make_engine()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        vid = c.post("/v1/videos", files={"file": ("v.mp4", clip12)}).json()["id"]
        parts = [image_part(data_url(shapes["wide"])),
                 {"type": "video_url", "video_url": {"url": vid, "num_frames": 3}},
                 {"type": "text", "text": "Compare."}]  # fmt: skip
        out = chat_json(c, parts, max_tokens=2)
        image = eng.model.family.num_image_tokens(260, 130)
        assert out["usage"]["prompt_tokens"] > image + 3 * 16
        assert out["usage"]["prompt_tokens_details"]["video_tokens"] == 3 * 16


def test_typed_video_placeholder_is_refused(nv) -> None:
    eng = nv.make_engine()
    with TestClient(create_app(eng, ServerSettings(served_model_name=MODEL))) as c:
        body = {"messages": [{"role": "user", "content": "a <video> here"}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "<video>" in r.json()["error"]["message"]


def test_a_video_with_no_frames_is_refused(nv) -> None:
    from mmserve.frontend.processor import RequestError

    eng = nv.make_engine()
    with pytest.raises(RequestError, match="a video has no frames"):
        eng.processor.make_request(messages=video_msgs(), videos=[[]])


# ---- load-time refusals -----------------------------------------------------------------


def _variant(nv, tmp_path, config: dict | None = None, video: dict | None = None):
    import shutil

    out = tmp_path / "variant"
    shutil.copytree(nv.model_dir, out)
    for name, change in (("config.json", config), ("video_preprocessor_config.json", video)):
        if change:
            data = json.loads((out / name).read_text())
            data.update(change)
            (out / name).write_text(json.dumps(data))
    if video:  # transformers reads the processor's nested copy first
        data = json.loads((out / "processor_config.json").read_text())
        data["video_processor"].update(video)
        (out / "processor_config.json").write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"spatial_pool_stride": 4}, "spatial_pool_stride 4 pools a frame to 4 tokens"),
        ({"spatial_pool_mode": "median"}, "unknown spatial_pool_mode 'median'"),
        ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy 'full'"),
    ],
)
def test_video_settings_the_prompt_cannot_fit_are_refused_by_name(
    nv, tmp_path, change: dict, words: str
) -> None:
    with pytest.raises(CheckpointError, match=words) as e:
        load_model(_variant(nv, tmp_path, config=change))
    assert str(e.value).startswith(str(tmp_path / "variant"))


def test_frames_not_of_the_towers_size_are_refused(nv, tmp_path) -> None:
    video = {"crop_size": {"height": 98, "width": 98}}
    with pytest.raises(CheckpointError, match="crop_size"):
        load_model(_variant(nv, tmp_path, video=video))


def test_frame_pixels_are_resized_and_centre_cropped(nv) -> None:
    _, processor = nv.ref
    wide = Image.new("RGB", (300, 100), (255, 0, 0))
    px = processor.frame_pixels([wide])
    assert px.shape == (1, 3, 112, 112) and px.dtype == torch.float32
    # the CLIP image processor's steps: shortest edge to 112, centre crop, normalise
    assert torch.allclose(px[0, 0], torch.full((112, 112), (1 - 0.48145466) / 0.26862954))
