"""The process-split server when its engine process is gone (issue 41): control calls
(``/metrics``, ``/v1/cache/*``) fail at once with a 503 naming the engine, and a stop
ends whatever the engine left unanswered (no request or call waits forever)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app, start_engine_process
from mmserve.frontend.engine_client import EngineUnavailable
from tests.helpers import MODEL, greedy, user
from tests.live_server import pid_alive


def _split(engine):
    config = dataclasses.replace(engine.config, dtype=engine.describe()["dtype"])
    return start_engine_process(config, restarts=0)


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
    from multiprocessing import resource_sharer

    front, process = _split(make_engine(max_total_tokens=4096))
    image = front.processor.prepare_image(photos["astronaut.png"], front.processor.image_mode(1))
    req = front.processor.make_request(
        messages=user(None, "Describe it."), images=[image], params=greedy(4)
    )
    lent = resource_sharer._resource_sharer._cache  # fds lent until their receiver takes them

    async def run() -> tuple[int, str | None]:
        process.attach()
        os.kill(process.pid, signal.SIGSTOP)  # the add stays in the pipe, unread
        gen = asyncio.ensure_future(process.generate(req))
        await asyncio.sleep(0.3)
        sent = len(lent)
        os.kill(process.pid, signal.SIGKILL)
        res = await asyncio.wait_for(gen, timeout=10)
        return sent, res.finish_reason

    try:
        sent, finish = asyncio.run(run())
    finally:
        process.stop()
    assert sent >= 1 and finish == "error"  # the pixels crossed as a lent fd, then it died
    assert len(lent) == 0, "the dead engine's shared memory is still held"
