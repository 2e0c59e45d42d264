"""Decode uploaded image bytes with Pillow, checking limits before the expensive steps.

Decoding applies the EXIF orientation (the image a viewer shows) and keeps the
original mode when it has 8 bits per sample, so the checkpoint's image processor
converts it exactly as transformers would. Modes with more bits per sample (``I;16``
and its variants, ``I``, ``F``) are first scaled to 8-bit ``L`` as a viewer shows
them (:func:`to_8bit`), before hashing and before the processor.
Unlike transformers, which clips such images to 255 (a 16-bit scan reads as white),
so answers about them differ from transformers on purpose.
Animated images use their first frame. The header size is checked before any pixel
is decoded, and the size the CLIP processor would resize to is checked before
resizing. Decoder messages are passed through :func:`clean_decoder_message` so that
no server-side path or native stack trace reaches a client.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageMode, ImageOps, UnidentifiedImageError


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


def decode_image(
    data: bytes,
    limits: ImageLimits,
    shortest_edge: int = 336,
    before_decode: Callable[[Image.Image], None] | None = None,
) -> Image.Image:
    """Decode bytes into a loaded PIL image in its original mode, EXIF-rotated.

    Pillow's ``draft`` (JPEG: decode at 1/2, 1/4 or 1/8 scale) and ``reduce`` would cut
    the decode cost of a huge image, but both change the pixels the processor resizes
    from, hence the key and the answer (transformers decodes at full size), so neither
    is used: the budgets of :mod:`mmserve.vision.budget` bound the cost instead.

    Args:
        data: the encoded file (PNG, JPEG, GIF, WebP, ...).
        limits: bounds to enforce.
        shortest_edge: the processor's resize target for the short side (pixels).
        before_decode: called with the opened, not yet decoded image once its header
            passed the size checks (budgets charge it here); what it raises propagates.

    Returns:
        A fully loaded ``PIL.Image.Image`` (first frame for animations); images with
        more than 8 bits per sample come back as 8-bit ``L`` (see :func:`to_8bit`).

    Raises:
        ImageError: empty, over-size, undecodable or truncated data, or a size
            beyond ``limits``. The message never holds a server-side path.
    """
    if not data:
        raise ImageError("image is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:  # header alone claims far too many pixels
        raise ImageError(f"image refused before decoding: {clean_decoder_message(e)}") from None
    except UnidentifiedImageError:
        raise ImageError("data is not a decodable image (unknown or corrupt format)") from None
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for corrupt headers
        raise ImageError(f"cannot read image header: {clean_decoder_message(e)}") from None
    w, h = im.size
    check_size(w, h, limits, shortest_edge)
    if before_decode is not None:
        before_decode(im)
    try:
        if getattr(im, "n_frames", 1) > 1:
            im.seek(0)
        im.load()
        # in place: without an orientation tag the default returns a copy (a 6000x6000
        # image is 108 MB more at the peak)
        ImageOps.exif_transpose(im, in_place=True)
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for corrupt data
        raise ImageError(f"image is truncated or corrupt: {clean_decoder_message(e)}") from None
    return to_8bit(im)


def to_8bit(im: Image.Image) -> Image.Image:
    """Scale an image with more than 8 bits per sample to 8-bit grey (mode ``L``).

    Pillow's own ``convert("RGB")`` (what transformers does) clips every value above
    255, so a 16-bit scan or depth map would read as a white picture. Instead:

    * ``I;16``, ``I;16B``, ``I;16L``, ``I;16N``, and ``I`` whose values all lie in
      0..65535: ``round(v / 257)``, so a 16-bit image stored as ``v * 257`` becomes
      exactly its 8-bit version (same pixels, same key, same answer).
    * ``I`` with values outside 0..65535, and ``F``: the finite values' min..max is
      stretched linearly to 0..255 (``floor((v - min) * 255 / (max - min) + 0.5)``);
      a constant image becomes mid-grey 128. In ``F``, ``+inf`` becomes 255 and
      ``-inf`` and NaN become 0 (missing data reads as black, as 0 does in a
      16-bit depth map); they do not take part in min..max.

    Args:
        im: a loaded PIL image in any mode.

    Returns:
        ``im`` itself when its mode has at most 8 bits per sample (``1``, ``L``, ``P``,
        ``RGB``, ``CMYK``, ...), else a new ``L`` image of the same size (info kept).
    """
    if ImageMode.getmode(im.mode).typestr.endswith(("u1", "b1")):
        return im
    a = np.asarray(im)
    if a.dtype.kind in "ui" and (a.size == 0 or (int(a.min()) >= 0 and int(a.max()) <= 65535)):
        # integer round half up; v / 257 never ends in exactly .5 for integer v
        out = (a.astype(np.uint32) * 2 + 257) // 514
    else:
        out = _stretch(a.astype(np.float64))
    result = Image.fromarray(out.astype(np.uint8), "L")
    result.info.update(im.info)
    return result


def _stretch(a: np.ndarray) -> np.ndarray:
    """min..max of the finite values to 0..255; +inf -> 255, -inf and NaN -> 0."""
    finite = np.isfinite(a)
    out = np.zeros(a.shape, dtype=np.float64)
    out[a == np.inf] = 255.0
    if finite.any():
        lo, hi = float(a[finite].min()), float(a[finite].max())
        if hi > lo:
            # (v - lo) / (hi - lo) first: float64 keeps it in 0..1 even for +-3.4e38 spans
            scaled = np.floor((a[finite] - lo) / (hi - lo) * 255.0 + 0.5)
            out[finite] = np.clip(scaled, 0.0, 255.0)
        else:
            out[finite] = 128.0
    return out


# decord/dmlc messages start with "[12:34:56] /build/dir/src/file.cc:218: " and may end
# with a native stack trace; Pillow's can name files. Clients get the short reason only.
_STACK = re.compile(r"(?is)\bstack trace\b.*$")
_LOG_TIME = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]")
_SOURCE = re.compile(
    r"\S*\.(?:cc|cpp|cxx|c|cu|h|hh|hpp|so(?:\.\d+)*|dylib|dll|py)\b(?::\d+|\(\d+\))*:?"
)
_PATH = re.compile(r"(?:[A-Za-z]:)?[\w.~+@%-]*(?:[\\/][\w.~+@%-]*)+")
_CHECK = re.compile(r"Check failed:.*?\(\S+ vs\. \S+\)\s*")
_EMPTY = re.compile(r"\[\s*\]|\(\s*\)|'\s*'|\"\s*\"")


def clean_decoder_message(e: BaseException | str, limit: int = 200) -> str:
    """The short reason of a decoder error, safe to show to a client.

    Drops native stack traces, log time stamps, anything that looks like a filesystem
    path (a word with ``/`` or ``\\``), source and library file names (``.cc``, ``.so``,
    ...) and dmlc ``Check failed: expr (a vs. b)`` assertions, then keeps the first
    non-empty line.

    Args:
        e: the exception (or its text).
        limit: most characters kept.

    Returns:
        The cleaned reason, or the exception's type name (``"decoder error"`` for a
        string) when nothing readable is left.
    """
    text = _STACK.sub("", str(e))
    for pattern in (_LOG_TIME, _CHECK, _SOURCE, _PATH, _EMPTY):
        text = pattern.sub(" ", text)
    for line in text.splitlines():
        line = " ".join(line.split()).strip(" :;,")
        if line:
            return line[:limit]
    return type(e).__name__ if isinstance(e, BaseException) else "decoder error"


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
