"""Bounded, content-addressed store of uploaded images.

The id is the image key (xxh3-128 of decoded pixels + processor fingerprint),
so uploading the same pixels again returns the same id. A bytes memo
(xxh3-64 of the file -> id) lets a repeated upload skip decoding; it never
decides sharing by itself (DESIGN.md, "Two hashes, two jobs").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import xxhash

from mmserve.engine.request import ImageInput


class ImageStore:
    """LRU store of decoded images bounded by count and decoded bytes.

    Args:
        prepare: decodes and hashes bytes (``Engine.prepare_image``).
        max_images: most images kept.
        max_bytes: most decoded pixel bytes kept.
    """

    def __init__(
        self,
        prepare: Callable[[bytes], ImageInput],
        max_images: int = 256,
        max_bytes: int = 1 << 30,
    ) -> None:
        self.prepare = prepare
        self.max_images = max_images
        self.max_bytes = max_bytes
        self._images: OrderedDict[str, ImageInput] = OrderedDict()
        self._memo: dict[int, str] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes) -> ImageInput:
        """Decode (unless memoised), store and return an image.

        Raises:
            ImageError: if the bytes are not an acceptable image.
        """
        digest = xxhash.xxh3_64_intdigest(data)
        with self._lock:
            known = self._memo.get(digest)
            if known is not None and known in self._images:
                self._images.move_to_end(known)
                return self._images[known]
        image = self.prepare(data)
        with self._lock:
            if image.id not in self._images:
                self._images[image.id] = image
                self._bytes += _size(image)
            self._images.move_to_end(image.id)
            self._memo[digest] = image.id
            while len(self._images) > self.max_images or self._bytes > self.max_bytes:
                _, old = self._images.popitem(last=False)
                self._bytes -= _size(old)
            if len(self._memo) > 4 * self.max_images:
                self._memo = {d: i for d, i in self._memo.items() if i in self._images}
        return image

    def get(self, image_id: str) -> ImageInput | None:
        """The stored image or None."""
        with self._lock:
            image = self._images.get(image_id)
            if image is not None:
                self._images.move_to_end(image_id)
            return image

    def __len__(self) -> int:
        return len(self._images)


def _size(image: ImageInput) -> int:
    im = image.image
    return im.width * im.height * max(1, len(im.getbands()))
