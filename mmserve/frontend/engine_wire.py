"""What crosses the engine process's pipe from the API process: requests as they cross
(:func:`wire_request`: images by key or with their pixels), the shared memory of the
pixels lent to the engine until it takes them (:func:`lent_fds`, :func:`release_lent`),
the pipe's message framing read back (:func:`frames`), and the errors the client raises
(re-exported by :mod:`mmserve.frontend.engine_client`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mmserve.types import EngineRequest
from mmserve.vision.embedding_cache import FeatureKeys
from mmserve.vision.inputs import ImageInput


def wire_request(req: EngineRequest, known: FeatureKeys | None) -> tuple[EngineRequest, bool]:
    """``req`` as it crosses, and whether an image of it crosses by key only.

    No compiled grammar (the engine compiles its own from the spec); each image without
    its decoded picture or file. An image the engine holds (its key in ``known``) or one
    without pixels for its mode (prepared while the engine held it) crosses by key only:
    the engine takes its features from its cache, or answers a miss. Otherwise its
    pixels cross (shared memory).
    """
    spans = req.spans
    by_key = False
    if spans:
        done: dict[bytes, ImageInput] = {}
        out = []
        for s in spans:
            im = s.image
            if im.key not in done:
                has_pixels = im.pixels is not None and im.pixels.mode == im.mode
                key_only = im.features is None and (
                    not has_pixels or (known is not None and im.key in known)
                )
                by_key |= key_only
                done[im.key] = dataclasses.replace(
                    im, image=None, source=None, pixels=None if key_only else im.pixels
                )
            out.append(dataclasses.replace(s, image=done[im.key]))
        spans = tuple(out)
    if req.grammar is None and spans is req.spans:
        return req, by_key
    return dataclasses.replace(req, grammar=None, spans=spans), by_key


def sharer() -> Any:
    """CPython's one ``multiprocessing.resource_sharer._ResourceSharer`` (private: no
    public way to drop a lent fd whose receiver died)."""
    from multiprocessing import resource_sharer

    return resource_sharer._resource_sharer  # type: ignore[attr-defined]  # no stub


def lent_fds() -> set[int]:
    """The keys of the file descriptors this process lends now (through
    ``multiprocessing.resource_sharer``, until their receiver fetches them)."""
    lender = sharer()
    if lender._listener is None:
        return set()
    with lender._lock:
        return set(lender._cache)


def dumps_lending(msgs: list[tuple], lent: set[int]) -> memoryview:
    """``msgs`` pickled for the engine's pipe (``ForkingPickler``: a pixel tensor moves
    into shared memory once and only its file descriptor crosses, lent until the engine
    fetches it); the keys of the descriptors this lent are added to ``lent`` (past 256
    kept, those no longer lent are dropped from it)."""
    from multiprocessing.reduction import ForkingPickler

    before = lent_fds()
    data = ForkingPickler.dumps(msgs, protocol=5)
    now = lent_fds()
    if len(lent) > 256:  # those the engine took are no longer lent
        lent &= now
    lent |= now - before
    return data


def release_lent(keys: set[int]) -> None:
    """Close the lent file descriptors ``keys`` (of :func:`lent_fds`) that their receiver
    never fetched: torch's reduction lends each pixel tensor's shared memory through
    ``multiprocessing.resource_sharer`` until the receiver fetches it, which a dead
    process never does (one leaked tensor each)."""
    lender = sharer()
    with lender._lock:
        entries = [lender._cache.pop(key, None) for key in keys]
    for entry in entries:
        if entry is not None:
            entry[1]()  # its close()


#: Control calls that still run when their caller stopped waiting (idempotent, and
#: dropping one would leak: a stream's held prefix would stay locked until a flush).
NEVER_DROPPED = frozenset({"release_hold"})
#: Bytes read from the engine's pipe per ``os.read``.
READ_BYTES = 1 << 20


class EngineStartError(RuntimeError):
    """The engine process could not start.

    Attributes:
        bad_setting: the engine refused its settings (a ``ValueError`` there: a bad
            checkpoint, a KV budget too small, a ``--tp`` it cannot split).
    """

    def __init__(self, message: str, bad_setting: bool = False) -> None:
        super().__init__(message)
        self.bad_setting = bad_setting


class EngineUnavailable(Exception):
    """No engine process is running now (it died; a new one may be starting)."""


class EngineTimeout(EngineUnavailable):
    """The engine process is alive but did not answer a control call within its deadline
    (stuck in a step, stopped by a signal, swapping).

    Attributes:
        call: the control call's name.
    """

    def __init__(self, message: str, call: str) -> None:
        super().__init__(message)
        self.call = call


class EngineError(Exception):
    """A control call raised in the engine process (the message says what)."""


def frames(buf: bytearray) -> list[bytes]:
    """Take the whole messages off the front of ``buf`` (``multiprocessing`` connection
    framing: a 4-byte big-endian signed size, -1 followed by an 8-byte size for 2 GiB or
    more, then the bytes) and return their payloads; a partial message stays in ``buf``."""
    out: list[bytes] = []
    pos, end = 0, len(buf)
    while end - pos >= 4:
        size = int.from_bytes(buf[pos : pos + 4], "big", signed=True)
        head = 4
        if size == -1:
            if end - pos < 12:
                break
            size, head = int.from_bytes(buf[pos + 4 : pos + 12], "big"), 12
        if end - pos < head + size:
            break
        out.append(bytes(buf[pos + head : pos + head + size]))
        pos += head + size
    if pos:
        del buf[:pos]
    return out
