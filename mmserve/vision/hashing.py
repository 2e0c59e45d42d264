"""Content hashing of images and their mapping to pseudo-token ids.

The image key is xxh3-128 over the decoded pixels with their mode and shape
(and palette, for palette images) plus a fingerprint of the image processor
(DESIGN.md, "Two hashes, two jobs"). Each of an image's N positions becomes a
distinct negative int64 pseudo-token id derived from the key and the position,
so text ids ``[0, vocab)`` and image ids never collide (invariant 2) and two
prompts share KV for an image exactly when its pixels and processor agree
(invariant 1).
"""

from __future__ import annotations

import json
import struct
import threading
from collections import OrderedDict

import xxhash
from PIL import Image

_KEY_DOMAIN = b"mmserve-image-key-v1\x00"


def processor_fingerprint(image_processor: object) -> bytes:
    """8-byte fingerprint of an image processor: its class and its settings.

    Args:
        image_processor: a transformers image processor.

    Returns:
        xxh3-64 digest (8 bytes) of the class's qualified name and its JSON config.
    """
    cls = type(image_processor)
    try:
        settings = image_processor.to_json_string()
    except Exception:  # a processor without JSON export still has a stable repr of its dict
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
    h.update(image.tobytes())
    h.update(fingerprint)
    return h.digest()


def pseudo_token_ids(key: bytes, num_tokens: int) -> list[int]:
    """Pseudo-token ids for an image's positions: distinct negative int64 values.

    Args:
        key: 16-byte image key.
        num_tokens: positions in the image (576 for LLaVA-1.5).

    Returns:
        ``num_tokens`` ids in ``[-2**63, -1]``; position ``i`` maps to
        ``-1 - (xxh3_64(key || i) >> 1)`` (63 bits from the key and the index).

    Raises:
        ValueError: if two positions collide (probability ~ N^2 / 2^64).
    """
    ids = [
        -1 - (xxhash.xxh3_64_intdigest(key + struct.pack("<I", i)) >> 1) for i in range(num_tokens)
    ]
    if len(set(ids)) != num_tokens:
        raise ValueError("pseudo-token id collision within one image")
    return ids


class PseudoIdCache:
    """LRU memo of :func:`pseudo_token_ids` per image key (capacity in images)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[bytes, list[int]] = OrderedDict()
        self._lock = threading.Lock()  # HTTP handlers tokenize on worker threads

    def get(self, key: bytes, num_tokens: int) -> list[int]:
        """Pseudo-ids for ``key``, computed once per key while it stays cached."""
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None and len(ids) == num_tokens:
                self._ids.move_to_end(key)
                return ids
        ids = pseudo_token_ids(key, num_tokens)
        with self._lock:
            self._ids[key] = ids
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)
        return ids
