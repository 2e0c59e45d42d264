"""LLaVA-1.5 (``model_type`` "llava"): a fixed grid of patch features per image.

Features follow Liu et al., "Improved Baselines with Visual Instruction Tuning"
(arXiv 2310.03744, Section 3.1): hidden states of ``vision_feature_layer``, CLS
dropped for the "default" strategy, a two-layer GELU MLP into the decoder.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from PIL import Image
from transformers import AutoModel
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from mmserve.model.families.base import ModelFamily, VisionModule, check_vision_config


class LlavaVision(VisionModule):
    """CLIP vision tower + LLaVA projector, with the checkpoint's image processor.

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer`` or an unknown
            ``vision_feature_select_strategy``.
    """

    def __init__(self, config: object, image_processor: object) -> None:
        super().__init__()
        check_vision_config(config)
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.feature_layer = config.vision_feature_layer
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.image_processor = image_processor

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` normalised pixels -> ``[N, num_image_tokens, text_hidden]``."""
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        feats = out.hidden_states[self.feature_layer]
        if self.drop_cls:
            feats = feats[:, 1:]
        return self.multi_modal_projector(feats)

    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """See :meth:`VisionModule.encode`; one tower call for all images."""
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        p = next(self.parameters())
        return list(self(pixels.to(p.device, p.dtype)))


class LlavaFamily(ModelFamily):
    """LLaVA-1.5: (image_size / patch_size)^2 tokens per image, whatever its size."""

    model_type: ClassVar[str] = "llava"
    name: ClassVar[str] = "llava"

    def build_vision(self) -> LlavaVision:
        return LlavaVision(self.config, self.processor.image_processor)

    def fixed_image_tokens(self) -> int:
        vc = self.config.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        return n + 1 if self.config.vision_feature_select_strategy == "full" else n

    def num_image_tokens(self, width: int, height: int) -> int:
        return self.fixed_image_tokens()
