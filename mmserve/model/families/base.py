"""The interface every model family implements."""

from __future__ import annotations

from typing import ClassVar

import torch
from PIL import Image
from torch import nn


class VisionModule(nn.Module):
    """A family's vision side: images in, one feature run per image out."""

    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """Preprocess, encode and project ``images``.

        Returns:
            One ``[num_image_tokens(image), text_hidden]`` tensor per image, in the
            model's dtype, in the order its positions appear in the prompt.
        """
        raise NotImplementedError


class ModelFamily:
    """What one LLaVA variant needs beyond the shared Llama decoder.

    Args:
        config: the checkpoint's transformers config (``LlavaConfig``, ...).
        processor: its transformers processor (tokenizer + image processor).

    Attributes:
        model_type: ``config.json``'s ``model_type`` this family serves.
        name: the name users see (``--family`` of ``make-model``, README table).
        vision_prefixes: checkpoint key prefixes (after ``model.``) that belong to
            the vision module, mapped to its attribute names.
    """

    model_type: ClassVar[str] = ""
    name: ClassVar[str] = ""
    vision_prefixes: ClassVar[dict[str, str]] = {
        "vision_tower.": "vision_tower",
        "multi_modal_projector.": "multi_modal_projector",
    }

    def __init__(self, config: object, processor: object) -> None:
        self.config = config
        self.processor = processor

    def build_vision(self) -> VisionModule:
        """A freshly initialised vision module (weights are loaded after)."""
        raise NotImplementedError

    def num_image_tokens(self, width: int, height: int) -> int:
        """Pseudo-tokens an image of ``width`` x ``height`` pixels becomes (newlines included)."""
        raise NotImplementedError

    def fixed_image_tokens(self) -> int | None:
        """The token count when it does not depend on the image's size, else None."""
        return None
