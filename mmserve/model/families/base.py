"""The interface every model family implements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from PIL import Image
from torch import nn
from transformers import AutoModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mmserve.vision.inputs import ImageInput, ImageSpan
    from mmserve.vision.pixels import Pixels

#: How an image is turned into features. ``IMAGE_MODE``: the family's own processing of
#: an image (the only mode of LLaVA-1.5). ``BASE_MODE``: one downscaled view of the whole
#: image and a newline, no tiles: LLaVA-OneVision's image in a prompt with several images
#: (one padded square tile + newline), and the ``detail: "low"`` view of LLaVA-NeXT and
#: LLaVA-OneVision.
#: ``FRAME_MODE``: a video frame on a family's video path (pooled features, no newline).
#: ``ORIGINAL_MODE``: the ``detail: "original"`` view of the any-resolution families: the
#: grid of tiles that covers the image at its own resolution, capped by the model's
#: largest grid (:func:`mmserve.model.families.llava_next.original_pinpoint`).
#: A mode other than ``IMAGE_MODE`` has its own content key
#: (:func:`mmserve.vision.hashing.mode_key`), so its features and KV never mix with another's.
IMAGE_MODE = "image"
BASE_MODE = "base"
FRAME_MODE = "frame"
ORIGINAL_MODE = "original"

#: OpenAI's ``detail`` values of an image part: "low" is the family's single base view
#: (:meth:`ModelFamily.low_mode`), "high" what the family does for the prompt, "auto" = "high",
#: "original" the image at its own resolution within the family's limits
#: (:meth:`ModelFamily.original_mode`).
DETAILS = ("auto", "low", "high", "original")


def check_vision_config(config: PretrainedConfig) -> None:
    """Refuse vision settings no family here implements.

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer`` or an unknown
            ``vision_feature_select_strategy``.
    """
    if not isinstance(config.vision_feature_layer, int):
        raise ValueError("only an integer vision_feature_layer is supported")
    if config.vision_feature_select_strategy not in ("default", "full"):
        raise ValueError(
            f"unknown vision_feature_select_strategy {config.vision_feature_select_strategy!r}"
        )


class VisionModule(nn.Module):
    """A family's vision side: preprocessing (front end) and encoding (engine).

    :meth:`preprocess` runs on the front end's threads (it only reads the image
    processor's settings and the tower's dtype); :meth:`encode_pixels` runs on the engine
    thread. Subclasses implement those two; :meth:`encode` and :meth:`encode_items` chain
    them for callers that still hold decoded images (tests, benchmarks). :meth:`project`
    is the tower -> feature-select -> projector path their :meth:`encode_pixels` share.

    Args:
        config: the checkpoint's LLaVA-family config (checked by :func:`check_vision_config`).
        projector: the family's transformers projector class, built as ``projector(config)``.
        image_processor: the checkpoint's image processor (``Any``: transformers'
            processors set their attributes per class).

    Raises:
        ValueError: for a multi-layer ``vision_feature_layer`` or an unknown
            ``vision_feature_select_strategy``.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        projector: Callable[[Any], nn.Module],
        image_processor: Any,
    ) -> None:
        super().__init__()
        check_vision_config(config)
        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = projector(config)
        self.image_processor = image_processor

    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode and project tiles, as transformers' LLaVA ``get_image_features`` does: the
        tower's hidden states at ``config.vision_feature_layer``, the CLS position dropped
        for the "default" ``vision_feature_select_strategy``, then the
        ``multi_modal_projector`` (Liu et al., arXiv 2310.03744, Section 3.1).

        Args:
            pixels: ``[N, 3, H, W]`` normalised pixels, any dtype and device (cast to the
                tower's).

        Returns:
            ``[N, patches, text_hidden]`` in the model's dtype.
        """
        cfg = self.config
        p = next(self.vision_tower.parameters())
        out = self.vision_tower(
            pixels.to(p.device, p.dtype), output_hidden_states=True, return_dict=True
        )
        hidden = out.hidden_states[cfg.vision_feature_layer]
        if cfg.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]
        return self.multi_modal_projector(hidden)

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        """The family's transformers image processing of ``images`` in ``mode``: one fp32
        :class:`~mmserve.vision.pixels.Pixels` per image, equal to what a batched call
        gives it (the processors treat images independently).

        Raises:
            ValueError: for a mode this family does not have.
        """
        raise NotImplementedError

    def encode_pixels(self, items: Sequence[Pixels]) -> list[torch.Tensor]:
        """Encode and project preprocessed items (one tower call per mode present).

        Returns:
            One ``[tokens, text_hidden]`` tensor per item, in the model's dtype, in order.

        Raises:
            ValueError: for a mode this family does not have.
        """
        raise NotImplementedError

    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """Preprocess, encode and project ``images`` (:data:`IMAGE_MODE`).

        Returns:
            One ``[num_image_tokens(image), text_hidden]`` tensor per image, in the
            model's dtype, in the order given.
        """
        return self.encode_pixels(self.preprocess(images, IMAGE_MODE))

    def encode_items(self, items: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Features of prompt items that hold decoded images, each in its own ``mode``.

        Returns:
            One ``[tokens, text_hidden]`` tensor per item, in order.

        Raises:
            ValueError: for a mode this family does not have, or an item whose image was
                dropped.
        """
        pixels = []
        for it in items:
            if it.image is None:
                raise ValueError("encode_items needs the decoded image of every item")
            pixels.append(self.preprocess([it.image], it.mode)[0])
        return self.encode_pixels(pixels)

    def token_embeddings(self) -> dict[int, torch.Tensor]:
        """Embeddings ``[text_hidden]`` of the reserved negative token ids this module
        defines (the video newline of :data:`mmserve.vision.hashing.VIDEO_NEWLINE_ID`);
        empty by default."""
        return {}


class ModelFamily:
    """What one LLaVA variant needs beyond the shared Llama decoder.

    Args:
        config: the checkpoint's transformers config (``LlavaConfig``, ...).
        processor: its transformers processor (tokenizer + image processor; ``Any``:
            transformers' processors set their attributes per class).

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

    def __init__(self, config: PretrainedConfig, processor: Any) -> None:
        self.config = config
        self.processor = processor

    @classmethod
    def load_processor(cls, model_dir: Path) -> Any | None:
        """The family's processor read from ``model_dir``, or None to use transformers'
        ``AutoProcessor`` (the default). It needs ``.tokenizer`` and ``.image_processor``.

        Raises:
            Exception: whatever transformers raises for a missing or bad file (the
                loader reports it naming the directory).
        """
        return None

    @classmethod
    def check_checkpoint(cls, model_dir: Path) -> None:
        """Refuse settings in ``model_dir``'s files that the family does not implement,
        before anything loads; nothing to check by default.

        Raises:
            ValueError: naming the file and the field.
        """

    def build_vision(self) -> VisionModule:
        """A freshly initialised vision module (weights are loaded after)."""
        raise NotImplementedError

    def preprocess(self, images: Sequence[Image.Image], mode: str) -> list[Pixels]:
        """The family's transformers image processing of ``images`` in ``mode`` (what its
        vision module's :meth:`VisionModule.preprocess` does, without the module: the front
        end calls this, also where no weights are loaded). One
        :class:`~mmserve.vision.pixels.Pixels` per image, fp32, each equal to what a
        batched call gives it.

        Raises:
            ValueError: for a mode this family does not have.
        """
        raise NotImplementedError

    def num_image_tokens(self, width: int, height: int) -> int:
        """Pseudo-tokens an image of ``width`` x ``height`` pixels becomes (newlines included)."""
        raise NotImplementedError

    def fixed_image_tokens(self) -> int | None:
        """The token count when it does not depend on the image's size, else None."""
        return None

    def image_mode(self, num_images: int) -> str:
        """The mode of each image in a prompt holding ``num_images`` images (videos not
        counted); :data:`IMAGE_MODE` unless the family treats several images differently."""
        return IMAGE_MODE

    def low_mode(self) -> str:
        """The mode of an image sent with ``detail: "low"``: the family's single base view
        (:data:`BASE_MODE` for the any-resolution families; :data:`IMAGE_MODE` here, for a
        family whose images have one view)."""
        return IMAGE_MODE

    def original_mode(self, num_images: int) -> str:
        """The mode of an image sent with ``detail: "original"``: :meth:`image_mode` here
        (a family whose images have one size, LLaVA-1.5: as "high"); the any-resolution
        families answer :data:`ORIGINAL_MODE`."""
        return self.image_mode(num_images)

    def detail_mode(self, detail: str, num_images: int) -> str:
        """The mode of an image sent with ``detail`` (one of :data:`DETAILS`) in a prompt of
        ``num_images`` images: :meth:`low_mode` for "low", :meth:`original_mode` for
        "original", else :meth:`image_mode`.

        Raises:
            ValueError: for a ``detail`` not in :data:`DETAILS`.
        """
        if detail not in DETAILS:
            raise ValueError(f"detail must be one of {', '.join(DETAILS)}; got {detail!r}")
        if detail == "original":
            return self.original_mode(num_images)
        return self.low_mode() if detail == "low" else self.image_mode(num_images)

    def mode_tokens(self, width: int, height: int, mode: str) -> int:
        """Pseudo-tokens an image becomes in a mode other than :data:`IMAGE_MODE`.

        Raises:
            ValueError: for a mode this family does not have.
        """
        raise ValueError(f"the {self.name} family has no {mode!r} mode")

    def mode_item(self, image: ImageInput, mode: str) -> ImageInput:
        """``image`` as a prompt item in ``mode``: itself for :data:`IMAGE_MODE`, else a copy
        whose key is derived for that mode.

        Raises:
            ValueError: for a mode this family does not have.
        """
        if mode == IMAGE_MODE:
            return image
        raise ValueError(f"the {self.name} family has no {mode!r} mode")

    def video_frame_tokens(self) -> int | None:
        """Pseudo-tokens per frame on the family's video path (a video is its frames'
        runs, then one video newline where :attr:`video_newline` says), or None when the
        family has no video path (a video is then sent as its frames, each an image)."""
        return None

    def stream_layout(self) -> str:
        """How a live stream's prompt (``/v1/streams``) lays out its frames: as a ``/qa``
        clip over the same frames does, so the answers are the same.

        "video" on a family with a video path (:meth:`video_frame_tokens` not None): one
        video part, the frames' runs in order; the video newline (where
        :attr:`video_newline` says) and the question come at ask time. "images"
        elsewhere: each frame an image after a ``Frame at 1.5s:`` label, in the mode of
        an image among several. Either way the prefix a stream keeps prefilled ends with
        its last frame's run (:meth:`stream_held_end`).
        """
        return "video" if self.video_frame_tokens() is not None else "images"

    def stream_held_end(self, spans: Sequence[ImageSpan]) -> int:
        """Where the prefix a stream keeps prefilled ends in a prompt over its frames
        whose image runs are ``spans`` (in order): one past the last frame's run."""
        return spans[-1].end

    #: Whether a video on the family's video path ends with one video newline
    #: (:data:`~mmserve.vision.hashing.VIDEO_NEWLINE_ID`): LLaVA-OneVision's layout;
    #: LLaVA-NeXT-Video's frames are followed by nothing.
    video_newline: ClassVar[bool] = True

    #: Sizes of the seeded test checkpoints :meth:`test_config` describes (``make-model``
    #: ``--size``): the shared ones (:data:`mmserve.model.families.sizes.TEST_WIDTHS`) and
    #: the family's real shapes, if any.
    test_sizes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def test_config(cls, size: str) -> dict[str, Any]:
        """Description of the family's seeded test checkpoint of ``size``, which
        :mod:`mmserve.testing` writes (``mmserve make-model``). Plain data, a fresh copy per
        call; nothing on the serving path reads it. Keys:

        - ``"config"``: keyword arguments of the transformers config of ``model_type``
          (``vision_config`` and ``text_config`` nested, each with its ``model_type``);
          ``architectures`` names the transformers model class; ``text_config`` without
          ``vocab_size`` takes the trained tokenizer's length. Token ids are those of
          :func:`~mmserve.model.families.sizes.special_token_ids` of the tokenizer below.
        - ``"tokenizer"``: ``kind`` ("bpe": byte-level BPE, or "sentencepiece": a Llama
          ``tokenizer.model``, which must start with ``<unk> <s> </s> <pad>``) trained on the
          bundled corpus; ``specials`` (special tokens with ids 0, 1, ...); ``padded``
          (``[regular, tail]``: the vocabulary filled up to ``regular`` ids, then the
          ``tail`` specials; None for a trained-size vocabulary); ``prepend`` (a token put
          before every sequence, or None); ``settings`` (the transformers tokenizer's
          arguments); ``chat_template`` (a file name in ``mmserve/testing/assets``).
        - ``"image_processor"`` and, for a family with videos, ``"video_processor"``:
          ``class`` (a transformers class name, or a dotted path) and its arguments.
        - ``"processor"``: ``class`` and the processor's own arguments.
        - ``"real"``: True for a real model's shapes (stored in bf16 by default, weights
          written tensor by tensor).

        Raises:
            ValueError: if ``size`` is not one of :attr:`test_sizes`.
        """
        raise ValueError(f"the {cls.name} family has no test checkpoints")
