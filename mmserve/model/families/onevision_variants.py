"""Checkpoints of the OneVision architecture that differ from llava-onevision-qwen2
(LLaVA-Video-7B-Qwen2 converted to transformers' ``llava_onevision`` layout, ...): which
of their settings the family implements, and the refusal of every other one.

What varies between them, and what the family does with it:

- ``vision_aspect_ratio`` (``anyres_max_N``, in ``config.json`` and
  ``processor_config.json``): implemented (transformers' packing and counts read N); the
  two files must agree.
- ``image_grid_pinpoints`` (``config.json`` and the image processor's config):
  implemented (any grid of whole tiles); the two must agree, or the tiles the processor
  cuts would not be the grid the packing assumes.
- the image processor's and video processor's resize, rescale, normalisation and RGB
  settings: implemented (transformers' image processor; :class:`~mmserve.vision.frames.FramePrep`).
- frame pooling: the family pools each frame's features bilinearly to half the side
  (transformers' ``apply_pooling``) and puts one newline after a video; a checkpoint that
  names another pooling (``spatial_pool_stride`` / ``mm_spatial_pool_stride`` other than 2,
  a mode other than "bilinear", ``mm_newline_position`` other than "one_token",
  ``add_faster_video``) is refused.
- frame sampling: frames come from the request (``num_frames``, ``fps``,
  ``timestamps``); ``do_sample_frames: true`` (the processor sampling by itself) is
  refused; ``num_frames`` / ``fps`` are read by transformers only with it, so they are
  accepted and unused, as there.

Processor files hold a known set of keys; any other key is refused with its file and
name, never ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

#: Pooling and newline settings and the one value each the family implements (the
#: original LLaVA names and LLaVA-NeXT-Video's), accepted in any of the checkpoint's files.
POOLING = {
    "spatial_pool_stride": 2,
    "mm_spatial_pool_stride": 2,
    "spatial_pool_mode": "bilinear",
    "mm_spatial_pool_mode": "bilinear",
    "mm_newline_position": "one_token",
    "add_faster_video": False,
}
#: Keys that name a class or describe the file, with no effect on the pixels.
_META = {
    "processor_class", "image_processor_type", "video_processor_type", "auto_map",
    "_processor_class", "feature_extractor_type",
}  # fmt: skip
#: ``processor_config.json``'s keys (the nested processors are checked on their own).
PROCESSOR_KEYS = {
    "image_token", "video_token", "num_image_tokens", "vision_aspect_ratio",
    "vision_feature_select_strategy", "chat_template", "image_processor", "video_processor",
    *_META,
}  # fmt: skip
#: The image processor's keys the family runs (transformers' image processor).
IMAGE_KEYS = {
    "do_resize", "size", "resample", "do_rescale", "rescale_factor", "do_normalize",
    "image_mean", "image_std", "do_pad", "do_convert_rgb", "image_grid_pinpoints",
    "data_format", "input_data_format", "default_to_square", *_META,
}  # fmt: skip
#: The video processor's keys :class:`~mmserve.vision.frames.FramePrep` runs, those with
#: no effect here (output format, device, metadata), and those transformers reads only
#: with ``do_sample_frames`` (checked to be off).
VIDEO_KEYS = {
    "do_resize", "size", "resample", "do_rescale", "rescale_factor", "do_normalize",
    "image_mean", "image_std", "do_convert_rgb", "do_sample_frames", "num_frames", "fps",
    "max_frames", "return_metadata", "video_metadata", "data_format", "input_data_format",
    "device", "default_to_square", "do_center_crop", "crop_size", "do_pad", "pad_size",
    "size_divisor", "return_tensors", *_META,
}  # fmt: skip
#: Video processor settings that must be off (falsy) here: the family does not run them.
_VIDEO_OFF = ("do_sample_frames", "do_center_crop", "do_pad", "pad_size", "size_divisor")
#: Original-LLaVA keys in a config that must agree with the transformers field the family
#: reads: key -> that field.
_SAME_AS = {
    "image_aspect_ratio": "vision_aspect_ratio",
    "mm_vision_select_layer": "vision_feature_layer",
}


class VariantError(ValueError):
    """A OneVision checkpoint setting the family does not implement; the message names
    the file and the field."""


def _read(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def _refuse(file: str, key: str, value: object, why: str) -> VariantError:
    return VariantError(f"{file}: {key} = {value!r} is not supported by the llava-onevision "
                        f"family ({why})")  # fmt: skip


def _check_pooling(file: str, data: dict[str, Any]) -> None:
    for key, want in POOLING.items():
        if key in data and data[key] != want:
            raise _refuse(file, key, data[key], f"it implements {want!r} only")


def _check_keys(file: str, data: dict[str, Any], known: set[str]) -> None:
    for key in data:
        if key not in known and key not in POOLING:
            raise _refuse(file, key, data[key], "a setting it does not implement")
    _check_pooling(file, data)


def _pinpoints(value: object) -> list[list[int]]:
    return [list(map(int, p)) for p in value] if isinstance(value, list) else []


def check_onevision_checkpoint(model_dir: Path) -> None:
    """Refuse a OneVision checkpoint setting the family would otherwise ignore.

    Reads ``config.json``, ``processor_config.json`` (and its nested processors),
    ``preprocessor_config.json`` and ``video_preprocessor_config.json`` as stored.

    Raises:
        VariantError: naming the file and the field: an unknown processor setting, a
            pooling or newline scheme other than the family's, ``do_sample_frames`` or
            another video step it does not run, ``vision_aspect_ratio`` not
            ``anyres_max_N`` or different in config and processor, grids that differ
            between config and image processor or are not whole tiles, a tile size other
            than the tower's, ``num_image_tokens`` other than the tower's patches.
    """
    cfg = _read(model_dir / "config.json") or {}
    vision = cfg.get("vision_config") or {}
    tile, patch = vision.get("image_size", 384), vision.get("patch_size", 14)
    _check_pooling("config.json", cfg)
    newline = cfg.get("use_image_newline_parameter", True)
    if newline is not True:
        why = "it always uses image_newline"
        raise _refuse("config.json", "use_image_newline_parameter", newline, why)
    aspect = cfg.get("vision_aspect_ratio", "anyres_max_9")
    if not isinstance(aspect, str) or not re.fullmatch(r"anyres_max_[1-9]\d*", aspect):
        raise _refuse("config.json", "vision_aspect_ratio", aspect, "only anyres_max_N")
    for key, field in _SAME_AS.items():
        if key in cfg and cfg[key] != cfg.get(field):
            raise _refuse("config.json", key, cfg[key], f"it follows {field} = {cfg.get(field)!r}")
    grid = _pinpoints(cfg.get("image_grid_pinpoints"))
    for h, w in grid:
        if h % tile or w % tile or h <= 0 or w <= 0:
            raise _refuse("config.json", "image_grid_pinpoints", [h, w],
                          f"a grid of whole {tile}-pixel tiles")  # fmt: skip
    proc = _read(model_dir / "processor_config.json")
    image = _read(model_dir / "preprocessor_config.json")
    video = _read(model_dir / "video_preprocessor_config.json")
    image_file, video_file = "preprocessor_config.json", "video_preprocessor_config.json"
    if proc is not None:
        _check_keys("processor_config.json", proc, PROCESSOR_KEYS)
        for key, want in (("vision_aspect_ratio", aspect),
                          ("vision_feature_select_strategy",
                           cfg.get("vision_feature_select_strategy")),
                          ("num_image_tokens", (tile // patch) ** 2)):  # fmt: skip
            if key in proc and proc[key] != want:
                raise _refuse("processor_config.json", key, proc[key],
                              f"config.json and the tower give {want!r}")  # fmt: skip
        if image is None and isinstance(proc.get("image_processor"), dict):
            image, image_file = proc["image_processor"], "processor_config.json image_processor"
        if video is None and isinstance(proc.get("video_processor"), dict):
            video, video_file = proc["video_processor"], "processor_config.json video_processor"
    if image is not None:
        where = image_file
        _check_keys(where, image, IMAGE_KEYS)
        if "image_grid_pinpoints" in image and _pinpoints(image["image_grid_pinpoints"]) != grid:
            raise _refuse(where, "image_grid_pinpoints", image["image_grid_pinpoints"],
                          "it must equal config.json's image_grid_pinpoints")  # fmt: skip
        _check_size(where, image.get("size"), tile)
    if video is not None:
        where = video_file
        _check_keys(where, video, VIDEO_KEYS)
        for key in _VIDEO_OFF:
            if video.get(key):
                raise _refuse(where, key, video[key], "frames come from the request; "
                              "it does not sample, crop or pad them")  # fmt: skip
        _check_size(where, video.get("size"), tile)


def _check_size(where: str, size: object, tile: int) -> None:
    if not isinstance(size, dict):
        return
    sides = {size.get("height"), size.get("width")} - {None}
    if "shortest_edge" in size:
        sides.add(size["shortest_edge"])
    if sides and sides != {tile}:
        raise _refuse(where, "size", size, f"the vision tower takes {tile}x{tile}")


# ---- seeded test checkpoints ----------------------------------------------------------------


def llava_video_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A OneVision test description (:meth:`LlavaOnevisionFamily.test_config`) turned into
    a LLaVA-Video-7B-Qwen2-style variant: ``anyres_max_4`` instead of 9 (config and
    processor), a smaller grid of up to 3 x 3 tiles (config and image processor), the
    original LLaVA pooling settings at the values the family implements (bilinear, stride
    2, one newline per video) in ``config.json`` and the video processor's config, and a
    64-frame ``num_frames`` with ``do_sample_frames`` off (what transformers reads too).
    A new dict; ``spec`` is not changed."""
    import copy

    spec = copy.deepcopy(spec)
    cfg = spec["config"]
    tile = cfg["vision_config"]["image_size"]
    grid = [[i * tile, j * tile] for i in range(1, 4) for j in range(1, 4)]
    pooling = {"mm_spatial_pool_mode": "bilinear", "mm_spatial_pool_stride": 2}
    cfg.update(vision_aspect_ratio="anyres_max_4", image_grid_pinpoints=grid,
               mm_newline_position="one_token", **pooling)  # fmt: skip
    spec["processor"]["vision_aspect_ratio"] = "anyres_max_4"
    spec["image_processor"]["image_grid_pinpoints"] = grid
    spec["video_processor"].update(num_frames=64, do_sample_frames=False)
    spec["video_extra"] = {"spatial_pool_mode": "bilinear", "spatial_pool_stride": 2}
    return spec


#: ``make-model --variant``: name -> (family, description transform).
TEST_VARIANTS = {"llava-video": ("llava-onevision", llava_video_spec)}
