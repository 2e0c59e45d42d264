"""The image items of a prompt: what the front end makes of an image or video frame
(:class:`ImageInput`, :class:`Frame`) and where its features go (:class:`ImageSpan`).

They live below the engine because the model families take them
(``ModelFamily.preprocess``, ``VisionModule.encode_pixels``); the front end, the
engine and :mod:`mmserve.types` import them from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image

from mmserve.vision.hashing import VIDEO_NEWLINE_ID
from mmserve.vision.pixels import Pixels


@dataclass
class ImageInput:
    """An image (or video frame) of a prompt: its content key and what the engine needs to
    get its features.

    The front end (:class:`~mmserve.frontend.processor.InputProcessor`) decodes, hashes and
    preprocesses an image on a request thread and then drops the decoded image, so an
    item that reaches the engine holds ``pixels`` (the tower must run) or ``features``
    (the embedding cache held them when the request was made; the request keeps a
    reference so that an eviction in between cannot leave it without them). ``image`` is
    the decoded image only while the front end works on it (or for callers that build
    items by hand; the engine then preprocesses it itself).

    Attributes:
        key: 16-byte xxh3-128 image key (for a ``mode`` other than "image", the key
            derived for that mode, :func:`mmserve.vision.hashing.mode_key`).
        image: the decoded PIL image (original mode, EXIF-rotated), or None once dropped.
        mode: how the family turns it into features
            (:data:`mmserve.model.families.base.IMAGE_MODE` and the others there).
        width, height: the decoded image's size (pixels); taken from ``image`` when 0.
        pixels: the tower input prepared for ``pixels.mode`` (used only when it equals
            ``mode``), or None.
        features: ``[tokens, text_hidden]`` features found in the embedding cache for
            ``key``, or None.
        source: the encoded file, kept until the request is built so the front end can
            decode it again if it must prepare another mode; None for video frames and
            in requests (but for an image the API process sends the engine process by
            key: kept there in case the engine no longer holds its features).
        video: a frame sampled from a video (its positions count as video tokens in
            usage, also where the family takes it as an image).
    """

    key: bytes
    image: Image.Image | None = None
    mode: str = "image"
    width: int = 0
    height: int = 0
    pixels: Pixels | None = field(default=None, repr=False)
    features: torch.Tensor | None = field(default=None, repr=False)
    source: bytes | None = field(default=None, repr=False)
    video: bool = False

    def __post_init__(self) -> None:
        if self.image is not None and not self.width:
            self.width, self.height = self.image.size

    @property
    def id(self) -> str:
        """Hex form of the key, used as the public image id."""
        return "img-" + self.key.hex()

    @property
    def has_pixels(self) -> bool:
        """Whether it carries its tower input for its own mode."""
        return self.pixels is not None and self.pixels.mode == self.mode

    @property
    def ready(self) -> bool:
        """Whether the engine can get its features without the decoded image."""
        return self.features is not None or self.has_pixels


#: :attr:`ImageSpan.modality` values (with "text", the labels of per-modality counts).
MODALITIES = ("text", "image", "video")


@dataclass
class ImageSpan:
    """Positions ``[start, start + length)`` of a prompt filled by one image's features;
    ``modality`` is "image", or "video" for a video's frame."""

    start: int
    length: int
    image: ImageInput
    modality: str = "image"

    @property
    def end(self) -> int:
        """One past the last position."""
        return self.start + self.length


@dataclass
class Frame:
    """A frame sampled from a video: its index in the video, its time (seconds) and its
    hashed image (its tower input prepared, or its decoded image, see
    :meth:`~mmserve.frontend.processor.InputProcessor.sample_frames`)."""

    index: int
    timestamp: float
    image: ImageInput


def media_tokens(input_ids: Sequence[int], spans: Sequence[ImageSpan]) -> tuple[int, int]:
    """``(image, video)`` tokens of a prompt: its image spans' positions, and its video
    frames' positions plus each video's newline (:data:`VIDEO_NEWLINE_ID`). The rest of
    ``input_ids`` is text.

    Args:
        input_ids: the prompt's token ids (pseudo-ids at image positions).
        spans: its image runs.
    """
    image = sum(s.length for s in spans if s.modality == "image")
    video = sum(s.length for s in spans if s.modality == "video")
    if video:
        video += sum(1 for t in input_ids if t == VIDEO_NEWLINE_ID)
    return image, video
