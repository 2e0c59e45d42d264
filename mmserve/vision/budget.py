"""Bounds on decoded pixels: per request and server-wide, and handing freed heap back.

A 6000x6000 PNG is about 100 KB on the wire and 108 MB decoded, so the bytes of a request
say nothing about the memory its images take. Two budgets bound that memory:

- :class:`RequestPixels`: the pixels (width x height, every image and video frame) one
  request may ask the server to decode; beyond it the request is refused (HTTP 400
  naming the image).
- :class:`DecodeBudget`: the decoded bytes (width x height x channels x bytes per sample,
  counted from the header before decoding) that all requests together may hold at once.
  A decode waits up to ``wait_seconds`` for room, then fails with :class:`DecodeBusyError`
  (HTTP 503 with ``Retry-After``). The front end decodes one image at a time per request
  and releases its bytes once its tower input is made, so a request holds about one
  decoded image, not all of them.

When the budget falls back to zero after a large release, :func:`trim_heap` asks glibc to
return free heap pages to the system (``malloc_trim(0)``): decoded images and the
processor's temporaries are freed, but glibc keeps freed pages of its per-thread arenas
unless asked, so the resident size would stay near its peak after a burst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from typing import Literal

from PIL import Image

from mmserve.cancel import check_cancelled
from mmserve.vision.image import ImageError

#: How often a decode waiting for room checks whether its client left (seconds).
_CANCEL_POLL = 0.05


class PixelBudgetError(ImageError):
    """A request whose images (frames included) exceed the per-request pixel budget."""


class DecodeBusyError(RuntimeError):
    """The server-wide decoded-image budget stayed full for the whole wait.

    Attributes:
        retry_after: seconds after which a retry is likely to find room.
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def decoded_bytes(width: int, height: int, mode: str) -> int:
    """Bytes of a decoded image of ``width`` x ``height`` in PIL ``mode``: pixels x bands
    x bytes per sample (4 for ``I`` and ``F``, 2 for the 16-bit modes, else 1)."""
    try:
        bands = Image.getmodebands(mode)
    except (KeyError, ValueError):
        bands = 4
    per_band = 4 if mode in ("I", "F") else 2 if "16" in mode else 1
    return width * height * max(1, bands) * per_band


class RequestPixels:
    """The pixels one request has asked to decode so far, against its limit.

    Args:
        limit: most pixels (width x height summed over images and frames) per request.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self, width: int, height: int, what: str = "image") -> None:
        """Count one image (or frame) of ``width`` x ``height``.

        Raises:
            PixelBudgetError: when the request's total passes the limit (nothing counted).
        """
        n = width * height
        if self.used + n > self.limit:
            raise PixelBudgetError(
                f"{what} is {width}x{height} = {n} pixels; with the {self.used} pixels of the "
                f"request's earlier images that is {self.used + n}, more than the "
                f"{self.limit} decoded pixels a request may have (--max-request-image-pixels): "
                "send fewer or smaller images"
            )
        self.used += n


class DecodeBudget:
    """Decoded bytes held at once by every request's images, bounded.

    Thread-safe. :meth:`acquire` before decoding, :meth:`release` once the decoded image
    is dropped.

    Args:
        capacity: most decoded bytes at once (bytes).
        wait_seconds: how long :meth:`acquire` waits for room before giving up.
        trim_after: a release of at least this many bytes that leaves nothing held calls
            :func:`trim_heap` (0: never).

    Attributes:
        in_use: bytes held now. peak: most bytes held at once so far.
        waits: acquisitions that had to wait. refusals: acquisitions that gave up.
    """

    def __init__(self, capacity: int, wait_seconds: float = 5.0, trim_after: int = 32 << 20):
        self.capacity = capacity
        self.wait_seconds = wait_seconds
        self.trim_after = trim_after
        self.in_use = 0
        self.peak = 0
        self.waits = 0
        self.refusals = 0
        self._freed_since_trim = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        """Hold ``nbytes``, waiting up to ``wait_seconds`` for room.

        Raises:
            ImageError: ``nbytes`` alone exceeds the capacity (it could never decode).
            DecodeBusyError: no room within ``wait_seconds``.
            Cancelled: the current :class:`~mmserve.cancel.CancelToken` was cancelled
                while waiting (checked every 50 ms); nothing is held.
        """
        if nbytes > self.capacity:
            raise ImageError(
                f"image needs {nbytes} bytes decoded, more than the server's whole budget of "
                f"{self.capacity} bytes for decoded images (--max-decoded-image-bytes)"
            )
        deadline = time.monotonic() + self.wait_seconds
        with self._cond:
            if self.in_use + nbytes > self.capacity:
                self.waits += 1
            while self.in_use + nbytes > self.capacity:
                check_cancelled()  # a request whose client left stops waiting for room
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refusals += 1
                    raise DecodeBusyError(
                        "the server is decoding too many images at once "
                        f"({self.in_use} of {self.capacity} bytes in use, "
                        "--max-decoded-image-bytes); retry shortly",
                        retry_after=max(1, round(self.wait_seconds)),
                    )
                self._cond.wait(min(left, _CANCEL_POLL))
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` held by :meth:`acquire` (the decoded image is dropped)."""
        with self._cond:
            self.in_use -= nbytes
            self._freed_since_trim += nbytes
            trim = (
                self.trim_after > 0
                and self.in_use == 0
                and self._freed_since_trim >= self.trim_after
            )
            if trim:
                self._freed_since_trim = 0
            self._cond.notify_all()
        if trim:
            trim_heap()


_libc: ctypes.CDLL | Literal[False] | None = None  # None: not looked up yet


def trim_heap() -> bool:
    """Return free heap pages to the system with glibc's ``malloc_trim(0)``.

    Returns:
        Whether it ran (False where the C library is not glibc).
    """
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    if not _libc:
        return False
    _libc.malloc_trim(0)
    return True
