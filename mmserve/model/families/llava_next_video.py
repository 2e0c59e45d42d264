"""LLaVA-NeXT-Video (``model_type`` "llava_next_video"): LLaVA-NeXT's any-resolution images
plus a video path of pooled frames.

Zhang et al., "LLaVA-NeXT: A Strong Zero-shot Video Understanding Model" (2024) and the
transformers port (``LlavaNextVideoForConditionalGeneration``, ``LlavaNextVideoProcessor``):

- an image (:data:`IMAGE_MODE`) is LLaVA-NeXT's: the base tile and the unpadded grid of
  the checkpoint's ``image_grid_pinpoints``, an ``image_newline`` after each row
  (transformers' ``pack_image_features``); ``detail: "low"`` (:data:`BASE_MODE`) is the
  base tile and one newline, as on LLaVA-NeXT;
- a video frame (:data:`FRAME_MODE`) is resized and centre-cropped to one tile, its
  patch features pooled by the checkpoint's ``spatial_pool_mode`` with
  ``spatial_pool_stride`` (transformers' ``LlavaNextVideoPooler``; 24 x 24 -> 12 x 12 =
  144 tokens on the 7B checkpoints) before the projector; a video is its frames' runs in
  order and nothing after them (no video newline, unlike OneVision).

Each frame is encoded, keyed and cached on its own (the tower sees one frame at a time, so
a frame's features do not depend on the other frames of its video). Token counts are the
processor's (``_get_num_multimodal_tokens``, ``replace_video_token``); a checkpoint whose
pooling gives another per-frame count than the processor's prompt is refused at load.

transformers' video processor needs torchvision, so the processor is assembled here
(:func:`load_next_video_processor`) and frames are prepared from the video processor's
settings by transformers' PIL CLIP image processor (resize the shortest edge, centre crop,
rescale, normalise: the steps the video processor documents).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import nn
from transformers import AutoImageProcessor, AutoTokenizer, LlavaNextVideoProcessor
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava_next_video.modeling_llava_next_video import (
    LlavaNextVideoModel,
    LlavaNextVideoMultiModalProjector,
    LlavaNextVideoPooler,
)

# the module, not ``transformers.LlavaNextVideoVideoProcessor`` (a stand-in that refuses to
# exist without torchvision); its configuration loads without torchvision
from transformers.models.llava_next_video.video_processing_llava_next_video import (
    LlavaNextVideoVideoProcessor,
)
from transformers.processing_utils import ProcessorMixin

from mmserve.model.families.base import (
    BASE_MODE,
    FRAME_MODE,
    IMAGE_MODE,
    VisionModule,
)
from mmserve.model.families.llava import CLIP_MEAN, CLIP_STD, VICUNA_7B, llava_test_config
from mmserve.model.families.llava_next import (
    NEXT_TILES,
    LlavaNextFamily,
    LlavaNextVision,
    preprocess_anyres,
)
from mmserve.model.families.sizes import TEST_PATCH, TEST_WIDTHS, size_widths, special_token_ids
from mmserve.vision.hashing import mode_key, processor_fingerprint
from mmserve.vision.pixels import Pixels, stack_image_sizes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mmserve.vision.inputs import ImageInput

#: The video processor's settings a frame's preparation reads (:func:`frame_processor`).
_FRAME_FIELDS = (
    "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale",
    "rescale_factor", "do_normalize", "image_mean", "image_std", "do_convert_rgb",
)  # fmt: skip
#: ``LlavaNextVideoProcessor.__init__`` arguments read from ``processor_config.json``.
_PROCESSOR_ARGS = (
    "patch_size",
    "vision_feature_select_strategy",
    "num_additional_image_tokens",
    "image_token",
    "video_token",
)


class NextVideoProcessor(LlavaNextVideoProcessor):
    """transformers' ``LlavaNextVideoProcessor`` holding a tokenizer and an image processor
    only, so that it can exist without torchvision.

    Every method is transformers' own (image token counts, ``replace_video_token``,
    ``__call__`` on text and images); the video processor's settings are kept, unused by
    transformers, as :attr:`video_settings` (a ``LlavaNextVideoVideoProcessor`` read from
    the checkpoint, never called: calling it needs torchvision).

    Args:
        image_processor: the PIL ``LlavaNextImageProcessorPil``.
        tokenizer: the checkpoint's tokenizer.
        video_settings: the ``LlavaNextVideoVideoProcessor`` (settings only).
        chat_template, patch_size, vision_feature_select_strategy,
            num_additional_image_tokens, image_token, video_token: as
            ``LlavaNextVideoProcessor``'s.
    """

    def __init__(
        self,
        image_processor: Any,
        tokenizer: Any,
        video_settings: Any = None,
        chat_template: str | None = None,
        patch_size: int | None = None,
        vision_feature_select_strategy: str | None = None,
        num_additional_image_tokens: int = 0,
        image_token: str = "<image>",
        video_token: str = "<video>",
    ) -> None:
        # LlavaNextVideoProcessor's settings; its __init__ hands ProcessorMixin a video
        # processor first, which this signature (checked by ProcessorMixin) does not have
        self.patch_size = patch_size
        self.num_additional_image_tokens = num_additional_image_tokens
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self.image_token = getattr(tokenizer, "image_token", None) or image_token
        self.video_token = getattr(tokenizer, "video_token", None) or video_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.video_settings = video_settings
        #: the frames' image processor (:func:`frame_processor`), built once
        self.frame_prep = frame_processor(video_settings) if video_settings is not None else None

    def frame_pixels(self, frames: Sequence[Image.Image]) -> torch.Tensor:
        """fp32 ``[len(frames), 3, crop, crop]`` pixels of video frames (see
        :func:`frame_processor`)."""
        assert self.frame_prep is not None, "a processor without video settings"
        out = self.frame_prep(images=list(frames), return_tensors="pt")
        return out["pixel_values"]


def load_next_video_processor(model_dir: str | Path) -> NextVideoProcessor:
    """Read a LLaVA-NeXT-Video checkpoint's tokenizer and processors without torchvision:
    ``AutoTokenizer``, ``AutoImageProcessor`` with the PIL backend, the video processor
    class's own config loading (``video_preprocessor_config.json``, else the nested or
    legacy files, with the class defaults) and the processor's settings from
    ``processor_config.json``. A chat template only the processor carries is handed to the
    tokenizer.

    Raises:
        OSError, ValueError: as transformers raises for missing or bad files.
    """
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    video = LlavaNextVideoVideoProcessor.from_pretrained(model_dir)
    settings, _ = LlavaNextVideoProcessor.get_processor_dict(model_dir)
    kwargs = {k: settings[k] for k in _PROCESSOR_ARGS if settings.get(k) is not None}
    template = settings.get("chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return NextVideoProcessor(
        image_processor,
        tokenizer,
        video_settings=video,
        chat_template=getattr(tokenizer, "chat_template", None),
        **kwargs,
    )


def frame_processor(video_settings: Any) -> CLIPImageProcessorPil:
    """A PIL image processor doing what the video processor's settings say to each frame:
    resize (its ``size``, shortest edge or height x width, ``resample``), centre crop
    (``crop_size``), rescale, normalise, convert to RGB. The steps and arithmetic of
    transformers' PIL processors; torchvision's antialiased resize (the video processor's)
    can differ from PIL's by a few 1/255 steps."""
    v = video_settings
    kwargs = {k: getattr(v, k) for k in _FRAME_FIELDS if getattr(v, k, None) is not None}
    for k in ("size", "crop_size"):  # SizeDict -> plain dict
        if k in kwargs:
            kwargs[k] = {n: s for n, s in dict(kwargs[k]).items() if s is not None}
    return CLIPImageProcessorPil(**kwargs)


def frame_side(video_settings: Any) -> tuple[int, int]:
    """``(height, width)`` of a prepared frame: the crop, else the resize target.

    Raises:
        ValueError: when neither fixes the frame's size.
    """
    v = video_settings
    for on, name in (("do_center_crop", "crop_size"), ("do_resize", "size")):
        size = dict(getattr(v, name, None) or {}) if getattr(v, on, False) else {}
        if size.get("height") and size.get("width"):
            return int(size["height"]), int(size["width"])
    raise ValueError(
        "the video processor's crop_size/size must give a frame height and width "
        f"(crop_size={getattr(v, 'crop_size', None)!r}, size={getattr(v, 'size', None)!r})"
    )


class LlavaNextVideoVision(LlavaNextVision):
    """CLIP tower, video pooler, projector and ``image_newline`` of a LLaVA-NeXT-Video
    checkpoint.

    Args:
        config: the ``LlavaNextVideoConfig``.
        image_processor: its PIL ``LlavaNextImageProcessorPil``.
        frame_prep: the frames' image processor (:func:`frame_processor`).

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer`` or an unknown strategy, or an
            unknown ``spatial_pool_mode``.
    """

    def __init__(self, config: PretrainedConfig, image_processor: Any, frame_prep: Any) -> None:
        # LlavaNextVision's layout with the video model's own projector class
        VisionModule.__init__(self, config, LlavaNextVideoMultiModalProjector, image_processor)
        self.image_newline = nn.Parameter(torch.zeros(config.text_config.hidden_size))
        self.vision_resampler = LlavaNextVideoPooler(config)
        self.frame_prep = frame_prep

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        """See :meth:`VisionModule.preprocess` and :func:`preprocess_next_video`."""
        return preprocess_next_video(
            self.image_processor, self.config, self.frame_prep, images, mode
        )

    def _frames(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        # transformers' get_video_features: tower, feature select, pooler, then projector
        cfg = self.config
        p = next(self.vision_tower.parameters())
        pixels = torch.cat([it.values for it in items]).to(p.device, p.dtype)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        hidden = out.hidden_states[cfg.vision_feature_layer]
        if cfg.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]
        return list(self.multi_modal_projector(self.vision_resampler(hidden)))

    def _images(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        counts = [it.values.shape[0] for it in items]
        feats = torch.split(self.project(torch.cat([it.values for it in items])), counts)
        # transformers' packing reads only self.config, so it runs on this module as it
        # would on LlavaNextVideoModel
        packed, _ = LlavaNextVideoModel.pack_image_features(
            self,  # type: ignore[arg-type]  # duck-typed self: only .config is read
            feats,
            stack_image_sizes(items),
            self.config.vision_feature_select_strategy,
            image_newline=self.image_newline,
        )
        return list(packed)

    @torch.inference_mode()
    def encode_pixels(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        """See :meth:`VisionModule.encode_pixels`: one tower call for the images (image and
        base mode) and one for the frames.

        Returns:
            Per item: ``[num_image_tokens(w, h), hidden]`` (image mode), ``[tile_patches +
            1, hidden]`` (base mode) or ``[pooled_patches, hidden]`` (a frame).

        Raises:
            ValueError: for an unknown mode.
        """
        for it in items:
            if it.mode not in (IMAGE_MODE, BASE_MODE, FRAME_MODE):
                raise ValueError(f"LLaVA-NeXT-Video has no {it.mode!r} mode")
        frames = [i for i, it in enumerate(items) if it.mode == FRAME_MODE]
        images = [i for i, it in enumerate(items) if it.mode != FRAME_MODE]
        out: dict[int, torch.Tensor] = {}
        for idx, run in ((frames, self._frames), (images, self._images)):
            if idx:
                out.update(zip(idx, run([items[i] for i in idx]), strict=True))
        return [out[i] for i in range(len(items))]


def preprocess_next_video(
    image_processor: Any,
    config: PretrainedConfig,
    frame_prep: Any,
    images: Sequence[Image.Image],
    mode: str,
) -> list[Pixels]:
    """LLaVA-NeXT-Video's processing of ``images`` in ``mode``, fp32, one item per image:
    the any-resolution grid (image mode) or the base tile alone (base mode) of
    :func:`~mmserve.model.families.llava_next.preprocess_anyres`, or a frame's
    ``[1, 3, tile, tile]`` (:func:`frame_processor`).

    Raises:
        ValueError: for an unknown mode.
    """
    if mode == FRAME_MODE:
        px = frame_prep(images=list(images), return_tensors="pt")
        values = px["pixel_values"]
        return [Pixels(mode, values[i : i + 1].clone()) for i in range(len(images))]
    if mode not in (IMAGE_MODE, BASE_MODE):
        raise ValueError(f"LLaVA-NeXT-Video has no {mode!r} mode")
    return preprocess_anyres(image_processor, config, images, mode, base_only=mode == BASE_MODE)


def check_video_path(config: PretrainedConfig, processor: Any) -> int:
    """Tokens per frame on the video path, checked against the processor's prompt.

    The pooler turns each frame's ``side x side`` patches into ``(side // stride)^2``
    features; transformers' ``replace_video_token`` writes ``side^2 // 4`` placeholders per
    frame. A checkpoint where the two differ (a ``spatial_pool_stride`` other than 2), or
    whose frames are not the tower's tiles, is refused: its prompt would not fit its features.

    Raises:
        ValueError: naming the field at fault.
    """
    vc = config.vision_config
    tile = vc.image_size
    got = frame_side(processor.video_settings)
    if got != (tile, tile):
        raise ValueError(
            f"video frames are cropped/resized to {got[0]}x{got[1]} (video processor "
            f"crop_size/size), but the vision tower takes {tile}x{tile}"
        )
    if config.vision_feature_select_strategy != "default":
        raise ValueError(
            f"vision_feature_select_strategy {config.vision_feature_select_strategy!r}: "
            "LLaVA-NeXT-Video pools a square grid of patches, so only 'default' is supported"
        )
    if config.spatial_pool_mode not in ("average", "max", "conv"):
        raise ValueError(f"unknown spatial_pool_mode {config.spatial_pool_mode!r}")
    side = tile // vc.patch_size
    ours = (side // config.spatial_pool_stride) ** 2
    video = np.zeros((1, 1, 3, tile, tile), dtype=np.float32)
    text = processor.replace_video_token({"pixel_values_videos": video}, 0)
    theirs = text.count(processor.video_token)
    if ours != theirs:
        raise ValueError(
            f"spatial_pool_stride {config.spatial_pool_stride} pools a frame to {ours} "
            f"tokens, but LlavaNextVideoProcessor's prompt holds {theirs} per frame"
        )
    return ours


class LlavaNextVideoFamily(LlavaNextFamily):
    """LLaVA-NeXT-Video: LLaVA-NeXT's images, and videos of pooled frames (no newline).

    Raises:
        ValueError: (from the constructor) for a video path whose per-frame token count
            is not the processor's, or whose frames are not the tower's tiles
            (:func:`check_video_path`).
    """

    model_type: ClassVar[str] = "llava_next_video"
    name: ClassVar[str] = "llava-next-video"
    vision_prefixes: ClassVar[dict[str, str]] = {
        **LlavaNextFamily.vision_prefixes,
        "vision_resampler.": "vision_resampler",
    }
    video_newline: ClassVar[bool] = False

    def __init__(self, config: PretrainedConfig, processor: Any) -> None:
        super().__init__(config, processor)
        self._frame_tokens = check_video_path(config, processor)
        self.video_fingerprint = processor_fingerprint(processor.video_settings)

    @classmethod
    def load_processor(cls, model_dir: Path) -> NextVideoProcessor:
        """See :func:`load_next_video_processor`."""
        return load_next_video_processor(model_dir)

    def build_vision(self) -> LlavaNextVideoVision:
        return LlavaNextVideoVision(
            self.config, self.processor.image_processor, self.processor.frame_prep
        )

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        return preprocess_next_video(
            self.processor.image_processor, self.config, self.processor.frame_prep,
            images, mode,
        )  # fmt: skip

    def mode_tokens(self, width: int, height: int, mode: str) -> int:
        """:data:`FRAME_MODE`: the pooled frame, whatever the frame's size; else as
        LLaVA-NeXT."""
        if mode == FRAME_MODE:
            return self._frame_tokens
        return super().mode_tokens(width, height, mode)

    def mode_item(self, image: ImageInput, mode: str) -> ImageInput:
        """``image`` in ``mode``; a frame's key also covers the video processor's settings."""
        if mode != FRAME_MODE:
            return super().mode_item(image, mode)
        key = mode_key(image.key, mode, self.video_fingerprint)
        return dataclasses.replace(image, key=key, mode=mode, features=None)

    def video_frame_tokens(self) -> int:
        return self._frame_tokens

    test_sizes: ClassVar[tuple[str, ...]] = (*TEST_WIDTHS, "llava-next-video-7b")

    @classmethod
    def test_config(cls, size: str) -> dict[str, Any]:
        """See :meth:`ModelFamily.test_config`: LLaVA-NeXT's test tiles and grids (tiny: 8 x 8
        patches per tile, pooled to 4 x 4 per frame; small: 12 x 12 -> 6 x 6), average
        pooling with stride 2, a byte-level BPE tokenizer with ``<video>``, the Vicuna
        template with videos; "llava-next-video-7b": LLaVA-NeXT-Video-7B-hf's shapes (CLIP
        ViT-L/14 at 336 px, 24 x 24 -> 12 x 12 = 144 tokens per frame, Vicuna-7B) and its
        special-token ids (``<video>`` 32000, ``<image>`` 32001).

        Raises:
            ValueError: for a size not in :attr:`test_sizes`.
        """
        widths = size_widths(cls, size, {"llava-next-video-7b": VICUNA_7B})
        real = size not in TEST_WIDTHS
        tokenizer = video_tokenizer(real, widths["text"]["max_position_embeddings"])
        tile, pinpoints = NEXT_TILES["llava-next-7b" if real else size]
        base = llava_test_config(widths, tokenizer, tile)
        ids = special_token_ids(tokenizer)
        base.pop("architectures")
        base.update(
            model_type=cls.model_type,
            architectures=["LlavaNextVideoForConditionalGeneration"],
            image_grid_pinpoints=pinpoints,
            video_token_index=ids["<video>"],
            spatial_pool_mode="average",
            spatial_pool_stride=2,
            video_seq_length=((tile // TEST_PATCH) // 2) ** 2 * 2,
        )
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            base.pop(k)
        crop = {"height": tile, "width": tile}
        clip = dict(image_mean=CLIP_MEAN, image_std=CLIP_STD, do_convert_rgb=True,
                    size={"shortest_edge": tile}, crop_size=crop)  # fmt: skip
        anyres = "transformers.models.llava_next.image_processing_pil_llava_next."
        video = "transformers.models.llava_next_video.video_processing_llava_next_video."
        return {
            "config": base,
            "tokenizer": tokenizer,
            "image_processor": {"class": anyres + "LlavaNextImageProcessorPil", **clip,
                                "image_grid_pinpoints": pinpoints, "do_pad": True},
            "video_processor": {"class": video + "LlavaNextVideoVideoProcessor", **clip,
                                "do_center_crop": True},
            "processor": {"class": "LlavaNextVideoProcessor", "patch_size": TEST_PATCH,
                          "vision_feature_select_strategy": "default",
                          "num_additional_image_tokens": 1, "image_token": "<image>",
                          "video_token": "<video>"},
            "real": real,
        }  # fmt: skip


def video_tokenizer(real: bool, max_length: int) -> dict[str, Any]:
    """The test tokenizer (:meth:`ModelFamily.test_config`'s ``"tokenizer"``): byte-level
    BPE, ``<unk>`` 0, ``<s>`` 1 (before every sequence), ``</s>`` 2, ``<pad>`` 3,
    ``<image>`` 4, ``<video>`` 5; ``real``: Llama's 32,000 regular ids, then ``<video>``
    32000, ``<image>`` 32001 (as LLaVA-NeXT-Video-7B-hf) and ``<pad>`` 32002."""
    tail = ["<video>", "<image>", "<pad>"]
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<video>"]
    return {
        "kind": "bpe",
        "specials": [t for t in specials if not (real and t in tail)],
        "padded": [32000, tail] if real else None,
        "prepend": "<s>",
        "settings": dict(
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
            model_max_length=max_length,
        ),
        "chat_template": "chat_template_video.jinja",
    }
