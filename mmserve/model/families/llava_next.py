"""LLaVA-NeXT (llava-v1.6, ``model_type`` "llava_next"): any-resolution tiles.

Liu et al., "LLaVA-NeXT: Improved reasoning, OCR, and world knowledge" (2024)
and the AnyRes scheme of its predecessor: the image is resized onto the best
grid of tiles among the checkpoint's ``image_grid_pinpoints``, each tile and a
downscaled whole image go through the tower, the tile features are unpadded to
the image's aspect ratio with an ``image_newline`` after each row, and the whole
image's features come first. The token count therefore depends on the image's
size; it is asked of transformers' processor, and the packing is transformers'
own ``pack_image_features``, so neither can drift from the reference.

The ``detail: "low"`` view (:data:`BASE_MODE`) is the downscaled whole image alone: the
base tile's features and one ``image_newline``, as ``pack_image_features`` packs an image
of one tile. The ``detail: "original"`` view (:data:`ORIGINAL_MODE`) is the same
processing on one grid instead of the checkpoint's list: the one that covers the image
at its own resolution (:func:`original_pinpoint`), which is what transformers does for a
checkpoint whose ``image_grid_pinpoints`` holds that grid alone.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from PIL import Image
from torch import nn
from transformers.models.llava_next.modeling_llava_next import (
    LlavaNextModel,
    LlavaNextMultiModalProjector,
    image_size_to_num_patches,
)

from mmserve.model.families.base import (
    BASE_MODE,
    IMAGE_MODE,
    ORIGINAL_MODE,
    ModelFamily,
    VisionModule,
)
from mmserve.model.families.llava import (
    VICUNA_7B,
    clip_processors,
    llama_tokenizer,
    llava_test_config,
)
from mmserve.model.families.sizes import TEST_PATCH, TEST_WIDTHS, size_widths
from mmserve.vision.hashing import mode_key
from mmserve.vision.pixels import Pixels, stack_image_sizes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mmserve.vision.inputs import ImageInput


class LlavaNextVision(VisionModule):
    """CLIP tower, projector and ``image_newline`` of a LLaVA-NeXT checkpoint.

    Args:
        config: the ``LlavaNextConfig``.
        image_processor: its (PIL) ``LlavaNextImageProcessor``.

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer`` or an unknown strategy.
    """

    def __init__(self, config: PretrainedConfig, image_processor: Any) -> None:
        super().__init__(config, LlavaNextMultiModalProjector, image_processor)
        self.image_newline = nn.Parameter(torch.zeros(config.text_config.hidden_size))

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        """See :meth:`VisionModule.preprocess`: per image its ``[tiles, 3, H, W]`` (base
        tile first, padding tiles dropped; the base tile alone in :data:`BASE_MODE`) and
        its ``image_size``.

        Raises:
            ValueError: for a mode other than :data:`IMAGE_MODE` and :data:`BASE_MODE`.
        """
        return preprocess_anyres(
            self.image_processor, self.config, images, mode, base_only=mode == BASE_MODE
        )

    @torch.inference_mode()
    def encode_pixels(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        """See :meth:`VisionModule.encode_pixels`: every tile of every item in one tower call
        (an item of one tile, :data:`BASE_MODE`, is packed as its features and a newline)."""
        cfg = self.config
        for it in items:
            if it.mode not in (IMAGE_MODE, BASE_MODE, ORIGINAL_MODE):
                raise ValueError(f"LLaVA-NeXT has no {it.mode!r} mode")
        sizes = stack_image_sizes(items)
        counts = [it.values.shape[0] for it in items]
        pixels = torch.cat([it.values for it in items])
        feats = torch.split(self.project(pixels), counts)
        out = []
        for it, f, size in zip(items, feats, sizes, strict=True):
            # transformers' packing (unpad + newline per row + base image first) reads only
            # self.config, so it runs on a stand-in holding the config (the original
            # view's: its one grid) as it would on LlavaNextModel
            packed, _ = LlavaNextModel.pack_image_features(
                grid_holder(cfg, it.mode, size),  # type: ignore[arg-type]
                [f],
                size[None],
                cfg.vision_feature_select_strategy,
                image_newline=self.image_newline,
            )
            out.append(packed[0])
        return out


def original_pinpoint(config: PretrainedConfig, width: int, height: int) -> list[int]:
    """``[height, width]`` in pixels of the grid the ``detail: "original"`` view tiles an
    image of ``width`` x ``height`` on: whole tiles of the tower's side covering the image
    without downscaling it (``ceil(side / tile)`` per side), capped by the checkpoint's
    largest grid (``image_grid_pinpoints``: no more tiles per side, nor in all, than its
    pinpoints have). Over the cap, the grid within it that keeps the most resolution (the
    largest ``min(rows * tile / height, cols * tile / width)``, then the fewest tiles).
    """
    tile = config.vision_config.image_size
    grids = [(h // tile, w // tile) for h, w in config.image_grid_pinpoints]
    max_tiles = max(g[0] * g[1] for g in grids)
    need_r, need_c = max(1, math.ceil(height / tile)), max(1, math.ceil(width / tile))
    best = max(
        (
            (min(1.0, r * tile / height, c * tile / width), -r * c, r, c)
            for r in range(1, min(need_r, max(g[0] for g in grids)) + 1)
            for c in range(1, min(need_c, max(g[1] for g in grids)) + 1)
            if r * c <= max_tiles
        ),
    )
    return [best[2] * tile, best[3] * tile]


def _with_grid(config: PretrainedConfig, pinpoint: list[int]) -> PretrainedConfig:
    """A shallow copy of ``config`` whose ``image_grid_pinpoints`` is ``[pinpoint]``."""
    cfg = copy.copy(config)
    cfg.image_grid_pinpoints = [list(pinpoint)]
    return cfg


def grid_holder(config: PretrainedConfig, mode: str, size: torch.Tensor) -> types.SimpleNamespace:
    """What transformers' ``pack_image_features`` reads as ``self`` for an item of
    ``mode`` whose image is ``size`` (``[height, width]``): ``config`` itself, or for
    :data:`ORIGINAL_MODE` a copy holding the item's one grid (:func:`original_pinpoint`)."""
    if mode == ORIGINAL_MODE:
        h, w = (int(v) for v in size)
        config = _with_grid(config, original_pinpoint(config, w, h))
    return types.SimpleNamespace(config=config)


