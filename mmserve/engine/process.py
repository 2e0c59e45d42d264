"""The engine core in its own process: the engine side of ``mmserve serve``'s split.

The API process (:class:`~mmserve.frontend.engine_client.EngineProcessClient`) spawns
:func:`engine_main` with two one-way pipes (``multiprocessing`` connections). Over them
cross pickled lists of messages, each list one ``send_bytes``:

- in (API -> engine): ``("add", EngineRequest)`` (pixel tensors in shared memory: only a
  file descriptor crosses), ``("abort", rid)``, ``("call", call_id, name, args)`` (a
  control call: :data:`CONTROL_CALLS`, or :data:`PING`), ``("drop", call_id)`` (the API
  stopped waiting for that call: skipped if not yet read), ``("stop",)``;
- out (engine -> API): ``("ready", info)`` once the model is loaded and its kernels are
  built (with ``info["fds"]``, the API's end of the socket pixel tensors' file
  descriptors come in on: :func:`rebuild_sent_storage`), ``("failed", message,
  bad_setting)`` when it cannot start, then per step one
  ``("out", deltas, consecutive_failed_steps, fatal_error)`` with every request's
  :class:`~mmserve.types.TokenDelta` s of the step (as tuples: :func:`pack_deltas`),
  ``("reply", call_id, ok, value)``, ``("features", added, dropped, cleared)`` when the
  embedding cache's keys changed (the API's
  :class:`~mmserve.vision.embedding_cache.FeatureKeys` mirror) and ``("miss", rid,
  keys)`` for an added request that named images by key whose features the cache no
  longer holds (not taken in; the API sends it again with pixels).

The engine thread is this process's main thread; it reads what arrives before every
step (waiting on the pipe only while idle, with no timeout shorter than the parent
check); it writes what goes out itself while the pipe has room (:class:`PipeSender`: no
thread hand-off on the way out), and a sender thread finishes a write the pipe had no
room for, so a step never waits on a slow reader (messages put meanwhile go out in one
write after it).
The process ends when the API process
asks (``stop``: live requests aborted, KV written to the disk tier, tensor-parallel ranks
stopped) or when it goes away (its pipe closes, or it is no longer this process's
parent): nothing outlives the API process.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import fcntl
import logging
import os
import pickle
import select
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from mmserve.config import EngineConfig
from mmserve.engine.engine import EngineCore
from mmserve.types import EngineRequest, TokenDelta
from mmserve.vision.embedding_cache import EmbeddingCache
from mmserve.vision.inputs import ImageInput

log = logging.getLogger(__name__)

#: Engine methods the API process may call by name (the routes' control calls).
CONTROL_CALLS = frozenset(
    {"cache_stats", "stats_snapshot", "flush_cache", "describe", "check_accounting", "release_hold"}
)
#: The control call that only asks for an answer (the API's check that the engine is not
#: hung while it is silent).
PING = "ping"
#: Seconds between checks that the API process (the parent) is still there.
PARENT_CHECK_SECONDS = 1.0


def engine_main(
    config: EngineConfig, rx: Connection, tx: Connection, parent: int, log_level: str
) -> None:
    """Entry point of the engine process: load the model (``--tp N``: start its ranks),
    build the kernels, say ``ready`` and serve messages until told to stop or orphaned.

    Args:
        config: the engine settings (``model_path`` set).
        rx: the pipe end requests come in on.
        tx: the pipe end outputs go out on.
        parent: the API process's pid (its death ends this process).
        log_level: level of the ``mmserve`` loggers here (stderr, as the API's).
    """
    logging.basicConfig(
        level=log_level.upper() if log_level != "trace" else "DEBUG",
        format="%(levelname)s:     [engine] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _set_process_name(PROCESS_NAME)
    try:
        core = EngineCore(config)
        core.warm_up_kernels()
    except Exception as e:
        log.exception("the engine could not start")
        tx.send_bytes(pickle.dumps([("failed", f"{e}", isinstance(e, ValueError))]))
        return
    global _FD_SOCKET
    _FD_SOCKET, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    info = {"describe": core.describe(), "pool_tokens": core.pool.size_tokens, "pid": os.getpid()}
    tx.send_bytes(ForkingPickler.dumps([("ready", {**info, "fds": theirs})]))
    theirs.close()  # the API process fetches a duplicate as it unpickles ready
    try:
        EngineLoop(core, rx, tx, parent).run()
    finally:
        core.close()  # KV pages to the disk tier (if on), tensor-parallel ranks stopped


#: The engine process's name (``ps -o comm``, ``psutil.Process.name()``, ``pgrep``): its
#: command line is multiprocessing's ``spawn_main``, as every spawned helper's.
PROCESS_NAME = "mmserve-engine"


def _set_process_name(name: str) -> None:
    """Set this process's name (Linux ``prctl(PR_SET_NAME)``, at most 15 bytes); elsewhere,
    or if libc refuses, the name stays python's."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


#: The socket the API process sends pixel tensors' file descriptors on, each ahead of
#: the message whose unpickling takes it (:func:`rebuild_sent_storage`).
_FD_SOCKET: socket.socket | None = None
#: Descriptors received on it and not yet taken (in the order they were sent).
_FDS: collections.deque[int] = collections.deque()


def rebuild_sent_storage(cls: type, size: int) -> object:
    """Unpickle a shared-memory storage of ``size`` bytes whose file descriptor the API
    process sent ahead on :data:`_FD_SOCKET` (``mmserve.frontend.engine_wire.
    dumps_sending``): mapped here, the descriptor closed."""
    assert _FD_SOCKET is not None, "no fd socket from the API process"
    if not _FDS:  # the next message's descriptors (each send: up to 253, in order)
        _, fds, flags, _ = socket.recv_fds(_FD_SOCKET, 1, 253)
        if flags & socket.MSG_CTRUNC:  # some were dropped: later ones would map wrongly
            for fd in fds:
                os.close(fd)
            raise RuntimeError("pixel descriptors lost in transit (MSG_CTRUNC); exiting")
        _FDS.extend(fds)
    fd = _FDS.popleft()
    try:
        return cls._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]  # torch's
    finally:
        os.close(fd)


