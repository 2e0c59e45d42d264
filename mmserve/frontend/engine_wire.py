"""What crosses the engine process's pipe from the API process: requests as they cross
(:func:`wire_request`: images by key or with their pixels), the pickling that sends the
pixels' shared memory ahead on a socket of its own (:func:`dumps_sending`), the pipe's
message framing read back (:func:`frames`), and the errors the client raises
(re-exported by :mod:`mmserve.frontend.engine_client`)."""

from __future__ import annotations

import dataclasses
import io
import logging
import socket
from multiprocessing.connection import Connection
from typing import Any

from mmserve.types import EngineRequest
from mmserve.vision.embedding_cache import FeatureKeys
from mmserve.vision.inputs import ImageInput

log = logging.getLogger(__name__)


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


#: Most file descriptors one message on a Unix socket carries (Linux's ``SCM_MAX_FD``).
FDS_PER_SEND = 253


def dumps_sending(msgs: list[tuple], fds: socket.socket | None) -> memoryview:
    """``msgs`` pickled for the engine's pipe (``ForkingPickler``). A pixel tensor moves
    into shared memory once and only its file descriptor crosses: sent now on ``fds``
    (the socket the engine gave with ``ready``), ahead of the message whose unpickling takes it
    (:func:`mmserve.engine.process.rebuild_sent_storage`); without ``fds``, torch's own
    reduction (lent through ``multiprocessing.resource_sharer``: a round trip to this
    process per descriptor, made while the engine unpickles)."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    from mmserve.engine.process import rebuild_sent_storage

    sent: list[int] = []

    def reduce_storage(storage: torch.UntypedStorage) -> tuple:
        if storage.size() == 0:  # cannot be mapped: torch's own reduction
            return ForkingPickler._extra_reducers[torch.UntypedStorage](storage)  # type: ignore[attr-defined]
        fd, size = storage._share_fd_cpu_()  # moved into shared memory once
        sent.append(fd)
        return rebuild_sent_storage, (type(storage), size)

    buf = io.BytesIO()
    pickler = ForkingPickler(buf, 5)
    if fds is not None:
        pickler.dispatch_table[torch.UntypedStorage] = reduce_storage
    pickler.dump(msgs)
    for i in range(0, len(sent), FDS_PER_SEND):  # few sends: the socket's buffer holds them
        socket.send_fds(fds, [b"f"], sent[i : i + FDS_PER_SEND])  # type: ignore[arg-type]
    return buf.getbuffer()


def send_batch(tx: Connection, fds: socket.socket | None, msgs: list, proc: Any) -> None:
    """Send ``msgs`` to the engine process as one message, pixels' descriptors ahead on
    ``fds`` (:func:`dumps_sending`). A failed write while the process ``proc`` lives
    leaves it out of step with this side (a message or its descriptors not whole), so
    the process is killed: its death is handled as any other (requests in flight end
    with an error, a new engine starts). A dead engine's failure is its reader's to
    report."""
    try:
        tx.send_bytes(dumps_sending(msgs, fds))
    except OSError as e:
        if proc is not None and proc.is_alive():
            log.error("writing to the engine process failed (%s): restarting it", e)
            proc.kill()


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
