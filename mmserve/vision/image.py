"""Decode uploaded image bytes with Pillow, checking limits before the expensive steps.

Decoding applies the EXIF orientation (the image a viewer shows) and keeps the
original mode, so the checkpoint's image processor converts it exactly as
transformers would. Animated images use their first frame. The header size is
checked before any pixel is decoded, and the size the CLIP processor would
resize to is checked before resizing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError


class ImageError(ValueError):
    """An image that cannot be accepted; the message says why (maps to HTTP 400)."""


@dataclass(frozen=True)
class ImageLimits:
    """Bounds checked on every image.

    Attributes:
        max_bytes: largest encoded upload (bytes).
        max_pixels: largest width*height claimed by the header (pixels).
        max_side: largest width or height (pixels).
        max_resized_side: largest side after the processor's shortest-edge resize
            (pixels); a 1x900 image would become 336x302400.
    """

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_side: int = 16384
    max_resized_side: int = 336 * 16


def decode_image(data: bytes, limits: ImageLimits, shortest_edge: int = 336) -> Image.Image:
    """Decode bytes into a loaded PIL image in its original mode, EXIF-rotated.

    Args:
        data: the encoded file (PNG, JPEG, GIF, WebP, ...).
        limits: bounds to enforce.
        shortest_edge: the processor's resize target for the short side (pixels).

    Returns:
        A fully loaded ``PIL.Image.Image`` (first frame for animations).

    Raises:
        ImageError: empty, over-size, undecodable or truncated data, or a size
            beyond ``limits``.
    """
    if not data:
        raise ImageError("image is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:  # header alone claims far too many pixels
        raise ImageError(f"image refused before decoding: {e}") from None
    except UnidentifiedImageError:
        raise ImageError("data is not a decodable image (unknown or corrupt format)") from None
    except Exception as e:  # Pillow raises many types for corrupt headers
        raise ImageError(f"cannot read image header: {e}") from None
    w, h = im.size
    check_size(w, h, limits, shortest_edge)
    try:
        if getattr(im, "n_frames", 1) > 1:
            im.seek(0)
        im.load()
        im = ImageOps.exif_transpose(im)
    except Exception as e:
        raise ImageError(f"image is truncated or corrupt: {e}") from None
    return im


def check_size(width: int, height: int, limits: ImageLimits, shortest_edge: int = 336) -> None:
    """Refuse sizes that are empty, too large, or resize to something huge.

    Raises:
        ImageError: with the offending dimensions in the message.
    """
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels ({width}x{height})")
    if width > limits.max_side or height > limits.max_side or width * height > limits.max_pixels:
        raise ImageError(
            f"image is {width}x{height} pixels; limits are {limits.max_side} per side and "
            f"{limits.max_pixels} pixels in all"
        )
    short, long = min(width, height), max(width, height)
    resized_long = long * shortest_edge / short
    if resized_long > limits.max_resized_side:
        raise ImageError(
            f"image aspect ratio {width}x{height} is too extreme: resizing its short side to "
            f"{shortest_edge} would make the long side {int(resized_long)} pixels "
            f"(limit {limits.max_resized_side})"
        )
