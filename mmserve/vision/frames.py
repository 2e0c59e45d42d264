"""Preprocess video frames the way a transformers video processor documents it, without
torchvision.

transformers' video processors (``LlavaOnevisionVideoProcessor``, a
``BaseVideoProcessor``) run on torchvision, which cannot be installed beside the CPU
torch this project uses. Their configuration still loads without it (the class reads
``video_preprocessor_config.json``, the ``video_processor`` entry of
``processor_config.json`` or ``preprocessor_config.json``, with the class defaults for
what is missing), so :class:`FramePrep` takes the settings from such an instance and
:func:`prepare_frames` applies the documented steps with PIL and NumPy: convert to RGB,
resize to ``size`` (height x width) with its ``resample`` filter, rescale by
``rescale_factor`` and normalise by ``image_mean`` / ``image_std``. These are the steps
and the arithmetic of transformers' PIL image processors (resize in PIL, rescale in
float64, normalise in float32), so a square frame comes out exactly as the PIL image
processor makes a square image; torchvision's antialiased bicubic resize can differ from
PIL's by a few 1/255 steps on other frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True)
class FramePrep:
    """Video frame preprocessing settings.

    Attributes:
        height, width: output size in pixels (the vision tower's input).
        resample: PIL resampling filter (``Image.Resampling`` value; 3 = bicubic).
        rescale_factor: multiplier from 8-bit values to ``[0, 1]`` (1/255).
        image_mean, image_std: per-channel normalisation (RGB).
        do_resize, do_rescale, do_normalize, do_convert_rgb: which steps run.
    """

    height: int
    width: int
    resample: int = 3
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_processor(cls, video_processor: Any) -> FramePrep:
        """The settings of a transformers video processor instance (only read, never called;
        ``Any``: each processor class sets its own attributes).

        Raises:
            ValueError: if its ``size`` is not an explicit height and width.
        """
        size = getattr(video_processor, "size", None)
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        height, width = get("height"), get("width")
        if not height or not width:
            raise ValueError(f"video processor size must give height and width, got {size!r}")
        resample = getattr(video_processor, "resample", 3)
        return cls(
            height=int(height),
            width=int(width),
            resample=int(getattr(resample, "value", resample)),
            rescale_factor=float(video_processor.rescale_factor),
            image_mean=tuple(float(x) for x in video_processor.image_mean),
            image_std=tuple(float(x) for x in video_processor.image_std),
            do_resize=bool(video_processor.do_resize),
            do_rescale=bool(video_processor.do_rescale),
            do_normalize=bool(video_processor.do_normalize),
            do_convert_rgb=bool(getattr(video_processor, "do_convert_rgb", True)),
        )


def prepare_frames(frames: Sequence[Image.Image], prep: FramePrep) -> torch.Tensor:
    """Pixel values of video frames for the vision tower.

    Args:
        frames: decoded frames (PIL images, any size; converted to RGB when
            ``prep.do_convert_rgb``).
        prep: the settings (see :class:`FramePrep`).

    Returns:
        float32 ``[len(frames), 3, prep.height, prep.width]`` (with ``do_resize``).

    Raises:
        ValueError: for no frames, or frames of different sizes without ``do_resize``.
    """
    if not frames:
        raise ValueError("no frames to prepare")
    mean = np.asarray(prep.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(prep.image_std, dtype=np.float32)[:, None, None]
    out = []
    for im in frames:
        if prep.do_convert_rgb and im.mode != "RGB":
            im = im.convert("RGB")
        if prep.do_resize and im.size != (prep.width, prep.height):
            im = im.resize((prep.width, prep.height), resample=Image.Resampling(prep.resample))
        x = np.moveaxis(np.asarray(im), -1, 0)  # [3, H, W] uint8
        if prep.do_rescale:
            x = (x.astype(np.float64) * prep.rescale_factor).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if prep.do_normalize:
            x = (x - mean) / std
        out.append(x)
    if len({x.shape for x in out}) != 1:
        raise ValueError("frames of different sizes need do_resize")
    return torch.from_numpy(np.stack(out))
