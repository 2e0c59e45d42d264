"""The engine core in its own process: the engine side of ``mmserve serve``'s split.

The API process (:class:`~mmserve.frontend.engine_client.EngineProcessClient`) spawns
:func:`engine_main` with two one-way pipes (``multiprocessing`` connections). Over them
cross pickled lists of messages, each list one ``send_bytes``:

- in (API -> engine): ``("add", EngineRequest)`` (pixel tensors in shared memory: only a
  file descriptor crosses), ``("abort", rid)``, ``("call", call_id, name, args)`` (a
  control call: :data:`CONTROL_CALLS`), ``("stop",)``;
- out (engine -> API): ``("ready", info)`` once the model is loaded and its kernels are
  built, ``("failed", message, bad_setting)`` when it cannot start, then per step one
  ``("out", deltas, consecutive_failed_steps, fatal_error)`` with every request's
  :class:`~mmserve.types.TokenDelta` s of the step (as tuples: :func:`pack_deltas`),
  and ``("reply", call_id, ok, value)``.

The engine thread is this process's main thread; it reads what arrives before every
step (waiting on the pipe only while idle); a :class:`PipeSender` thread writes what goes
out, so a step never waits on a slow reader (messages queued meanwhile go out in one
write: per step when the reader keeps up, several steps' at once when it does not).
The process ends when the API process
asks (``stop``: live requests aborted, KV written to the disk tier, tensor-parallel ranks
stopped) or when it goes away (its pipe closes, or it is no longer this process's
parent): nothing outlives the API process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Connection

from mmserve.config import EngineConfig
from mmserve.engine.engine import EngineCore
from mmserve.types import EngineRequest, TokenDelta

log = logging.getLogger(__name__)

#: Engine methods the API process may call by name (the routes' control calls).
CONTROL_CALLS = frozenset(
    {"cache_stats", "stats_snapshot", "flush_cache", "describe", "check_accounting", "release_hold"}
)
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
    try:
        core = EngineCore(config)
        core.warm_up_kernels()
    except Exception as e:
        log.exception("the engine could not start")
        tx.send_bytes(pickle.dumps([("failed", f"{e}", isinstance(e, ValueError))]))
        return
    info = {"describe": core.describe(), "pool_tokens": core.pool.size_tokens, "pid": os.getpid()}
    tx.send_bytes(pickle.dumps([("ready", info)]))
    try:
        EngineLoop(core, rx, tx, parent).run()
    finally:
        core.close()  # KV pages to the disk tier (if on), tensor-parallel ranks stopped


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
            while not self._gone and self.rx.poll(0):
                try:
                    msgs = pickle.loads(self.rx.recv_bytes())
                except (EOFError, OSError):  # the API process is gone
                    return
                for msg in msgs:
                    if msg[0] == "stop":
                        core.abort_all("abort")
                        return
                    self._handle(msg)
            if core.has_work() and not self._gone:
                try:
                    core.step()  # a failing batch is contained inside step
                except Exception as e:
                    log.exception("engine step failed outside a batch; ending every request")
                    core.stats.failed_steps += 1
                    core.stats.consecutive_failed_steps += 1
                    self._abort_all(f"{type(e).__name__} in the engine")

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
            req: EngineRequest = msg[1]
            if req.params.guided is not None:  # compiled once per spec here too
                req = _with_grammar(req, core.grammars.compile(req.params.guided))
            core.add_request(req)
        elif kind == "abort":
            core.abort(msg[1])
        elif kind == "call":
            _, cid, name, args = msg
            try:
                if name not in CONTROL_CALLS:
                    raise ValueError(f"unknown control call {name!r}")
                reply = ("reply", cid, True, getattr(core, name)(*args))
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
    """Writes an engine loop's messages to its pipe on a thread of its own, so a step never
    waits on a slow reader (a full pipe blocks the write, not the next step): messages
    queued while a write is under way go out together in the next write, in order.

    Args:
        tx: the outgoing pipe end.

    Attributes:
        gone: a write failed (the API process closed its end); later messages are dropped.
    """

    def __init__(self, tx: Connection) -> None:
        self.tx = tx
        self.gone = False
        self._queue: list[tuple] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mmserve-engine-send", daemon=True)
        self._thread.start()

    def put(self, msgs: list[tuple]) -> None:
        """Queue ``msgs`` for the pipe (returns at once)."""
        with self._cv:
            self._queue.extend(msgs)
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
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            if self.gone:
                continue
            try:
                self.tx.send_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:  # the API process is gone; the loop ends at its next check
                self.gone = True


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


def _with_grammar(req: EngineRequest, grammar: object) -> EngineRequest:
    return dataclasses.replace(req, grammar=grammar)
