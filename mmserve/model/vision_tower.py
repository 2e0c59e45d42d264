"""Vision tower and projector: transformers' CLIP encoder plus LLaVA's MLP projector.

Image features follow LLaVA-1.5 (Liu et al., "Improved Baselines with Visual
Instruction Tuning", arXiv 2310.03744, Section 3.1): hidden states of
``vision_feature_layer`` (-2), CLS dropped for the "default" strategy, then a
two-layer GELU MLP into the decoder's hidden size.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel, LlavaConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector


class VisionEncoder(nn.Module):
    """CLIP vision tower + LLaVA projector.

    Args:
        config: the checkpoint's ``LlavaConfig``.

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer`` or an unknown
            ``vision_feature_select_strategy``.
    """

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError("only an integer vision_feature_layer is supported")
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                f"unknown vision_feature_select_strategy {config.vision_feature_select_strategy!r}"
            )
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.feature_layer = config.vision_feature_layer
        self.drop_cls = config.vision_feature_select_strategy == "default"

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Encode images.

        Args:
            pixel_values: ``[N, 3, H, W]`` normalised pixels from the image processor.

        Returns:
            ``[N, num_image_tokens, text_hidden]`` projected features (576 tokens at 336 px).
        """
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        feats = out.hidden_states[self.feature_layer]
        if self.drop_cls:
            feats = feats[:, 1:]
        return self.multi_modal_projector(feats)
