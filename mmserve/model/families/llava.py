"""LLaVA-1.5 (``model_type`` "llava"): a fixed grid of patch features per image.

Features follow Liu et al., "Improved Baselines with Visual Instruction Tuning"
(arXiv 2310.03744, Section 3.1): hidden states of ``vision_feature_layer``, CLS
dropped for the "default" strategy, a two-layer GELU MLP into the decoder. A live
stream's frames (``/v1/streams``) are images, one per frame after its ``Frame at 1.5s:``
label (:meth:`ModelFamily.stream_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from PIL import Image
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from mmserve.model.families.base import IMAGE_MODE, ModelFamily, VisionModule
from mmserve.model.families.sizes import TEST_PATCH, TEST_WIDTHS, size_widths, special_token_ids
from mmserve.vision.pixels import Pixels

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlavaVision(VisionModule):
    """CLIP vision tower + LLaVA projector, with the checkpoint's image processor.

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer`` or an unknown
            ``vision_feature_select_strategy``.
    """

    def __init__(self, config: PretrainedConfig, image_processor: Any) -> None:
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
    image_processor: Any, images: Sequence[Image.Image], mode: str
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

    test_sizes: ClassVar[tuple[str, ...]] = (*TEST_WIDTHS, "llava-1.5-7b")

    @classmethod
    def test_config(cls, size: str) -> dict[str, Any]:
        """See :meth:`ModelFamily.test_config`: CLIP at 336 px (576 tokens per image), a
        Llama decoder, a byte-level BPE tokenizer; "llava-1.5-7b": llava-1.5-7b-hf's shapes
        and special-token ids.

        Raises:
            ValueError: for a size not in :attr:`test_sizes`.
        """
        widths = size_widths(cls, size, {"llava-1.5-7b": VICUNA_7B})
        real = size not in TEST_WIDTHS
        tokenizer = llama_tokenizer("bpe", real, widths["text"]["max_position_embeddings"])
        return {
            "config": llava_test_config(widths, tokenizer, LLAVA_TILE),
            "tokenizer": tokenizer,
            **clip_processors(LLAVA_TILE),
            "real": real,
        }


# ---- seeded test checkpoints (LLaVA-1.5's; LLaVA-NeXT's build on them) --------------------

#: LLaVA-1.5's image side (pixels): (336 / 14)^2 = 576 patches.
LLAVA_TILE = 336
#: Mean and std of CLIP's image processor.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
#: Llama's special tokens in the test tokenizers' id order, then LLaVA's ``<image>``.
LLAMA_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
#: The widths of llava-1.5-7b-hf and llava-v1.6-vicuna-7b-hf, as in their config.json:
#: CLIP ViT-L/14 and Vicuna-7B (Llama; 32,064 embedding rows).
VICUNA_7B = {
    "vision": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                   intermediate_size=4096, projection_dim=768),
    "text": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32064,
                 max_position_embeddings=4096, head_dim=128),
}  # fmt: skip


def llama_tokenizer(kind: str, real: bool, max_length: int) -> dict[str, Any]:
    """A Llama-style test tokenizer (:meth:`ModelFamily.test_config`'s ``"tokenizer"``):
    ``<unk>`` 0, ``<s>`` 1 (put before every sequence), ``</s>`` 2, ``<pad>`` 3,
    ``<image>`` 4. ``kind`` "bpe" (byte-level) or "sentencepiece" (a ``tokenizer.model``
    read as transformers' ``LlamaTokenizer``, as llava-v1.6 checkpoints have); ``real``
    (bpe only): Llama's 32,000 regular ids, then ``<image>`` 32000 and ``<pad>`` 32001 as
    in llava-hf's checkpoints."""
    tail = ["<image>", "<pad>"]
    settings: dict[str, Any] = {}
    if kind == "sentencepiece":
        settings = dict(tokenizer_class="LlamaTokenizer", legacy=False, add_bos_token=True,
                        add_eos_token=False)  # fmt: skip
    settings.update(
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        model_max_length=max_length,
    )
    return {
        "kind": kind,
        "specials": [t for t in LLAMA_SPECIALS if not (real and t in tail)],
        "padded": [32000, tail] if real else None,
        "prepend": "<s>",
        "settings": settings,
        "chat_template": "chat_template.jinja",
    }


def llava_test_config(widths: dict[str, dict], tokenizer: dict[str, Any], tile: int) -> dict:
    """``LlavaConfig`` arguments: a CLIP tower of ``tile``-px images (quick GELU; layer -2,
    CLS dropped), a two-layer GELU projector and a Llama decoder (head_dim 64 unless the
    widths say, RoPE base 1e4), ids of ``tokenizer`` (:func:`special_token_ids`)."""
    ids = special_token_ids(tokenizer)
    vision = {"model_type": "clip_vision_model", **widths["vision"]}
    vision.setdefault("projection_dim", vision["hidden_size"])
    vision.update(image_size=tile, patch_size=TEST_PATCH, hidden_act="quick_gelu")
    tokens = dict(pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
    text = {"model_type": "llama", "head_dim": 64, **widths["text"], **tokens}
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5)
    text["tie_word_embeddings"] = False
    return dict(
        model_type="llava",
        architectures=["LlavaForConditionalGeneration"],
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        image_seq_length=(tile // TEST_PATCH) ** 2,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
        **tokens,
    )


def clip_processors(tile: int, pinpoints: list[list[int]] | None = None) -> dict[str, dict]:
    """``"image_processor"`` and ``"processor"`` of a CLIP test checkpoint: LLaVA-1.5's
    (resize + centre crop to ``tile``), or NeXT's any-resolution one with ``pinpoints``."""
    image = dict(
        size={"shortest_edge": tile},
        crop_size={"height": tile, "width": tile},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        do_convert_rgb=True,
    )
    processor = dict(patch_size=TEST_PATCH, vision_feature_select_strategy="default")
    processor["num_additional_image_tokens"] = 1  # the CLS position
    if pinpoints is None:
        return {
            "image_processor": {"class": "CLIPImageProcessorPil", **image},
            "processor": {"class": "LlavaProcessor", **processor},
        }
    anyres = "transformers.models.llava_next.image_processing_pil_llava_next."
    image.update(image_grid_pinpoints=pinpoints, do_pad=True)
    return {
        "image_processor": {"class": anyres + "LlavaNextImageProcessorPil", **image},
        "processor": {"class": "LlavaNextProcessor", **processor},
    }