class EngineLoop:
    """Serves one engine core over the two pipes (see the module docstring).

    Args:
        core: the engine.
        rx: incoming pipe end.
        tx: outgoing pipe end.
        parent: the API process's pid.
    """

    def __init__(self, core: EngineCore, rx: Connection, tx: Connection, parent: int) -> None:
        self.core = core
        self.rx = rx
        self.tx = tx
        self.parent = parent
        self._gone = False  # the API process closed its end or asked to stop
        self._sender = PipeSender(tx)
        core.on_outputs = self._send_outputs
        core.embedding_cache.record_changes()  # its keys, mirrored by the API process

    def run(self) -> None:
        """Step while there is work; return when stopped or orphaned. Messages are read
        on this thread (no hand-off between threads on the way to a step): blocking
        while idle, without waiting before each step while busy."""
        try:
            self._serve()
        finally:
            self._sender.close()

    def _serve(self) -> None:
        core = self.core
        while not self._gone and not self._sender.gone:
            if not core.has_work() and not self.rx.poll(PARENT_CHECK_SECONDS):
                if os.getppid() != self.parent:  # the API process died (reparented)
                    return
                continue
            msgs: list[tuple] = []  # all that waits, so a "drop" skips its call
            while not self._gone and self.rx.poll(0):
                try:
                    msgs += pickle.loads(self.rx.recv_bytes())
                except (EOFError, OSError):  # the API process is gone
                    return
            dropped = {m[1] for m in msgs if m[0] == "drop"} if msgs else ()
            for msg in msgs:
                if msg[0] == "stop":
                    core.abort_all("abort")
                    return
                if msg[0] == "call" and msg[1] in dropped:
                    continue  # its caller gave up (deadline): a late flush must not run
                self._handle(msg)
            if core.has_work() and not self._gone:
                try:
                    core.step()  # a failing batch is contained inside step
                except Exception as e:
                    log.exception("engine step failed outside a batch; ending every request")
                    core.stats.failed_steps += 1
                    core.stats.consecutive_failed_steps += 1
                    self._abort_all(f"{type(e).__name__} in the engine")
            changes = core.embedding_cache.take_changes()
            if changes is not None:
                self._send([("features", *changes)])

    def _abort_all(self, message: str) -> None:
        try:
            self.core.abort_all("error", message)
        except Exception:
            log.exception("abort_all failed")
            now = time.perf_counter()
            self._send_outputs(
                [
                    TokenDelta(r.rid, (), None, now, finish_reason="error", error=message)
                    for r in self.core.live_requests()
                ]
            )

    def _handle(self, msg: tuple) -> None:
        core = self.core
        kind = msg[0]
        if kind == "add":
            req: EngineRequest | None = _features_by_key(msg[1], core.embedding_cache)
            if req is None:  # named features the cache dropped since: the API resends
                self._send([("miss", msg[1].rid, _missing(msg[1], core.embedding_cache))])
                return
            if req.params.guided is not None:  # compiled once per spec here too
                req = _with_grammar(req, core.grammars.compile(req.params.guided))
            core.add_request(req)
        elif kind == "abort":
            core.abort(msg[1])
        elif kind == "call":
            _, cid, name, args = msg
            try:
                if name == PING:
                    value = None
                elif name not in CONTROL_CALLS:
                    raise ValueError(f"unknown control call {name!r}")
                else:
                    value = getattr(core, name)(*args)
                reply = ("reply", cid, True, value)
            except Exception as e:  # noqa: BLE001 - raised again in the API process
                reply = ("reply", cid, False, (type(e).__name__, str(e)))
            self._send([reply])

    def _send_outputs(self, deltas: list[TokenDelta]) -> None:
        core = self.core
        out = pack_deltas(deltas)
        self._send([("out", out, core.stats.consecutive_failed_steps, core.fatal_error())])

    def _send(self, msgs: list[tuple]) -> None:
        self._sender.put(msgs)


