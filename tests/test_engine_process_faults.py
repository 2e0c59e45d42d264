"""The process-split server when its engine process is gone (issue 41): control calls
(``/metrics``, ``/v1/cache/*``) fail at once with a 503 naming the engine, and a stop
ends whatever the engine left unanswered (no request or call waits forever)."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import signal
import socket
import sys
import termios
import time

import pytest
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app, start_engine_process
from mmserve.frontend.engine_client import EngineProcessClient, EngineUnavailable
from tests.helpers import MODEL, greedy, user
from tests.live_server import pid_alive


def _split(engine, **kw):
    config = dataclasses.replace(engine.config, dtype=engine.describe()["dtype"])
    return start_engine_process(config, restarts=0, **kw)


def test_control_calls_fail_fast_with_503_once_the_engine_process_is_gone(make_engine) -> None:
    front, process = _split(make_engine(max_total_tokens=4096))
    try:
        with TestClient(
            create_app(front, ServerSettings(served_model_name=MODEL), process=process)
        ) as c:
            assert c.get("/v1/cache/stats").status_code == 200
            os.kill(process.pid, signal.SIGKILL)
            deadline = time.time() + 10
            while c.get("/health").status_code != 503:
                assert time.time() < deadline, "/health never turned 503"
                time.sleep(0.05)
            for method, path in (
                ("GET", "/metrics"),
                ("GET", "/v1/cache/stats"),
                ("POST", "/v1/cache/flush"),
            ):
                start = time.time()
                r = c.request(method, path)
                assert time.time() - start < 5, path
                assert r.status_code == 503, (path, r.text)
                err = r.json()["error"]
                assert err["code"] == "engine_unhealthy" and err["type"] == "server_error", err
                assert "engine process" in err["message"] and "died" in err["message"], err
            # a new request, streamed or not, is refused before it starts: a 503 with
            # Retry-After, as /health, never a 500 or a stream that opens only to fail
            hi = {"model": MODEL, "messages": user("hi"), "max_tokens": 2}
            for body in (hi, {**hi, "stream": True}):
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "engine_unhealthy", r.text
                assert "died" in r.json()["error"]["message"] and r.headers["Retry-After"]
    finally:
        process.stop()
    assert not pid_alive(process.pid)


def test_stop_ends_the_calls_and_requests_the_engine_left_unanswered(make_engine) -> None:
    front, process = _split(make_engine(max_total_tokens=4096))
    req = front.processor.make_request(messages=user("hi"), params=greedy(4))

    async def run() -> tuple[BaseException | None, str | None]:
        process.attach()
        os.kill(process.pid, signal.SIGSTOP)  # alive but answering nothing
        call = asyncio.ensure_future(process.control("stats_snapshot"))
        gen = asyncio.ensure_future(process.generate(req))
        await asyncio.sleep(0.2)  # both crossed the pipe
        await asyncio.to_thread(process.stop, 1.0)  # not stopped in 1 s: killed
        res = await asyncio.wait_for(gen, timeout=10)
        try:
            await asyncio.wait_for(call, timeout=10)
        except EngineUnavailable as e:
            return e, res.finish_reason
        return None, res.finish_reason

    try:
        err, finish = asyncio.run(run())
    finally:
        if pid_alive(process.pid):
            os.kill(process.pid, signal.SIGKILL)
        process.stop()
    assert isinstance(err, EngineUnavailable) and "stopped" in str(err)
    assert finish == "error"
    assert not pid_alive(process.pid)
    # after the stop, a call fails at once instead of queueing for no one
    with pytest.raises(EngineUnavailable):
        asyncio.run(asyncio.wait_for(process.control("cache_stats"), timeout=5))


def test_pixels_sent_to_an_engine_process_that_died_are_not_leaked(make_engine, photos) -> None:
    """A pixel tensor's shared memory crosses as a file descriptor on the engine's socket,
    ahead of its message (nothing lent through ``resource_sharer``, which a dead engine
    would never fetch); when the engine dies with it unread, its end of that socket is
    gone, and with it the descriptors queued there."""
    from multiprocessing import resource_sharer

    front, process = _split(make_engine(max_total_tokens=4096))
    image = front.processor.prepare_image(photos["astronaut.png"], front.processor.image_mode(1))
    req = front.processor.make_request(
        messages=user(None, "Describe it."), images=[image], params=greedy(4)
    )
    lent = resource_sharer._resource_sharer._cache  # fds lent until their receiver takes them

    def unread(sock: socket.socket) -> int:  # bytes sent on sock its peer has not read
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")  # SIOCOUTQ
        return int.from_bytes(out, sys.byteorder)

    async def run() -> tuple[int, int, bytes, str | None]:
        process.attach()
        os.kill(process.pid, signal.SIGSTOP)  # the add stays in the pipe, unread
        gen = asyncio.ensure_future(process.generate(req))
        await asyncio.sleep(0.3)
        fds = process._fds
        queued = unread(fds)  # the pixels' fd, sent ahead of the message
        assert len(lent) == 0, "a pixel fd was lent through resource_sharer"
        os.kill(process.pid, signal.SIGKILL)
        res = await asyncio.wait_for(gen, timeout=10)
        try:  # the engine's end: closed (EOF), or reset as it held unread data
            eof = fds.recv(1, socket.MSG_DONTWAIT)
        except ConnectionResetError:
            eof = b""
        return queued, unread(fds), eof, res.finish_reason

    try:
        queued, left, eof, finish = asyncio.run(run())
    finally:
        process.stop()
    assert finish == "error"
    # the fd waited on the engine's end of the socket; that end is gone (b"": EOF) and
    # with it what was queued there (the kernel closed the descriptor)
    assert queued > 0 and left == 0 and eof == b""
    assert len(lent) == 0


def test_control_calls_to_a_hung_engine_process_answer_503_at_their_deadline(make_engine) -> None:
    """An engine process alive but answering nothing (SIGSTOP): each control call answers
    503 ``engine_timeout`` naming the engine and the call at its deadline (flush: four
    times it), the waiting futures are dropped, ``/health`` says it is not answering; once
    it runs again the late replies are ignored, the dropped flush never runs, and
    ``/health`` is 200 again."""
    front, process = _split(make_engine(max_total_tokens=4096), call_timeout=0.5)
    pid = process.pid
    stopped = False
    try:
        with TestClient(
            create_app(front, ServerSettings(served_model_name=MODEL), process=process)
        ) as c:
            hi = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            assert c.post("/v1/chat/completions", json={**hi, "max_tokens": 2}).status_code == 200
            cached = c.get("/v1/cache/stats").json()["tree_pages"]
            assert cached > 0
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            for method, path, call, deadline in (
                ("GET", "/v1/cache/stats", "stats_snapshot", 0.5),
                ("GET", "/metrics", "cache_stats", 0.5),
                ("POST", "/v1/cache/flush", "flush_cache", 2.0),
            ):
                start = time.monotonic()
                r = c.request(method, path)
                took = time.monotonic() - start
                assert deadline <= took < deadline + 3, (path, took)
                assert r.status_code == 503, (path, r.text)
                err = r.json()["error"]
                assert err["code"] == "engine_timeout" and err["type"] == "server_error", err
                assert f"engine process (pid {pid})" in err["message"], err
                assert repr(call) in err["message"], err
            assert process._calls == {}  # no future left waiting
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["error"]["code"] == "engine_unhealthy"
            assert "not answering" in h.json()["error"]["message"]
            os.kill(pid, signal.SIGCONT)
            stopped = False
            deadline = time.time() + 10
            while c.get("/health").status_code != 200:  # its next message clears it
                assert time.time() < deadline, "/health stayed 503 after the engine resumed"
                time.sleep(0.05)
            stats = c.get("/v1/cache/stats").json()
            assert stats["tree_pages"] == cached, "the dropped flush ran late"
            assert process._calls == {}
            r = c.post("/v1/chat/completions", json={**hi, "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        process.stop()
    assert not pid_alive(pid)


def test_a_silent_hung_engine_process_is_noticed_by_its_ping(make_engine) -> None:
    """No control call in flight: the client pings an engine silent for ``ping_seconds``;
    a stopped one is reported not answering within ping + deadline."""
    engine = make_engine(max_total_tokens=4096)
    config = dataclasses.replace(engine.config, dtype=engine.describe()["dtype"])

    process = EngineProcessClient(config, restarts=0, call_timeout=0.3, ping_seconds=0.2)
    process.start()
    pid = process.pid

    async def run() -> tuple[str | None, str | None, str | None]:
        process.attach()
        await asyncio.sleep(0.5)
        before = process.unavailable()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.5)
            during = process.unavailable()
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(0.8)
        return before, during, process.unavailable()

    try:
        before, during, after = asyncio.run(run())
    finally:
        process.stop()
    assert before is None and after is None
    assert during is not None and "'ping'" in during and f"pid {pid}" in during
    assert not pid_alive(pid)


def test_a_failed_write_to_a_live_engine_process_restarts_it() -> None:
    """A write that fails while the engine process lives leaves the two sides out of step
    (a message or its descriptors not whole): the process is killed, so its death is
    handled as any other. A failed write to a dead engine kills nothing."""
    from mmserve.frontend.engine_wire import send_batch

    class Broken:
        def send_bytes(self, data) -> None:
            raise OSError("ETOOMANYREFS")

    class Proc:
        def __init__(self, alive: bool) -> None:
            self.alive, self.killed = alive, 0

        def is_alive(self) -> bool:
            return self.alive

        def kill(self) -> None:
            self.killed += 1

    live, dead = Proc(True), Proc(False)
    send_batch(Broken(), None, [("call", 1, "ping", ())], live)  # type: ignore[arg-type]
    send_batch(Broken(), None, [("call", 2, "ping", ())], dead)  # type: ignore[arg-type]
    assert (live.killed, dead.killed) == (1, 0)
