"""The API process's side of the engine process: what ``mmserve serve`` streams from.

:class:`EngineProcessClient` spawns the engine core in its own process
(:func:`mmserve.engine.process.engine_main`: model, ``--tp`` ranks and kernel warm-up
there) and has the methods of :class:`~mmserve.frontend.async_engine.AsyncEngine` the
routes use (:meth:`~EngineProcessClient.stream`, :meth:`~EngineProcessClient.generate`,
:meth:`~EngineProcessClient.control`, ``consecutive_failures``, ``fatal_error``), so the
app, queue limit, metrics and disconnects work as in one process. Text is built here, in
each request's :class:`~mmserve.frontend.async_engine.Slot`, from the step's deltas.

Messages going in are batched: everything submitted in one turn of the event loop
crosses in one pickled list (to an idle engine at once). Each step's outputs arrive as
one message, read and unpickled on the event loop (``loop.add_reader``: no thread). Pixel
tensors cross through shared memory (moved there once; only a file descriptor crosses,
on a socket of its own ahead of the message: :func:`dumps_sending`; freed when both
processes have dropped it); an image whose features the engine holds
(:attr:`~EngineProcessClient.feature_keys`) crosses by key only, and is sent again with
its pixels should the engine answer that it dropped them meanwhile.

When the engine process dies (killed, out of memory, a CUDA error), every request in
flight ends at once with finish reason "error" naming the engine process, requests
submitted meanwhile do too, :meth:`~EngineProcessClient.unavailable` says why (the
server's ``/health`` answers 503) and a new engine process is started, at most
``restarts`` times; after that :meth:`~EngineProcessClient.fatal_error` is set and the
server exits non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions

from mmserve import cancel
from mmserve.config import EngineConfig
from mmserve.engine.process import CONTROL_CALLS, PING, engine_main, unpack_deltas
from mmserve.frontend.async_engine import Slot, SlotStream, collector_for
from mmserve.frontend.engine_wire import (
    NEVER_DROPPED,
    READ_BYTES,
    EngineError,
    EngineStartError,
    EngineTimeout,
    EngineUnavailable,
    frames,
    send_batch,
    wire_request,
)
from mmserve.types import EngineRequest, GenerateResult
from mmserve.vision.embedding_cache import FeatureKeys

log = logging.getLogger(__name__)

__all__ = [
    "EngineError",
    "EngineProcessClient",
    "EngineStartError",
    "EngineTimeout",
    "EngineUnavailable",
]

#: Seconds a control call waits for the engine process's answer by default.
CALL_TIMEOUT = 30.0
#: ``flush_cache`` may drop a large host KV tier: it gets this many times as long.
FLUSH_TIMEOUT_FACTOR = 4.0
#: Seconds without a message from the engine process after which it is pinged (the
#: ping's deadline is the control calls' one: an unanswered ping marks it not answering).
PING_SECONDS = 5.0


class EngineProcessClient:
    """Runs an :class:`~mmserve.engine.engine.EngineCore` in a spawned process and
    streams from it (see the module docstring).

    Args:
        config: engine settings (``model_path`` set: the process loads the model).
        restarts: how many times a dead engine process is replaced (then fatal).
        front: the front end whose collectors build text (:meth:`FrontEnd.collector`);
            set before the first request (:meth:`start` does not need it).
        start_timeout: seconds the engine may take to load and warm up.
        log_level: the engine process's log level.
        call_timeout: seconds a control call waits for its answer before it raises
            :class:`EngineTimeout` (``flush_cache``: :data:`FLUSH_TIMEOUT_FACTOR` times
            as long); the engine is then reported not answering
            (:meth:`unavailable`) until its next message.
        ping_seconds: an engine process silent this long is pinged (a control call with
            the same deadline), so a hung engine is noticed with no call in flight.
        target: the engine process's entry point (:func:`engine_main`'s arguments; a
            module-level function: tests inject faults there).

    Attributes:
        info: what the engine said when ready: ``describe`` (:meth:`EngineCore.describe`),
            ``pool_tokens``, ``pid``.
        deaths: engine processes that died (not counting a requested stop).
        feature_keys: the image keys whose features the engine's embedding cache holds,
            as its ``features`` messages report them (the front end's mirror: an image
            it names crosses by key, no pixels made or sent).
        resent: requests sent again with pixels after the engine answered a miss (it
            had dropped features they named by key).
    """

    def __init__(
        self,
        config: EngineConfig,
        restarts: int = 3,
        front: Any = None,
        start_timeout: float = 900.0,
        log_level: str = "info",
        call_timeout: float = CALL_TIMEOUT,
        ping_seconds: float = PING_SECONDS,
        target: Callable[..., None] = engine_main,
    ) -> None:
        if call_timeout <= 0 or ping_seconds <= 0:
            raise ValueError("call_timeout and ping_seconds must be > 0")
        if config.model_path is None:
            raise ValueError("the engine process loads the model: set config.model_path")
        self.config = config
        self.restarts_left = restarts
        self.front = front
        self.start_timeout = start_timeout
        self.log_level = log_level
        self.call_timeout = call_timeout
        self.ping_seconds = ping_seconds
        self.target = target
        self.info: dict = {}
        self.deaths = 0
        self.feature_keys = FeatureKeys()
        self.resent = 0
        self._by_key: dict[str, tuple[EngineRequest, Slot]] = {}  # sent with images by key
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: Any = None
        self._tx: Connection | None = None
        self._rx: Connection | None = None
        self._watched: Connection | None = None  # the pipe end the event loop reads
        self._inbuf = bytearray()  # what was read of it and not yet handled
        self._gen = 0  # which engine process the reader threads report for
        self._ready = False
        self._stopping = False
        self._fatal: str | None = None
        self._why: str | None = None  # why no engine runs now
        self._failures = 0
        self._engine_fatal: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: dict[str, Slot] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._outbox: list[tuple] = []
        self._ready_event: asyncio.Event | None = None
        self._fds: Any = None  # the socket pixels' fds cross on (the engine's, with ready)
        self._silent: str | None = None  # a control call went unanswered past its deadline
        self._heard = time.monotonic()  # when the engine process last sent anything
        self._pinging = False
        self._watchdog: asyncio.TimerHandle | None = None

    # ---- the process ---------------------------------------------------------------
    def start(self) -> dict:
        """Spawn the engine process and wait until it is ready (blocking: model load and
        kernel warm-up, up to ``start_timeout`` seconds).

        Returns:
            :attr:`info`.

        Raises:
            EngineStartError: the process failed to start (its message) or timed out.
        """
        rx_child, tx_parent = self._ctx.Pipe(duplex=False)
        rx_parent, tx_child = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=self.target,
            args=(self.config, rx_child, tx_child, os.getpid(), self.log_level),
            name="mmserve-engine-core",
            daemon=False,  # it starts the tensor-parallel ranks: a daemon may not
        )
        proc.start()
        rx_child.close()  # only the child holds these: its death closes the pipes
        tx_child.close()
        try:
            first = self._first_message(proc, rx_parent)
        except BaseException:
            _end(proc)
            raise
        if self._fds is not None:
            self._fds.close()  # the last engine's: descriptors it never took are closed
        self._fds = first.pop("fds")  # its socket for pixels' fds (dumps_sending)
        self._proc, self._tx, self._rx = proc, tx_parent, rx_parent
        self._gen += 1
        self.info = first
        self._failures, self._engine_fatal, self._why = 0, None, None
        self._silent, self._heard = None, time.monotonic()
        self.feature_keys.clear()  # a new engine: an empty embedding cache
        self._ready = True
        log.info("engine process %d ready", first["pid"])
        return first

    def _first_message(self, proc, rx: Connection) -> dict:
        deadline = time.monotonic() + self.start_timeout
        while not rx.poll(0.2):
            if not proc.is_alive():
                proc.join()
                raise EngineStartError(f"the engine process exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise EngineStartError(f"the engine was not ready in {self.start_timeout} s")
        try:
            msg = pickle.loads(rx.recv_bytes())[0]
        except (EOFError, OSError):
            proc.join(5)
            raise EngineStartError(f"the engine process exited with code {proc.exitcode}") from None
        if msg[0] == "failed":
            proc.join(30)
            raise EngineStartError(msg[1], bad_setting=msg[2])
        return msg[1]

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the engine process: live requests aborted, KV written to the disk tier,
        tensor-parallel ranks stopped; killed if it takes over ``timeout`` seconds."""
        self._stopping = True
        proc = self._proc
        if proc is None:
            return
        self._silent = None
        self._ready = False  # requests from now on fail at once; those in flight at EOF
        if self._tx is not None:
            try:
                self._tx.send_bytes(pickle.dumps([("stop",)]))
            except OSError:
                pass
        proc.join(timeout)
        _end(proc)
        if self._tx is not None:
            self._tx.close()
        if self._rx is not None and self._rx is not self._watched:
            self._rx.close()  # no event loop reads it (never attached)
        if self._fds is not None:
            self._fds.close()  # fds of pixels the engine never took go with it

    @property
    def pid(self) -> int | None:
        """The running engine process's pid (None before start)."""
        return self._proc.pid if self._proc is not None else None

    def attach(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Deliver outputs to ``loop`` (default: the running one); the app's startup
        calls it, the first request does otherwise."""
        self._loop = loop or asyncio.get_running_loop()
        self._ready_event = asyncio.Event()
        if self._ready:
            self._ready_event.set()
        self._watch()
        if self._watchdog is not None:  # attached to another loop before
            self._watchdog.cancel()
        self._watchdog = self._loop.call_later(self.ping_seconds, self._check_silence)

    def _watch(self) -> None:
        """Read the current engine's outputs on the event loop (``add_reader``: no thread
        between the pipe and the slots)."""
        rx, loop = self._rx, self._loop
        if rx is None or loop is None or rx is self._watched:
            return
        self._watched = rx
        self._inbuf = bytearray()
        loop.add_reader(rx.fileno(), self._readable, rx, self._gen)
        # uvloop's add_reader makes the fd non-blocking (libuv's uv_poll_init); set it so
        # under any loop: a step's message is read as far as it has arrived, never with
        # recv_bytes, which raises BlockingIOError on a message still being written
        os.set_blocking(rx.fileno(), False)

    # ---- health ----------------------------------------------------------------------
    def unavailable(self) -> str | None:
        """Why no engine serves requests now (died, restarting, gone for good, or alive
        but not answering: a control call or ping went unanswered past its deadline and
        nothing came from it since), else None."""
        return self._fatal or self._why or self._silent

    def _check_silence(self) -> None:
        """Every ``ping_seconds`` on the event loop: ping an engine process that has said
        nothing for that long (an unanswered ping marks it not answering)."""
        loop = self._loop
        if loop is None or self._stopping or self._fatal is not None:
            self._watchdog = None
            return
        self._watchdog = loop.call_later(self.ping_seconds, self._check_silence)
        idle = time.monotonic() - self._heard >= self.ping_seconds
        if idle and self._ready and not self._pinging:
            self._pinging = True
            loop.create_task(self._ping())

    async def _ping(self) -> None:
        try:
            await self.control(PING)
        except EngineUnavailable:  # EngineTimeout: marked not answering; or it died
            pass
        finally:
            self._pinging = False

    def not_serving(self) -> str | None:
        """Why a new request cannot start now (no engine process ready: it died, a new one
        is starting or none is left; a tensor-parallel rank died), else None."""
        if not self._ready:
            return self.unavailable() or "the engine process is not running"
        return self._engine_fatal

    def fatal_error(self) -> str | None:
        """Why this server can serve nothing any more (the engine died and no restart is
        left, or a tensor-parallel rank of the engine died), else None."""
        return self._fatal or self._engine_fatal

    def consecutive_failures(self) -> int:
        """The engine's failed steps in a row (from its last output message)."""
        return self._failures

    async def wait_ready(self) -> None:
        """Wait until an engine process is ready (at once when one is).

        Raises:
            EngineUnavailable: no engine will start again (restarts used up).
        """
        if self._loop is None:
            self.attach()
        assert self._ready_event is not None
        while not self._ready:
            if self._fatal is not None:
                raise EngineUnavailable(self._fatal)
            self._ready_event.clear()
            await self._ready_event.wait()
        if self._fatal is not None:
            raise EngineUnavailable(self._fatal)

    # ---- messages ----------------------------------------------------------------------
    def _readable(self, rx: Connection, gen: int) -> None:
        """The engine's pipe has data (one message per engine step) or was closed.

        Reads what has arrived (the fd is non-blocking) and handles every whole message
        in it; a message still being written stays in the buffer for the next call."""
        if gen == self._gen:  # it answers again (a late reply counts)
            self._heard, self._silent = time.monotonic(), None
        buf, fd = self._inbuf, rx.fileno()
        closed = False
        while True:
            try:
                chunk = os.read(fd, READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            buf += chunk
            if len(chunk) < READ_BYTES:
                break  # drained (an EOF, if any, shows at the next call)
        for payload in frames(buf):
            self._on_messages(pickle.loads(payload))
        if closed:
            assert self._loop is not None
            self._loop.remove_reader(fd)
            rx.close()
            self._died(gen)

    def _on_messages(self, msgs: list[tuple]) -> None:
        for msg in msgs:
            kind = msg[0]
            if kind == "out":
                _, rows, self._failures, self._engine_fatal = msg
                slots = self._slots
                for d in unpack_deltas(rows):
                    slot = slots.get(d.rid)
                    if slot is not None:
                        slot.deliver(d)
            elif kind == "reply":
                _, cid, ok, value = msg
                fut = self._calls.pop(cid, None)
                if fut is None or fut.done():
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    name, text = value
                    fut.set_exception(
                        RuntimeError(text) if name == "RuntimeError" else EngineError(text)
                    )
            elif kind == "features":
                self.feature_keys.apply(*msg[1:])
            elif kind == "miss":
                self._missed(msg[1], msg[2])

    def _died(self, gen: int) -> None:
        """Engine process ``gen`` closed its pipe: fail all in flight, restart (or not)."""
        if gen != self._gen:
            return
        proc = self._proc
        self._ready = False
        if self._stopping:  # stop() joins it; what the engine left unanswered ends here
            self._fail_in_flight(f"the engine process (pid {proc.pid}) was stopped")
            return
        proc.join(5)
        code = proc.exitcode
        self.deaths += 1
        why = f"the engine process (pid {proc.pid}) died (exit code {code})"
        log.error("%s; failing %d requests in flight", why, len(self._slots))
        self._fail_in_flight(why)
        if self.restarts_left <= 0:
            self._fatal = f"{why}; no restart left (--engine-restarts)"
            log.error("%s", self._fatal)
            if self._ready_event is not None:
                self._ready_event.set()
            return
        self.restarts_left -= 1
        self._why = f"{why}; a new engine process is starting"
        asyncio.ensure_future(self._restart())

    def _fail_in_flight(self, why: str) -> None:
        """End every request (finish reason "error") and control call
        (:class:`EngineUnavailable`) waiting on the engine process that is gone."""
        slots, self._slots = self._slots, {}  # a slot's reader may close it meanwhile
        for slot in slots.values():
            slot.fail(why)
        self._by_key.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(why))
        self._calls.clear()
        self._outbox.clear()

    async def _restart(self) -> None:
        try:
            await asyncio.to_thread(self.start)
            self._watch()
        except Exception as e:  # noqa: BLE001 - the server cannot serve: it exits non-zero
            self._fatal = f"the engine process could not be restarted: {e}"
            log.error("%s", self._fatal)
        if self._ready_event is not None:
            self._ready_event.set()

    def _send(self, msg: tuple) -> None:
        """Send ``msg``: at once while no other request is in flight (an idle engine: a
        turn of the loop's wait would only add latency; then this process yields its
        CPU to the engine), else queued, and everything queued in this turn of the loop
        crosses as one list."""
        self._outbox.append(msg)
        if len(self._outbox) == 1:
            if len(self._slots) <= 1:
                self._flush()
                os.sched_yield()  # a pipe wakes its reader on this CPU: let it run first
            else:
                assert self._loop is not None
                self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        if not out or not self._ready or self._tx is None:
            return
        send_batch(self._tx, self._fds, out, self._proc)

    # ---- the async engine's interface -------------------------------------------------
    async def control(self, name: str, *args: object, timeout: float | None = None) -> object:
        """Call the engine's control method ``name`` (:data:`CONTROL_CALLS`) in the
        engine process and await its value, at most ``timeout`` seconds (default
        :attr:`call_timeout`; ``flush_cache`` :data:`FLUSH_TIMEOUT_FACTOR` times that).

        A call past its deadline is dropped: its future is forgotten (a late reply is
        ignored), the engine is told to skip it if it has not read it yet, and the engine
        is reported not answering (:meth:`unavailable`) until it sends anything again.

        Raises:
            ValueError: an unknown name. EngineUnavailable: no engine process runs (or
            it died before answering). EngineTimeout: no answer within the deadline.
            RuntimeError / EngineError: what the method raised there (``flush_cache``
            while requests are live raises RuntimeError).
        """
        if name not in CONTROL_CALLS and name != PING:
            raise ValueError(f"unknown control call {name!r}")
        if timeout is None:
            timeout = self.call_timeout
            if name == "flush_cache":
                timeout *= FLUSH_TIMEOUT_FACTOR
        if self._loop is None:
            self.attach()
        if not self._ready:
            raise EngineUnavailable(self.unavailable() or "the engine process is not running")
        assert self._loop is not None
        cid = next(self._ids)
        fut = self._loop.create_future()
        self._calls[cid] = fut
        self._send(("call", cid, name, args))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            if not self._ready:  # it died or stopped meanwhile: say that, not a timeout
                raise EngineUnavailable(self.unavailable() or "the engine stopped") from None
            if name not in NEVER_DROPPED:  # else it still runs when the engine gets to it
                self._send(("drop", cid))
            why = (
                f"the engine process (pid {self.pid}) did not answer the control call "
                f"{name!r} within {timeout:g} s; it is alive but not answering (stuck in "
                f"a step or stopped)"
            )
            self._silent = why
            log.error("%s", why)
            raise EngineTimeout(why, name) from None
        finally:
            self._calls.pop(cid, None)  # answered, timed out or its caller gone: forgotten

    def stream(self, req: EngineRequest, final_only: bool = False) -> SlotStream:
        """Submit ``req`` to the engine process and yield its updates, the last with the
        result (merged while the consumer is busy; only the last with ``final_only``).
        Submitted when first iterated or :meth:`~SlotStream.start` ed (as
        :meth:`AsyncEngine.stream <mmserve.frontend.async_engine.AsyncEngine.stream>`).

        Closing early (client gone, a stop string) aborts the request in the engine; a
        cancelled :class:`~mmserve.cancel.CancelToken` aborts it at once. While no engine
        runs, or when it dies, the result has finish reason "error" naming the engine.
        """
        if self._loop is None:
            self.attach()
        assert self.front is not None, "set EngineProcessClient.front first"
        slot = Slot(collector_for(self.front, req, final_only), final_only)

        def open_() -> Callable[[], None]:
            unhook = None
            if not self._ready:
                slot.fail(self.unavailable() or "the engine process is not running")
            else:
                self._slots[req.rid] = slot
                wire, by_key = wire_request(req, self.feature_keys)
                if by_key:  # kept until it ends, in case the engine dropped those features
                    self._by_key[req.rid] = (req, slot)
                self._send(("add", wire))
                token = cancel.current()
                if token is not None:
                    if token.cancelled:
                        self._send(("abort", req.rid))
                    loop = self._loop
                    assert loop is not None
                    unhook = token.on_cancel(
                        lambda: loop.call_soon_threadsafe(self._abort, req.rid)
                    )

            def close() -> None:
                if unhook is not None:
                    unhook()
                if self._slots.get(req.rid) is slot:
                    del self._slots[req.rid]
                self._by_key.pop(req.rid, None)
                if not slot.engine_done:
                    self._abort(req.rid)

            return close

        return SlotStream(slot, open_)

    def _missed(self, rid: str, keys: list[bytes]) -> None:
        """The engine did not take request ``rid``: it no longer holds the features of
        ``keys``, which it named by key. Forget them and send it again with every image's
        pixels (made on a worker thread: decode and preprocess)."""
        self.feature_keys.discard(keys)
        sent = self._by_key.pop(rid, None)
        if sent is not None:
            assert self._loop is not None
            self._loop.create_task(self._resend(*sent))

    async def _resend(self, req: EngineRequest, slot: Slot) -> None:
        try:
            full = await asyncio.to_thread(self.front.processor.with_pixels, req)
        except Exception as e:  # noqa: BLE001 - ends this request, not the server
            log.warning("request %s: its images could not be prepared again: %s", req.rid, e)
            if self._slots.get(req.rid) is slot:
                slot.fail(f"its images could not be prepared again: {e}")
            return
        if self._slots.get(req.rid) is slot and self._ready:  # still wanted
            self.resent += 1
            self._send(("add", wire_request(full, None)[0]))

    def _abort(self, rid: str) -> None:
        if self._ready:
            self._send(("abort", rid))

    async def generate(self, req: EngineRequest) -> GenerateResult:
        """Submit ``req`` and wait for its result (final-only: no per-token text)."""
        result = None
        async for upd in self.stream(req, final_only=True):
            result = upd.result
        assert result is not None
        return result


def _end(proc) -> None:
    """Make sure ``proc`` is gone and reaped (killed if still running)."""
    if proc.is_alive():
        proc.kill()
    proc.join(10)