class PipeSender:
    """Writes an engine loop's messages to its pipe so that a step never waits on a slow
    reader: the caller's thread writes a message at once when the pipe has room for it
    (the usual case: no hand-off between threads on the way to the API process), and a
    thread of its own finishes a write the pipe had no room for; messages put meanwhile
    go out together after it, in order. The pipe is made non-blocking and as large as the
    system allows (``F_SETPIPE_SZ``), and written with ``multiprocessing``'s framing (a
    4-byte big-endian size, or -1 then an 8-byte size; the API side's
    :func:`~mmserve.frontend.engine_wire.frames`).

    Args:
        tx: the outgoing pipe end (its fd becomes non-blocking).

    Attributes:
        gone: a write failed (the API process closed its end); later messages are dropped.
    """

    def __init__(self, tx: Connection) -> None:
        self.tx = tx
        self.gone = False
        self._fd = tx.fileno()
        _grow_pipe(self._fd)
        os.set_blocking(self._fd, False)
        self._queue: list[tuple] = []
        self._pending: memoryview | None = None  # the rest of a write the pipe had no room for
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mmserve-engine-send", daemon=True)
        self._thread.start()

    def put(self, msgs: list[tuple]) -> None:
        """Send ``msgs`` (written now as far as the pipe has room; returns at once)."""
        with self._cv:
            if self.gone:
                return
            if self._pending is not None or self._queue:  # behind a write under way
                self._queue.extend(msgs)
                self._cv.notify()
                return
            data = frame(pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL))
            try:
                n = os.write(self._fd, data)
            except BlockingIOError:
                n = 0
            except OSError:  # the API process is gone; the loop ends at its next check
                self.gone = True
                return
            if n < len(data):
                self._pending = memoryview(data)[n:]
                self._cv.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop the thread (waits up to ``timeout`` seconds)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._queue and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    if not self._queue:
                        return
                    batch, self._queue = self._queue, []
                    data = frame(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
                    self._pending = memoryview(data)
                buf = self._pending
            try:
                select.select([], [self._fd], [], 1.0)  # room in the pipe (or a timeout)
                n = os.write(self._fd, buf)
            except BlockingIOError:
                n = 0
            except (OSError, ValueError):  # the API process is gone (or the fd closed)
                with self._cv:
                    self.gone, self._pending, self._queue = True, None, []
                continue
            with self._cv:
                self._pending = buf[n:] if n < len(buf) else None


def frame(payload: bytes) -> bytes:
    """``payload`` with ``multiprocessing.connection``'s framing (what ``send_bytes``
    writes): a 4-byte big-endian signed size, or -1 then an 8-byte size from 2 GiB on."""
    n = len(payload)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return head + payload


def _grow_pipe(fd: int) -> None:
    """Make the pipe behind ``fd`` as large as an unprivileged process may (Linux: up to
    ``/proc/sys/fs/pipe-max-size``, 1 MiB by default), so a step's message fits at once."""
    setsz = getattr(fcntl, "F_SETPIPE_SZ", 1031)
    try:
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        fcntl.fcntl(fd, setsz, min(limit, 1 << 20))
    except (OSError, ValueError):  # not Linux, or not a pipe: its default size
        pass


#: :class:`TokenDelta`'s fields, in the order :func:`pack_deltas` writes them.
DELTA_FIELDS = tuple(f.name for f in dataclasses.fields(TokenDelta))


def pack_deltas(deltas: list[TokenDelta]) -> list[tuple]:
    """``deltas`` as plain tuples of their fields (:data:`DELTA_FIELDS` order): pickled,
    about a third of the cost of the dataclasses (measured: benchmarks/README.md)."""
    return [tuple(d.__dict__.values()) for d in deltas]


def unpack_deltas(rows: list[tuple]) -> list[TokenDelta]:
    """The :class:`TokenDelta` s :func:`pack_deltas` packed (no ``__init__`` run: the
    values were a valid delta's)."""
    new, names, out = object.__new__, DELTA_FIELDS, []
    for row in rows:
        d = new(TokenDelta)
        d.__dict__.update(zip(names, row, strict=True))
        out.append(d)
    return out


def _by_key(item: ImageInput) -> bool:
    """Whether ``item`` crossed by key only (no features, pixels or picture with it)."""
    return not item.ready and item.image is None


def _features_by_key(req: EngineRequest, cache: EmbeddingCache) -> EngineRequest | None:
    """``req`` with the cached features of each image it names by key only (a
    reference: the request keeps them if the cache evicts them before its prefill), or
    None when the cache no longer holds one of them."""
    if not req.spans or not any(_by_key(s.image) for s in req.spans):
        return req
    spans = []
    for span in req.spans:
        if _by_key(span.image):
            feats = cache.peek(span.image.key)
            if feats is None:
                return None
            span = dataclasses.replace(span, image=dataclasses.replace(span.image, features=feats))
        spans.append(span)
    return dataclasses.replace(req, spans=tuple(spans))


def _missing(req: EngineRequest, cache: EmbeddingCache) -> list[bytes]:
    """The keys ``req`` names by key only that ``cache`` does not hold."""
    return list(
        dict.fromkeys(
            s.image.key for s in req.spans if _by_key(s.image) and s.image.key not in cache
        )
    )


def _with_grammar(req: EngineRequest, grammar: object) -> EngineRequest:
    return dataclasses.replace(req, grammar=grammar)
