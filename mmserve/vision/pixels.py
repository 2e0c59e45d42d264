"""Preprocessed vision-tower input of one image or frame (what crosses from the front end
to the engine instead of a decoded image)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pixels:
    """One item's tower input, made by its family's ``VisionModule.preprocess``.

    Attributes:
        mode: the mode it was prepared for (``mmserve.model.families.base.IMAGE_MODE``,
            ``BASE_MODE``, ``FRAME_MODE``); the engine uses it only for an item of that mode.
        values: normalised pixels ``[tiles, 3, H, W]`` in the vision tower's dtype, on the
            CPU (one tile for LLaVA-1.5, a frame or a OneVision base image; the base tile
            plus the grid tiles for an any-resolution image).
        image_size: ``[2]`` int64 ``(height, width)`` the processor reports for the image
            (any-resolution packing needs it), else None.
    """

    mode: str
    values: torch.Tensor
    image_size: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by ``values``."""
        return self.values.numel() * self.values.element_size()


def stack_image_sizes(items: Sequence[Pixels]) -> torch.Tensor:
    """``[N, 2]`` int64 ``(height, width)`` of any-resolution items, for transformers'
    packing.

    Raises:
        ValueError: for an item without ``image_size``.
    """
    sizes = []
    for it in items:
        if it.image_size is None:
            raise ValueError(f"a {it.mode!r} item without image_size cannot be packed")
        sizes.append(it.image_size)
    return torch.stack(sizes)
