"""OneVision-architecture checkpoints with other settings (``make-model --variant
llava-video``: LLaVA-Video-7B-Qwen2's ``anyres_max_4``, a 3 x 3 grid, its pooling and
frame settings) load and equal transformers' greedy tokens on images and video; every
setting the family does not implement is refused at load, naming its file and field."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model.loader import load_model
from mmserve.model.weights import CheckpointError
from mmserve.testing import make_checkpoint
from mmserve.vision.hashing import image_key
from mmserve.vision.inputs import ImageInput
from tests.helpers import check_against_reference, user
from tests.videos import rgb_frames


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lv") / "llava-video"
    return make_checkpoint(out, "tiny", variant="llava-video")


@pytest.fixture(scope="module")
def variant(variant_dir: Path):
    """(our engine, transformers' model and processor) on the variant."""
    from transformers import LlavaOnevisionForConditionalGeneration

    from mmserve.model.families.llava_onevision import load_onevision_processor

    engine = Engine(EngineConfig(model_path=str(variant_dir), dtype="float32"))
    ref = LlavaOnevisionForConditionalGeneration.from_pretrained(variant_dir).eval()
    return engine, (ref, load_onevision_processor(variant_dir))


def _png(photos: dict[str, bytes], size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(photos["astronaut.png"])).convert("RGB").resize(size).save(buf, "PNG")
    return buf.getvalue()


def test_variant_carries_llava_video_settings(variant_dir: Path, variant, families) -> None:
    cfg = json.loads((variant_dir / "config.json").read_text())
    assert cfg["vision_aspect_ratio"] == "anyres_max_4" and len(cfg["image_grid_pinpoints"]) == 9
    video = json.loads((variant_dir / "video_preprocessor_config.json").read_text())
    assert video["num_frames"] == 64 and video["spatial_pool_stride"] == 2
    engine, _ = variant
    base = families["llava-onevision"].loaded
    # the settings are read: a large image gets fewer tokens than on the base checkpoint
    assert engine.model.image_tokens(1024, 768) < base.image_tokens(1024, 768)


@pytest.mark.parametrize("size", [(1024, 768), (300, 200)])
def test_variant_image_equals_transformers(variant, photos, size) -> None:
    engine, ref = variant
    img = engine.processor.prepare_image(_png(photos, size))
    check_against_reference(engine, ref, user(None, "What is it?"), [img], f"variant {size}")


def test_variant_two_images_equal_transformers(variant, photos) -> None:
    engine, ref = variant
    imgs = [engine.processor.prepare_image(_png(photos, s)) for s in ((640, 480), (200, 300))]
    check_against_reference(engine, ref, user(None, None, "Compare."), imgs, "variant two images")


def test_variant_video_equals_transformers(variant) -> None:
    engine, ref = variant
    frames = [Image.fromarray(f) for f in rgb_frames(4, seed=3)]
    inputs = [ImageInput(image_key(im, engine.processor.fingerprint), im) for im in frames]
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]}]
    check_against_reference(engine, ref, msgs, [], "variant video", videos=[inputs])


#: (file, key path, value) each a setting the family does not implement
REFUSED = [
    ("config.json", ["mm_spatial_pool_stride"], 4),
    ("config.json", ["mm_spatial_pool_mode"], "average"),
    ("config.json", ["mm_newline_position"], "grid"),
    ("config.json", ["add_faster_video"], True),
    ("config.json", ["use_image_newline_parameter"], False),
    ("config.json", ["vision_aspect_ratio"], "anyres"),
    ("config.json", ["image_grid_pinpoints"], [[98, 98], [100, 196]]),
    ("processor_config.json", ["vision_aspect_ratio"], "anyres_max_9"),
    ("processor_config.json", ["num_image_tokens"], 50),
    ("processor_config.json", ["frames_upbound"], 64),
    ("preprocessor_config.json", ["image_grid_pinpoints"], [[98, 98]]),
    ("preprocessor_config.json", ["do_center_crop"], True),
    ("preprocessor_config.json", ["size"], {"height": 112, "width": 112}),
    ("video_preprocessor_config.json", ["do_sample_frames"], True),
    ("video_preprocessor_config.json", ["spatial_pool_stride"], 3),
    ("video_preprocessor_config.json", ["spatial_pool_mode"], "max"),
    ("video_preprocessor_config.json", ["frame_pooling"], "avg"),
    ("video_preprocessor_config.json", ["do_center_crop"], True),
]


@pytest.mark.parametrize(("file", "path", "value"), REFUSED, ids=lambda v: str(v))
def test_unimplemented_settings_are_refused_naming_them(
    variant_dir: Path, tmp_path: Path, monkeypatch, file, path, value
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(variant_dir, bad)
    data = json.loads((bad / file).read_text())
    data[path[-1]] = value
    (bad / file).write_text(json.dumps(data))

    def no_weights(*_a, **_k):  # refused before any weight is read
        raise AssertionError("weights read")

    monkeypatch.setattr("mmserve.model.loader.read_weights", no_weights)
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    msg = str(e.value)
    assert file in msg and path[-1] in msg and "llava-onevision" in msg, msg
    assert "\n" not in msg


def test_nested_processor_settings_are_checked_too(variant_dir: Path, tmp_path: Path) -> None:
    """Without the standalone files, the processors nested in processor_config.json."""
    bad = tmp_path / "nested"
    shutil.copytree(variant_dir, bad)
    (bad / "video_preprocessor_config.json").unlink()
    data = json.loads((bad / "processor_config.json").read_text())
    data["video_processor"]["do_sample_frames"] = True
    (bad / "processor_config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="processor_config.json video_processor"):
        load_model(bad)
