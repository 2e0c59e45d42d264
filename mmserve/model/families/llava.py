"""LLaVA-1.5 (``model_type`` "llava"): a fixed grid of patch features per image.

Features follow Liu et al., "Improved Baselines with Visual Instruction Tuning"
(arXiv 2310.03744, Section 3.1): hidden states of ``vision_feature_layer``, CLS
dropped for the "default" strategy, a two-layer GELU MLP into the decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from PIL import Image
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from mmserve.model.families.base import IMAGE_MODE, ModelFamily, VisionModule
from mmserve.vision.pixels import Pixels


class LlavaVision(VisionModule):
    """CLIP vision tower + LLaVA projector, with the checkpoint's image processor.

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer`` or an unknown
            ``vision_feature_select_strategy``.
    """

    def __init__(self, config: object, image_processor: object) -> None:
        super().__init__(config, LlavaMultiModalProjector, image_processor)

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        """See :meth:`VisionModule.preprocess`: ``[1, 3, H, W]`` per image.

        Raises:
            ValueError: for a mode other than :data:`IMAGE_MODE`.
        """
        return preprocess_llava(self.image_processor, images, mode)

    @torch.inference_mode()
    def encode_pixels(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        """See :meth:`VisionModule.encode_pixels`; one tower call for all items."""
        for it in items:
            _check_mode(it.mode)
        return list(self.project(torch.cat([it.values for it in items])))


def preprocess_llava(
    image_processor: object, images: Sequence[Image.Image], mode: str
) -> list[Pixels]:
    """The checkpoint's image processor on ``images``: fp32 ``[1, 3, H, W]`` per image.

    Raises:
        ValueError: for a mode other than :data:`IMAGE_MODE`.
    """
    _check_mode(mode)
    pixels = image_processor(images=list(images), return_tensors="pt")["pixel_values"]
    return [Pixels(mode, pixels[i : i + 1].clone()) for i in range(len(images))]


def _check_mode(mode: str) -> None:
    if mode != IMAGE_MODE:
        raise ValueError(f"LLaVA-1.5 has no {mode!r} mode")


class LlavaFamily(ModelFamily):
    """LLaVA-1.5: (image_size / patch_size)^2 tokens per image, whatever its size."""

    model_type: ClassVar[str] = "llava"
    name: ClassVar[str] = "llava"

    def build_vision(self) -> LlavaVision:
        return LlavaVision(self.config, self.processor.image_processor)

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        return preprocess_llava(self.processor.image_processor, images, mode)

    def fixed_image_tokens(self) -> int:
        vc = self.config.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        return n + 1 if self.config.vision_feature_select_strategy == "full" else n

    def num_image_tokens(self, width: int, height: int) -> int:
        return self.fixed_image_tokens()
