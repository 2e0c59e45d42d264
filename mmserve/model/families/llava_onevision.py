"""LLaVA-OneVision (``model_type`` "llava_onevision"): SigLIP + Qwen2, images on an
any-resolution grid, videos as pooled frames.

Li et al., "LLaVA-OneVision: Easy Visual Task Transfer" (arXiv 2408.03326), Section 3
and the transformers port (``LlavaOnevisionForConditionalGeneration``):

- an image alone in its prompt (:data:`IMAGE_MODE`) is tiled like LLaVA-NeXT on the
  checkpoint's ``image_grid_pinpoints``; the grid features are unpadded, shrunk
  bilinearly to about N tiles' worth when larger (``vision_aspect_ratio``
  "anyres_max_N"), an ``image_newline`` ends each row and the base tile comes first
  (transformers' ``pack_image_features``);
- each image of a prompt with several images (:data:`BASE_MODE`) is padded to a square,
  resized to one tile, and becomes that tile's features plus one newline;
- a video frame (:data:`FRAME_MODE`) is resized to one tile, and its features are
  pooled bilinearly to ``ceil(n / 2)`` x ``ceil(n / 2)`` (transformers'
  ``apply_pooling``; 27 x 27 -> 14 x 14 on the real model); a video is its frames in
  order and one ``image_newline`` (the reserved token
  :data:`~mmserve.vision.hashing.VIDEO_NEWLINE_ID`).

Token counts are asked of transformers' ``LlavaOnevisionProcessor``
(``_get_num_multimodal_tokens``, ``replace_image_token``); the tower, projector,
packing and pooling are transformers' modules and functions, run on this module as
they run on ``LlavaOnevisionModel`` (they read only ``self.config``). Each frame is
encoded, keyed and cached on its own: the tower sees one frame at a time, so a frame's
features do not depend on the other frames of its video.

A live stream (``/v1/streams``) is laid out as a video (:meth:`ModelFamily.stream_layout`):
its frames' pooled runs are prefilled as they arrive, and a question adds only the video
newline and its own text.

Without torchvision (which transformers' video processor needs) the processor is
assembled here (:func:`load_onevision_processor`) and frames are prepared by
:func:`mmserve.vision.frames.prepare_frames` from the video processor's settings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from PIL import Image
from torch import nn
from transformers import AutoImageProcessor, AutoTokenizer, LlavaOnevisionProcessor
from transformers.models.llava_onevision.modeling_llava_onevision import (
    LlavaOnevisionModel,
    LlavaOnevisionMultiModalProjector,
)

# the module, not ``transformers.LlavaOnevisionVideoProcessor`` (a stand-in that refuses
# to exist without torchvision); its configuration loads without torchvision
from transformers.models.llava_onevision.video_processing_llava_onevision import (
    LlavaOnevisionVideoProcessor,
)

from mmserve.model.families.base import (
    BASE_MODE,
    FRAME_MODE,
    IMAGE_MODE,
    ORIGINAL_MODE,
    ModelFamily,
    VisionModule,
)
from mmserve.model.families.llava_next import grid_holder, original_tokens, preprocess_anyres
from mmserve.model.families.onevision_variants import check_onevision_checkpoint
from mmserve.model.families.sizes import TEST_PATCH, TEST_WIDTHS, size_widths, special_token_ids
from mmserve.vision.frames import FramePrep, prepare_frames
from mmserve.vision.hashing import VIDEO_NEWLINE_ID, mode_key, processor_fingerprint
from mmserve.vision.pixels import Pixels, stack_image_sizes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mmserve.vision.inputs import ImageInput

#: ``LlavaOnevisionProcessor.__init__`` arguments read from ``processor_config.json``.
_PROCESSOR_ARGS = (
    "num_image_tokens",
    "vision_feature_select_strategy",
    "image_token",
    "video_token",
    "vision_aspect_ratio",
)


class OnevisionProcessor(LlavaOnevisionProcessor):
    """transformers' ``LlavaOnevisionProcessor`` holding a tokenizer and an image processor
    only, so that it can exist without torchvision.

    Every method is transformers' own (token counts, ``replace_image_token``,
    ``__call__`` on text and images); the video processor's settings are kept, unused
    by transformers, as :attr:`video_settings` (a ``LlavaOnevisionVideoProcessor`` read
    from the checkpoint, never called: calling it needs torchvision).

    Args:
        image_processor: the PIL ``LlavaOnevisionImageProcessorPil``.
        tokenizer: the checkpoint's tokenizer.
        video_settings: the ``LlavaOnevisionVideoProcessor`` (settings only).
        **kwargs: ``LlavaOnevisionProcessor`` arguments (``num_image_tokens``, ...).
    """

    def __init__(self, image_processor: object, tokenizer: object, **kwargs: object) -> None:
        video_settings = kwargs.pop("video_settings", None)
        # ProcessorMixin checks the sub-processors named in this signature only, so the
        # (torchvision) video processor is neither required nor type-checked
        LlavaOnevisionProcessor.__init__(self, image_processor, tokenizer, None, **kwargs)
        self.video_settings = video_settings


def load_onevision_processor(model_dir: str | Path) -> OnevisionProcessor:
    """Read a OneVision checkpoint's tokenizer and processors without torchvision.

    ``AutoTokenizer``, ``AutoImageProcessor`` with the PIL backend, the video processor
    class's own config loading (``video_preprocessor_config.json``, else the nested or
    legacy files, with the class defaults), and the processor's settings from
    ``processor_config.json`` (``LlavaOnevisionProcessor.get_processor_dict``). A chat
    template only the processor carries is handed to the tokenizer.

    Raises:
        OSError, ValueError: as transformers raises for missing or bad files.
    """
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    video = LlavaOnevisionVideoProcessor.from_pretrained(model_dir)
    settings, _ = LlavaOnevisionProcessor.get_processor_dict(model_dir)
    kwargs = {k: settings[k] for k in _PROCESSOR_ARGS if settings.get(k) is not None}
    template = settings.get("chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return OnevisionProcessor(
        image_processor,
        tokenizer,
        video_settings=video,
        chat_template=getattr(tokenizer, "chat_template", None),
        **kwargs,
    )


def video_token_counts(config: PretrainedConfig, processor: Any) -> tuple[int, int]:
    """Placeholder tokens of a 1-frame and a 2-frame video at the tower's size.

    Asks the processor (``_get_num_multimodal_tokens``); transformers before 5.2x count no
    video tokens there (the entry is None: seen with 5.17 on the GPU check's image), so
    then the count comes from transformers' own rule for this processor: each frame's
    ``side x side`` patches pooled 2x2 (``ceil(side / 2)`` squared), plus one newline
    per video.

    Returns:
        ``(one, two)`` token counts.
    """
    t = config.vision_config.image_size
    counts = processor._get_num_multimodal_tokens(video_sizes=[[1, t, t], [2, t, t]])
    video = counts["num_video_tokens"]
    if video is not None:
        return int(video[0]), int(video[1])
    pooled = math.ceil((t // config.vision_config.patch_size) / 2) ** 2
    return pooled + 1, 2 * pooled + 1


class LlavaOnevisionVision(VisionModule):
    """SigLIP tower, projector and ``image_newline`` of a LLaVA-OneVision checkpoint.

    Args:
        config: the ``LlavaOnevisionConfig``.
        image_processor: its PIL ``LlavaOnevisionImageProcessorPil``.
        frame_prep: video frame settings (:class:`~mmserve.vision.frames.FramePrep`).

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer``, an unknown strategy, or
            video frames not resized to the tower's input size.
    """

    def __init__(
        self, config: PretrainedConfig, image_processor: Any, frame_prep: FramePrep
    ) -> None:
        tile = config.vision_config.image_size
        if (frame_prep.height, frame_prep.width) != (tile, tile) or not frame_prep.do_resize:
            raise ValueError(
                f"video frames are resized to {frame_prep.height}x{frame_prep.width}, but the "
                f"vision tower takes {tile}x{tile}"
            )
        super().__init__(config, LlavaOnevisionMultiModalProjector, image_processor)
        self.image_newline = nn.Parameter(torch.zeros(config.text_config.hidden_size))
        self.frame_prep = frame_prep

    def _pack(
        self, feats: Sequence[torch.Tensor], sizes: torch.Tensor, mode: str = IMAGE_MODE
    ) -> list[torch.Tensor]:
        # transformers' packing reads only self.config, so it runs on a stand-in holding
        # the config (the original view's: the item's one grid) as on LlavaOnevisionModel
        out = []
        for f, size in zip(feats, sizes, strict=True):
            packed, _ = LlavaOnevisionModel.pack_image_features(
                grid_holder(self.config, mode, size),  # type: ignore[arg-type]
                [f],
                size[None],
                image_newline=self.image_newline,
                vision_aspect_ratio=self.config.vision_aspect_ratio,
            )
            out.append(packed[0])
        return out

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        """See :meth:`VisionModule.preprocess`.

        Per image: ``[tiles, 3, tile, tile]`` and its ``image_size`` (image mode: base tile
        plus grid, padding tiles dropped); ``[1, 3, tile, tile]`` and its ``image_size``
        (base mode: padded to a square, one tile); ``[1, 3, tile, tile]`` (a frame).

        Raises:
            ValueError: for an unknown mode.
        """
        return preprocess_onevision(
            self.image_processor, self.config, self.frame_prep, images, mode
        )

    def _anyres(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        counts = [it.values.shape[0] for it in items]
        pixels = torch.cat([it.values for it in items])
        sizes = stack_image_sizes(items)
        return self._pack(torch.split(self.project(pixels), counts), sizes, items[0].mode)

    def _base(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        feats = self.project(torch.cat([it.values for it in items]))
        sizes = stack_image_sizes(items)
        return self._pack([f[None] for f in feats], sizes)

    def _frames(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        feats = self.project(torch.cat([it.values for it in items]))
        # duck-typed self, as in _pack: apply_pooling reads only self.config
        return list(LlavaOnevisionModel.apply_pooling(self, feats))  # type: ignore[arg-type]

    @torch.inference_mode()
    def encode_pixels(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        """See :meth:`VisionModule.encode_pixels`: one tower call per mode present.

        Returns:
            Per item: ``[num_image_tokens(w, h), hidden]`` (image mode), ``[tile_patches +
            1, hidden]`` (base mode) or ``[pooled_patches, hidden]`` (a frame).

        Raises:
            ValueError: for an unknown mode.
        """
        by_mode: dict[str, list[int]] = {}
        for i, it in enumerate(items):
            by_mode.setdefault(it.mode, []).append(i)
        run = {
            IMAGE_MODE: self._anyres,
            ORIGINAL_MODE: self._anyres,
            BASE_MODE: self._base,
            FRAME_MODE: self._frames,
        }
        out: dict[int, torch.Tensor] = {}
        for mode, idx in by_mode.items():
            if mode not in run:
                raise ValueError(f"LLaVA-OneVision has no {mode!r} mode")
            for i, f in zip(idx, run[mode]([items[i] for i in idx]), strict=True):
                out[i] = f
        return [out[i] for i in range(len(items))]

    def token_embeddings(self) -> dict[int, torch.Tensor]:
        """The video newline: ``image_newline`` (``[text_hidden]``), after a video's frames."""
        return {VIDEO_NEWLINE_ID: self.image_newline}


def preprocess_onevision(
    image_processor: Any,
    config: PretrainedConfig,
    frame_prep: FramePrep,
    images: Sequence[Image.Image],
    mode: str,
) -> list[Pixels]:
    """OneVision's processing of ``images`` in ``mode``, fp32, one item per image.

    Image mode: the any-resolution grid (:func:`preprocess_anyres`); original mode: the
    same on the image's own grid. Base mode:
    ``[1, 3, tile, tile]`` and the image size, as transformers processes an image of a
    prompt with several images (a nested list: it pads to a square and resizes to one
    tile only when a prompt holds more than one; the result does not depend on the
    other images, so each goes in twice). A frame: ``[1, 3, tile, tile]``
    (:func:`~mmserve.vision.frames.prepare_frames`).

    Raises:
        ValueError: for an unknown mode.
    """
    if mode in (IMAGE_MODE, ORIGINAL_MODE):
        return preprocess_anyres(image_processor, config, images, mode)
    if mode == FRAME_MODE:
        frames = prepare_frames(list(images), frame_prep)
        return [Pixels(mode, frames[i : i + 1].clone()) for i in range(len(images))]
    if mode == BASE_MODE:
        result = []
        for im in images:
            out = image_processor(images=[[im, im]], return_tensors="pt")
            values = out["pixel_values"][:1, 0].clone()
            result.append(Pixels(mode, values, out["image_sizes"][0].clone()))
        return result
    raise ValueError(f"LLaVA-OneVision has no {mode!r} mode")


class LlavaOnevisionFamily(ModelFamily):
    """LLaVA-OneVision: anyres grid alone, one tile among several images, pooled frames.

    Raises:
        ValueError: (from the constructor) when the processor's video token count is not
            frames x per-frame tokens + one newline.
    """

    model_type: ClassVar[str] = "llava_onevision"
    name: ClassVar[str] = "llava-onevision"
    vision_prefixes: ClassVar[dict[str, str]] = {
        **ModelFamily.vision_prefixes,
        "image_newline": "image_newline",
    }

    def __init__(self, config: PretrainedConfig, processor: Any) -> None:
        super().__init__(config, processor)
        settings = processor.video_settings
        self.frame_prep = FramePrep.from_processor(settings)
        self.video_fingerprint = processor_fingerprint(settings)
        one, two = video_token_counts(config, processor)
        self._frame_tokens = two - one
        if one - self._frame_tokens != 1:
            raise ValueError(f"a 1-frame video has {one} tokens, not {two - one} + 1 newline")

    @classmethod
    def check_checkpoint(cls, model_dir: Path) -> None:
        """See :func:`~mmserve.model.families.onevision_variants.check_onevision_checkpoint`."""
        check_onevision_checkpoint(model_dir)

    @classmethod
    def load_processor(cls, model_dir: Path) -> OnevisionProcessor:
        """See :func:`load_onevision_processor`."""
        return load_onevision_processor(model_dir)

    def build_vision(self) -> LlavaOnevisionVision:
        return LlavaOnevisionVision(self.config, self.processor.image_processor, self.frame_prep)

    def num_image_tokens(self, width: int, height: int) -> int:
        data = self.processor._get_num_multimodal_tokens(image_sizes=[[height, width]])
        return int(data["num_image_tokens"][0])

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        return preprocess_onevision(
            self.processor.image_processor, self.config, self.frame_prep, images, mode
        )

    def low_mode(self) -> str:
        """:data:`BASE_MODE`: one padded square tile and a newline, as an image among
        several (the same view, so the same key and KV)."""
        return BASE_MODE

    def original_mode(self, num_images: int) -> str:
        """:data:`ORIGINAL_MODE`: the grid covering the image at its own resolution, also
        in a prompt with several images (the caller asked for the image's resolution)."""
        return ORIGINAL_MODE

    def image_mode(self, num_images: int) -> str:
        """:data:`BASE_MODE` for each image of a prompt with several images, as
        ``LlavaOnevisionProcessor.replace_image_token`` counts them."""
        return BASE_MODE if num_images > 1 else IMAGE_MODE

    def mode_tokens(self, width: int, height: int, mode: str) -> int:
        if mode == FRAME_MODE:
            return self._frame_tokens
        if mode == ORIGINAL_MODE:
            return original_tokens(self.processor, self.config, width, height)
        if mode == BASE_MODE:  # transformers' count for an image of a 2-image prompt
            inputs = {"batch_num_images": [2], "image_sizes": [[height, width]] * 2}
            text = self.processor.replace_image_token(inputs, image_idx=0)
            return text.count(self.processor.image_token)
        return super().mode_tokens(width, height, mode)

    def mode_item(self, image: ImageInput, mode: str) -> ImageInput:
        """``image`` in ``mode``; a frame's key also covers the video processor's settings."""
        if mode == IMAGE_MODE:
            return image
        if mode not in (BASE_MODE, FRAME_MODE, ORIGINAL_MODE):
            return super().mode_item(image, mode)
        extra = self.video_fingerprint if mode == FRAME_MODE else b""
        # features looked up under the image's own key are not this mode's
        return dataclasses.replace(
            image, key=mode_key(image.key, mode, extra), mode=mode, features=None
        )

    def video_frame_tokens(self) -> int:
        return self._frame_tokens

    test_sizes: ClassVar[tuple[str, ...]] = (*TEST_WIDTHS, "onevision-0.5b")

    @classmethod
    def test_config(cls, size: str) -> dict[str, Any]:
        """See :meth:`ModelFamily.test_config`: a SigLIP tower (no head, last layer, all
        patches: "full"), a Qwen2 decoder (q/k/v biases, RoPE base 1e6; tied embeddings for
        "tiny" as Qwen2-0.5B, untied for "small" as the 7B), the grid of
        :data:`ONEVISION_TILES` with "anyres_max_9", a video processor, a Qwen2-shaped
        byte-level BPE tokenizer with the ChatML template; "onevision-0.5b":
        llava-onevision-qwen2-0.5b-ov-hf's shapes and special-token ids.

        Raises:
            ValueError: for a size not in :attr:`test_sizes`.
        """
        widths = size_widths(cls, size, {"onevision-0.5b": QWEN2_05B})
        real = size not in TEST_WIDTHS
        tile, grid = ONEVISION_TILES[size]
        pinpoints = [[i * tile, j * tile] for i in range(1, grid + 1) for j in range(1, grid + 1)]
        tokenizer = {
            "kind": "bpe",
            "specials": [] if real else list(QWEN2_SPECIALS),
            # Qwen2's 151,643 regular ids, then its specials and OneVision's placeholders
            "padded": [151643, list(QWEN2_SPECIALS)] if real else None,
            "prepend": None,
            "settings": dict(
                eos_token="<|im_end|>",
                pad_token="<|endoftext|>",
                extra_special_tokens=["<|im_start|>", "<image>", "<video>"],
                image_token="<image>",
                video_token="<video>",
                model_max_length=widths["text"]["max_position_embeddings"],
            ),
            "chat_template": "chat_template_chatml.jinja",
        }
        ids = special_token_ids(tokenizer)
        tied = size in ("tiny", "onevision-0.5b")
        vision = {"model_type": "siglip_vision_model", **widths["vision"]}
        vision.update(image_size=tile, patch_size=TEST_PATCH, vision_use_head=False)
        text = {"model_type": "qwen2", **widths["text"]}
        text.update(
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=tied,
        )
        config = dict(
            model_type=cls.model_type,
            architectures=["LlavaOnevisionForConditionalGeneration"],
            vision_config=vision,
            text_config=text,
            image_token_index=ids["<image>"],
            video_token_index=ids["<video>"],
            projector_hidden_act="gelu",
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
            vision_aspect_ratio="anyres_max_9",
            image_grid_pinpoints=pinpoints,
            tie_word_embeddings=tied,
        )
        frames = dict(size={"height": tile, "width": tile}, image_mean=SIGLIP_MEAN,
                      image_std=SIGLIP_STD, do_convert_rgb=True)  # fmt: skip
        module = "transformers.models.llava_onevision."
        image_cls = module + "image_processing_pil_llava_onevision.LlavaOnevisionImageProcessorPil"
        video_cls = module + "video_processing_llava_onevision.LlavaOnevisionVideoProcessor"
        processor = dict(
            image_token="<image>",
            video_token="<video>",
            num_image_tokens=(tile // TEST_PATCH) ** 2,
            vision_aspect_ratio=config["vision_aspect_ratio"],
            vision_feature_select_strategy=config["vision_feature_select_strategy"],
        )
        return {
            "config": config,
            "tokenizer": tokenizer,
            "image_processor": {"class": image_cls, "image_grid_pinpoints": pinpoints,
                                "do_pad": True, **frames},
            "video_processor": {"class": video_cls, **frames},
            "processor": {"class": "LlavaOnevisionProcessor", **processor},
            "real": real,
        }  # fmt: skip


# ---- seeded test checkpoints ----------------------------------------------------------------

#: Qwen2's special tokens in id order, then LLaVA-OneVision's two placeholders.
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
#: Test tile side (pixels, patch 14) and grid size (tiles per side, up to) per size. Real
#: checkpoints use 384-px tiles (27 x 27 patches) on a 6 x 6 grid; these give 7 x 7 (tiny)
#: and 9 x 9 (small) patches, odd like 27, so video pooling (to ceil(n / 2)) is a real
#: bilinear resize, and a 4 x 4 tiny grid is past "anyres_max_9", so large images are
#: shrunk as on the real model.
ONEVISION_TILES: dict[str, tuple[int, int]] = {
    "tiny": (98, 4),
    "small": (126, 3),
    "onevision-0.5b": (384, 6),
}
#: Mean and std of the SigLIP image and video processors.
SIGLIP_MEAN = [0.5, 0.5, 0.5]
SIGLIP_STD = [0.5, 0.5, 0.5]
#: llava-onevision-qwen2-0.5b-ov-hf's widths, as in its config.json: SigLIP so400m (27
#: layers, 26 used at 384 px) and Qwen2-0.5B (tied; 151,936 rows for 151,648 token ids).
QWEN2_05B = {
    "vision": dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=16,
                   intermediate_size=4304),
    "text": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                 max_position_embeddings=32768),
}  # fmt: skip