def original_tokens(processor: Any, config: PretrainedConfig, width: int, height: int) -> int:
    """transformers' processor's token count of the ``detail: "original"`` view: its
    ``_get_num_multimodal_tokens`` on copies of the processor and image processor whose
    ``image_grid_pinpoints`` is the image's :func:`original_pinpoint`."""
    proc = copy.copy(processor)
    proc.image_processor = copy.copy(processor.image_processor)
    proc.image_processor.image_grid_pinpoints = [original_pinpoint(config, width, height)]
    counts = proc._get_num_multimodal_tokens(image_sizes=[[height, width]])
    return int(counts["num_image_tokens"][0])


def preprocess_anyres(
    image_processor: Any,
    config: PretrainedConfig,
    images: Sequence[Image.Image],
    mode: str,
    base_only: bool = False,
    grid: list[int] | None = None,
) -> list[Pixels]:
    """The checkpoint's any-resolution image processor on ``images``: per image fp32
    ``[tiles, 3, H, W]`` (base tile first, the batch's padding tiles dropped) and its
    ``image_size`` (LLaVA-NeXT and OneVision's image mode). With ``base_only`` (LLaVA-NeXT's
    :data:`BASE_MODE`) the base tile alone, ``[1, 3, H, W]``: the grid is then asked for
    one tile only (``image_grid_pinpoints`` of one tile), which leaves the base tile as it is.
    :data:`ORIGINAL_MODE`: each image on its own grid (:func:`original_pinpoint`; ``grid``
    is that grid, ``[height, width]``, once it is known).

    Raises:
        ValueError: for a mode other than :data:`IMAGE_MODE` and :data:`ORIGINAL_MODE`
            (and :data:`BASE_MODE` with ``base_only``).
    """
    if mode == ORIGINAL_MODE and grid is None:  # one processor call per image and grid
        return [
            preprocess_anyres(
                image_processor, config, [im], mode,
                grid=original_pinpoint(config, im.width, im.height),
            )[0]
            for im in images
        ]  # fmt: skip
    if mode not in (IMAGE_MODE, ORIGINAL_MODE) and not (base_only and mode == BASE_MODE):
        raise ValueError(f"{type(config).__name__} has no {mode!r} mode here")
    kwargs: dict[str, Any] = {}
    if grid is not None:
        config = _with_grid(config, grid)
        kwargs["image_grid_pinpoints"] = config.image_grid_pinpoints
    if base_only:
        tile = config.vision_config.image_size
        kwargs["image_grid_pinpoints"] = [[tile, tile]]
    out = image_processor(images=list(images), return_tensors="pt", **kwargs)
    result = []
    for pv, size in zip(out["pixel_values"], out["image_sizes"], strict=True):
        n = (
            1
            if base_only
            else image_size_to_num_patches(
                size, config.image_grid_pinpoints, config.vision_config.image_size
            )
        )
        result.append(Pixels(mode, pv[:n].clone(), size.clone()))
    return result


