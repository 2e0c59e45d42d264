"""Content hashing of images and their mapping to pseudo-token ids.

The image key is xxh3-128 over the decoded pixels with their mode and shape
(and palette, for palette images) plus a fingerprint of the image processor
(docs/architecture.md, section 2, invariant (1)). Each of an image's N positions becomes a
distinct negative int64 pseudo-token id derived from the key and the position,
so text ids ``[0, vocab)`` and image ids never collide (invariant 2) and two
prompts share KV for an image exactly when its pixels and processor agree
(invariant 1). Pseudo-ids lie in ``[-2**63, -2]``: ``-1`` is reserved for the video
newline (:data:`VIDEO_NEWLINE_ID`), the one fixed pseudo-token.

An image processed another way than alone in its prompt (a LLaVA-OneVision image
among several, or a video frame) has its own key, :func:`mode_key`, so its run never
shares ids, features or KV with the image's own run.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import xxhash
from PIL import Image

from mmserve.lru import LRU

_KEY_DOMAIN = b"mmserve-image-key-v1\x00"
_MODE_DOMAIN = b"mmserve-mode-key-v1\x00"

#: The video newline's token id (after a video's frames, LLaVA-OneVision): a constant
#: negative id that no text id (``>= 0``) and no image pseudo-id (``<= -2``) can equal.
VIDEO_NEWLINE_ID = -1


def processor_fingerprint(image_processor: Any) -> bytes:
    """8-byte fingerprint of an image processor: its class and its settings.

    Args:
        image_processor: a transformers image processor (or any object: one without
            ``to_json_string`` is fingerprinted by its attributes).

    Returns:
        xxh3-64 digest (8 bytes) of the class's qualified name and its JSON config.
    """
    cls = type(image_processor)
    try:
        settings = image_processor.to_json_string()
    except Exception:  # noqa: BLE001 - without JSON export: the stable repr of its dict
        settings = json.dumps(vars(image_processor), sort_keys=True, default=str)
    h = xxhash.xxh3_64()
    h.update(f"{cls.__module__}.{cls.__qualname__}\x00".encode())
    h.update(settings.encode())
    return h.digest()


def image_key(image: Image.Image, fingerprint: bytes) -> bytes:
    """128-bit content key of a decoded image.

    Args:
        image: a loaded PIL image (after EXIF orientation), in its original mode.
        fingerprint: :func:`processor_fingerprint` of the processor that will read it.

    Returns:
        16-byte xxh3-128 digest of mode, width, height, palette and transparency
        colour (when present), pixels and fingerprint.
    """
    h = xxhash.xxh3_128()
    h.update(_KEY_DOMAIN)
    h.update(f"{image.mode}\x00".encode())
    h.update(struct.pack("<II", image.width, image.height))
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette is not None:
        h.update(bytes(palette))
        h.update(repr(image.info.get("transparency")).encode())
    elif "transparency" in image.info:
        # an L/RGB tRNS colour makes the processor composite those pixels on white
        h.update(b"\x00trns\x00" + repr(image.info["transparency"]).encode())
    for chunk in _pixel_chunks(image):
        h.update(chunk)
    h.update(fingerprint)
    return h.digest()


#: Bytes of pixels hashed per chunk: a huge image is hashed in bands of rows rather than
#: copied whole (``tobytes`` of a 6000x6000 RGB image is another 108 MB).
_CHUNK_BYTES = 8 << 20


def _pixel_chunks(image: Image.Image) -> Iterator[bytes]:
    """``image.tobytes()`` in consecutive bands of whole rows (their concatenation is
    exactly ``tobytes()``: Pillow packs each row on its own, so xxh3's streaming digest
    over the bands equals that of the whole)."""
    w, h = image.size
    row = max(1, len(image.crop((0, 0, w, 1)).tobytes())) if h else 1
    if row * h <= _CHUNK_BYTES:
        yield image.tobytes()
        return
    step = max(1, _CHUNK_BYTES // row)
    for y in range(0, h, step):
        yield image.crop((0, y, w, min(h, y + step))).tobytes()


def pseudo_token_ids(key: bytes, num_tokens: int) -> list[int]:
    """Pseudo-token ids for an image's positions: distinct negative int64 values.

    Args:
        key: 16-byte image key.
        num_tokens: positions in the image (576 for LLaVA-1.5).

    Returns:
        ``num_tokens`` ids in ``[-2**63, -2]``; position ``i`` maps to
        ``-2 - ((xxh3_64(key || i) >> 1) mod (2**63 - 1))`` (63 bits from the key and the
        index; ``-1`` stays free for :data:`VIDEO_NEWLINE_ID`).

    Raises:
        ValueError: if two positions collide (probability ~ N^2 / 2^64).
    """
    span = (1 << 63) - 1
    ids = [
        -2 - ((xxhash.xxh3_64_intdigest(key + struct.pack("<I", i)) >> 1) % span)
        for i in range(num_tokens)
    ]
    if len(set(ids)) != num_tokens:
        raise ValueError("pseudo-token id collision within one image")
    return ids


def mode_key(key: bytes, mode: str, fingerprint: bytes = b"") -> bytes:
    """The content key of an image processed in ``mode`` (not the family's default).

    Args:
        key: the image's :func:`image_key`.
        mode: the processing mode's name ("base", "frame", ...).
        fingerprint: settings of that mode's processing beyond the image processor's
            (the video processor's :func:`processor_fingerprint` for frames).

    Returns:
        16-byte xxh3-128 digest of the mode, the key and the fingerprint: distinct from
        ``key`` and from the key in any other mode.
    """
    h = xxhash.xxh3_128()
    h.update(_MODE_DOMAIN)
    h.update(mode.encode() + b"\x00")
    h.update(key)
    h.update(fingerprint)
    return h.digest()


class PseudoIdCache:
    """LRU memo of :func:`pseudo_token_ids` per image key (capacity in images; HTTP
    handlers tokenize on worker threads, the LRU is thread-safe)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: LRU[bytes, list[int]] = LRU(max_items=capacity)

    def get(self, key: bytes, num_tokens: int) -> list[int]:
        """Pseudo-ids for ``key``, computed once per key while it stays cached."""
        ids = self._ids.get(key)
        if ids is not None and len(ids) == num_tokens:
            return ids
        ids = pseudo_token_ids(key, num_tokens)
        self._ids.put(key, ids)
        return ids