class LlavaNextFamily(ModelFamily):
    """LLaVA-NeXT: base tile + unpadded grid + one newline per row, per image."""

    model_type: ClassVar[str] = "llava_next"
    name: ClassVar[str] = "llava-next"
    vision_prefixes: ClassVar[dict[str, str]] = {
        **ModelFamily.vision_prefixes,
        "image_newline": "image_newline",
    }

    def build_vision(self) -> LlavaNextVision:
        return LlavaNextVision(self.config, self.processor.image_processor)

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        return preprocess_anyres(
            self.processor.image_processor, self.config, images, mode, base_only=mode == BASE_MODE
        )

    def num_image_tokens(self, width: int, height: int) -> int:
        data = self.processor._get_num_multimodal_tokens(image_sizes=[[height, width]])
        return int(data["num_image_tokens"][0])

    def low_mode(self) -> str:
        """:data:`BASE_MODE`: the base tile and one newline."""
        return BASE_MODE

    def original_mode(self, num_images: int) -> str:
        """:data:`ORIGINAL_MODE`: the grid covering the image at its own resolution."""
        return ORIGINAL_MODE

    def mode_tokens(self, width: int, height: int, mode: str) -> int:
        """:data:`BASE_MODE`: the base tile's patches (CLS too for the "full" strategy) and
        one newline, whatever the image's size; :data:`ORIGINAL_MODE`: transformers'
        count on the image's own grid (:func:`original_tokens`)."""
        if mode == ORIGINAL_MODE:
            return original_tokens(self.processor, self.config, width, height)
        if mode != BASE_MODE:
            return super().mode_tokens(width, height, mode)
        vc = self.config.vision_config
        full = self.config.vision_feature_select_strategy == "full"
        return (vc.image_size // vc.patch_size) ** 2 + full + 1

    def mode_item(self, image: ImageInput, mode: str) -> ImageInput:
        """``image`` in ``mode``: a :data:`BASE_MODE` or :data:`ORIGINAL_MODE` item has its
        own key, so its features and KV never mix with the tiled view's."""
        if mode not in (BASE_MODE, ORIGINAL_MODE):
            return super().mode_item(image, mode)
        return dataclasses.replace(image, key=mode_key(image.key, mode), mode=mode, features=None)

    test_sizes: ClassVar[tuple[str, ...]] = (*TEST_WIDTHS, "llava-next-7b")

    @classmethod
    def test_config(cls, size: str) -> dict[str, Any]:
        """See :meth:`ModelFamily.test_config`: LLaVA-1.5's widths on the tiles of
        :data:`NEXT_TILES`, a SentencePiece tokenizer; "llava-next-7b":
        llava-v1.6-vicuna-7b-hf's shapes and special-token ids (a byte-level BPE tokenizer).

        Raises:
            ValueError: for a size not in :attr:`test_sizes`.
        """
        widths = size_widths(cls, size, {"llava-next-7b": VICUNA_7B})
        real = size not in TEST_WIDTHS
        max_length = widths["text"]["max_position_embeddings"]
        tokenizer = llama_tokenizer("bpe" if real else "sentencepiece", real, max_length)
        tile, pinpoints = NEXT_TILES[size]
        base = llava_test_config(widths, tokenizer, tile)
        shared: tuple[str, ...] = (
            "vision_config", "text_config", "image_token_index", "projector_hidden_act"
        )  # fmt: skip
        shared += ("vision_feature_select_strategy", "vision_feature_layer", "tie_word_embeddings")
        config = dict(
            model_type=cls.model_type,
            architectures=["LlavaNextForConditionalGeneration"],
            **{k: base[k] for k in shared},
            image_grid_pinpoints=pinpoints,
            image_seq_length=(tile // TEST_PATCH) ** 2,
        )
        return {
            "config": config,
            "tokenizer": tokenizer,
            **clip_processors(tile, pinpoints),
            "real": real,
        }


#: Test tile side (pixels) and grid pinpoints per size: small tiles keep a CPU prefill
#: short; real llava-v1.6 checkpoints use 336-px tiles.
NEXT_TILES: dict[str, tuple[int, list[list[int]]]] = {
    "tiny": (112, [[112, 224], [224, 112], [224, 224], [112, 336], [336, 112]]),
    "small": (168, [[168, 336], [336, 168], [336, 336], [168, 504], [504, 168]]),
    "llava-next-7b": (336, [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]),
}
