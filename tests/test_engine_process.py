"""The engine core's output path and its own process (issue 41): one batch of deltas per
step, one event-loop call per step into per-request slots that merge, the process-split
server giving the in-process server's tokens, and each side dying alone."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import pickle
import signal
import socket
import time

import httpx
import pytest

from api.app import ServerSettings, create_app, start_engine_process
from mmserve.frontend.async_engine import AsyncEngine
from tests.helpers import MODEL, greedy, user
from tests.live_server import (
    child_pids,
    cmdline,
    engine_pid,
    live_server_process,
    pid_alive,
    wait_gone,
    wait_health,
)


def _requests(engine, n: int, max_tokens: int):
    return [
        engine.processor.make_request(
            messages=user(f"count {i}"), params=greedy(max_tokens, ignore_eos=True)
        )
        for i in range(n)
    ]


def test_engine_emits_one_batch_of_every_requests_deltas_per_step(make_engine) -> None:
    eng = make_engine()
    calls: list[list] = []
    eng.on_outputs = calls.append
    reqs = _requests(eng, 5, 6)
    for r in reqs:
        eng.add_request(r)
    steps = 0
    while eng.has_work():
        before = len(calls)
        if eng.step():
            steps += 1
            assert len(calls) == before + 1  # one call per step, whatever the batch
    assert len(calls) == steps
    by_rid: dict[str, list[int]] = {}
    for batch in calls:
        assert len({d.rid for d in batch}) == len(batch)  # one delta per request per step
        for d in batch:
            by_rid.setdefault(d.rid, []).extend(d.token_ids)
    assert max(len(b) for b in calls) == 5  # the decode steps carry all five requests
    offline = make_engine().generate(_requests(eng, 5, 6))
    assert [by_rid[r.rid] for r in reqs] == [o.output_ids for o in offline]


def test_async_engine_posts_once_per_step_and_slots_merge(make_engine) -> None:
    eng = make_engine()
    aeng = AsyncEngine(eng)
    n, tokens = 6, 12

    async def run() -> tuple[int, list[list]]:
        loop = asyncio.get_running_loop()
        posts = 0
        real = loop.call_soon_threadsafe

        def counting(*a, **kw):
            nonlocal posts
            posts += 1
            return real(*a, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        aeng.start()
        updates: list[list] = [[] for _ in range(n)]

        async def consume(i: int, req, slow: bool) -> None:
            async for upd in aeng.stream(req):
                updates[i].append(upd)
                if slow:  # a slow consumer: everything since its last look in one update
                    await asyncio.sleep(0.3)

        reqs = _requests(eng, n, tokens)
        await asyncio.gather(*(consume(i, r, i == 0) for i, r in enumerate(reqs)))
        return posts, updates

    try:
        posts, updates = asyncio.run(run())
    finally:
        aeng.stop()
    st = eng.stats
    steps = st.prefill_steps + st.decode_steps + st.mixed_steps
    # one post per step (a few more for inbox calls), never one per token
    assert posts <= steps + 2 * n, (posts, steps)
    assert posts < n * tokens
    ids = [sum((u.delta_ids for u in ups), ()) for ups in updates]
    assert all(len(i) == tokens for i in ids)
    assert len(updates[0]) < tokens // 2  # the slow one got merged updates
    assert updates[0][-1].result is not None
    assert list(ids[0]) == updates[0][-1].result.output_ids


def test_generate_is_final_only(make_engine) -> None:
    eng = make_engine()
    aeng = AsyncEngine(eng)
    aeng.start()
    try:
        req = _requests(eng, 1, 9)[0]
        seen: list = []

        async def run():
            async for upd in aeng.stream(req, final_only=True):
                seen.append(upd)

        asyncio.run(run())
    finally:
        aeng.stop()
    assert len(seen) == 1 and seen[0].result is not None
    assert len(seen[0].delta_ids) == 9


# ---- the split server against the in-process one --------------------------------------

BODIES = {
    "greedy": {"max_tokens": 12, "temperature": 0},
    "seeded": {"max_tokens": 12, "temperature": 1.0, "seed": 7},
    "n2_seeded": {"max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2},
    "logprobs": {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    "structured": {
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                },
            },
        },
    },
}


def _rounded(value: object) -> object:
    """``value`` with floats to 4 decimals (the processes' thread pools may sum in another
    order: the last bits of a logprob differ, the tokens do not)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _answers(client) -> dict[str, object]:
    from fastapi.testclient import TestClient

    assert isinstance(client, TestClient)
    out: dict[str, object] = {}
    for name, extra in BODIES.items():
        body = {"model": MODEL, "messages": user("tell me a story"), **extra}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out[name] = [
            (c["message"]["content"], c["finish_reason"], _rounded(c.get("logprobs")))
            for c in r.json()["choices"]
        ]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        text: dict[int, str] = {}
        for ln in lines[:-1]:
            for c in json.loads(ln)["choices"]:
                text[c["index"]] = text.get(c["index"], "") + (c["delta"].get("content") or "")
        out[name + "_stream"] = text
    return out


def test_split_server_gives_the_in_process_tokens(make_engine) -> None:
    from fastapi.testclient import TestClient

    engine = make_engine(max_total_tokens=4096)
    settings = ServerSettings(served_model_name=MODEL)
    with TestClient(create_app(engine, settings)) as c:
        want = _answers(c)
    config = engine.config
    config.dtype = engine.describe()["dtype"]
    front, process = start_engine_process(config, restarts=0)
    try:
        with TestClient(create_app(front, settings, process=process)) as c:
            got = _answers(c)
            stats = c.get("/v1/cache/stats").json()  # a control call over the pipe
            assert stats["accounting"]["ok"] is True
            assert stats["requests_finished"] == 2 * sum(b.get("n", 1) for b in BODIES.values())
    finally:
        process.stop()
    assert not pid_alive(process.pid)
    assert got == want
    assert got["structured"][0][0].startswith('{"a"')  # type: ignore[index]  # the grammar held


# ---- each side dies alone (server subprocesses) -----------------------------------------


def _chat(url: str, max_tokens: int = 4, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": user("hi"), "max_tokens": max_tokens, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_engine_process_killed_mid_stream_restarts(model_dir) -> None:
    with live_server_process(model_dir, "--engine-restarts", "1", timeout=180) as (url, srv):
        engine = engine_pid(srv)
        assert _chat(url).status_code == 200
        body = {
            "model": MODEL,
            "messages": user("go on"),
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        lines: list[str] = []
        start = time.time()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    lines.append(ln[6:])
                if len(lines) == 3:
                    os.kill(engine, signal.SIGKILL)
        assert time.time() - start < 30
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])
        assert "error" in err and "engine process" in err["error"]["message"], err
        # /health turns 503 at once, then 200 once the new engine process is ready
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        wait_health(url, 200, 120)
        second = engine_pid(srv)
        assert second != engine and not pid_alive(engine)
        assert _chat(url).status_code == 200
        kids = child_pids(srv.pid)
    assert srv.returncode == 0
    assert not wait_gone(kids, 30)


def test_engine_process_killed_idle_without_restarts_left_exits_nonzero(model_dir) -> None:
    with live_server_process(
        model_dir, "--engine-restarts", "0", "--fatal-exit-seconds", "2", timeout=180
    ) as (url, srv):
        engine = engine_pid(srv)
        kids = child_pids(srv.pid)
        os.kill(engine, signal.SIGKILL)  # idle: no request in flight
        wait_health(url, 503, 10)
        r = _chat(url)
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "engine_unhealthy" and r.headers["Retry-After"]
        assert srv.wait(timeout=60) == 1
        assert not wait_gone(kids, 10)


def test_api_process_killed_the_engine_process_exits(model_dir) -> None:
    with live_server_process(model_dir, timeout=180) as (_, srv):
        kids = child_pids(srv.pid)
        assert kids
        # the engine process is named (its command line is multiprocessing's spawn_main)
        with open(f"/proc/{engine_pid(srv)}/comm") as f:
            assert f.read().strip() == "mmserve-engine"
        srv.kill()
        srv.wait(timeout=10)
        assert not wait_gone(kids, 30), [cmdline(p) for p in kids]


def test_batch_job_resumes_after_an_engine_restart(model_dir, tmp_path) -> None:
    lines = [
        json.dumps(
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": user(f"line {i}"),
                    "max_tokens": 400,
                    "ignore_eos": True,
                },
            }
        )
        for i in range(12)
    ]
    args = ("--data-dir", str(tmp_path / "data"), "--batch-max-in-flight", "4")
    with live_server_process(model_dir, *args, timeout=180) as (url, srv):
        f = httpx.post(
            f"{url}/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", "\n".join(lines).encode())},
            timeout=30,
        ).json()
        b = httpx.post(
            f"{url}/v1/batches",
            json={
                "input_file_id": f["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
            timeout=30,
        ).json()
        deadline = time.time() + 60
        while httpx.get(f"{url}/v1/batches/{b['id']}").json()["request_counts"]["completed"] < 2:
            assert time.time() < deadline
            time.sleep(0.05)
        os.kill(engine_pid(srv), signal.SIGKILL)
        deadline = time.time() + 240
        while (job := httpx.get(f"{url}/v1/batches/{b['id']}").json())["status"] != "completed":
            assert time.time() < deadline and job["status"] in ("validating", "in_progress"), job
            time.sleep(0.2)
        assert job["request_counts"] == {"total": 12, "completed": 12, "failed": 0}, job
        out = httpx.get(f"{url}/v1/files/{job['output_file_id']}/content").text.splitlines()
        records = [json.loads(x) for x in out if x]
        assert sorted(r["custom_id"] for r in records) == sorted(f"l{i}" for i in range(12))
        assert all(r["response"]["status_code"] == 200 for r in records)


def test_engine_restarts_flag_is_checked() -> None:
    from api.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["serve", "--engine-restarts", "-1"])
    with pytest.raises(ValueError, match="--engine-restarts must be >= 0, got -1"):
        settings_from_args(args)
    launch, _, _ = settings_from_args(build_parser().parse_args(["serve"]))
    assert (launch.engine_restarts, launch.engine_in_process) == (3, False)


def test_a_pixel_tensor_crosses_as_a_descriptor_sent_ahead_of_its_message(monkeypatch) -> None:
    """The API pickles a pixel tensor as its shared memory's file descriptor, sent on the
    engine's socket before the message: the engine maps the same memory as it unpickles,
    with nothing lent through ``resource_sharer`` (whose fetch is a round trip to the API
    process, made on the engine's thread)."""
    from multiprocessing import resource_sharer

    import torch

    import mmserve.engine.process as engine_process
    from mmserve.frontend.engine_wire import dumps_sending

    api_end, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lent = resource_sharer._resource_sharer._cache
    before = len(lent)
    pixels = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    empty = torch.zeros(0)
    data = dumps_sending([("add", pixels, empty), ("abort", "r1")], api_end)
    assert len(lent) == before  # nothing lent: the fd went on the socket
    monkeypatch.setattr(engine_process, "_FD_SOCKET", engine_end)
    monkeypatch.setattr(engine_process, "_FDS", collections.deque())
    (kind, got, got_empty), abort = pickle.loads(data)
    assert kind == "add" and abort == ("abort", "r1")
    assert torch.equal(got, pixels) and got.is_shared() and got_empty.numel() == 0
    pixels[1, 2, 3] = -1.0  # one memory in both: no copy per byte
    assert got[1, 2, 3].item() == -1.0
    # a burst: more descriptors than one socket message carries, all sent before the
    # message (the engine reads them as it unpickles), in order
    many = [torch.full((2,), float(i)) for i in range(300)]
    data = dumps_sending([("add", t) for t in many], api_end)
    assert [m[1][0].item() for m in pickle.loads(data)] == [float(i) for i in range(300)]
    assert not engine_process._FDS  # every descriptor taken (and closed)
    api_end.close()
    engine_end.close()


def test_the_engine_writes_a_steps_message_itself_while_the_pipe_has_room(monkeypatch) -> None:
    """No thread hand-off on the way out (idle TTFT): with the sender thread never run,
    a message that fits is in the pipe when ``put`` returns; one larger than the pipe
    is finished by the thread, and what is put meanwhile follows it in order."""
    import multiprocessing
    import threading

    from mmserve.engine.process import PipeSender
    from mmserve.frontend.engine_wire import frames

    rx, tx = multiprocessing.Pipe(duplex=False)
    started = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self))
    sender = PipeSender(tx)
    sender.put([("out", [("r1", (5,))])])
    assert rx.poll(0)  # written by the caller: the sender thread never ran
    assert pickle.loads(rx.recv_bytes()) == [("out", [("r1", (5,))])]
    big = b"x" * (4 << 20)  # more than the pipe holds (1 MiB at most)
    sender.put([("reply", 1, True, big)])
    sender.put([("reply", 2, True, None)])  # behind the unfinished write
    (thread,) = started
    monkeypatch.undo()
    thread.start()  # the thread finishes the first write, then sends the second
    buf, got = bytearray(), list[tuple]()
    os.set_blocking(rx.fileno(), True)
    while len(got) < 2:
        buf += os.read(rx.fileno(), 1 << 20)
        got += [m for payload in frames(buf) for m in pickle.loads(payload)]
    assert got == [("reply", 1, True, big), ("reply", 2, True, None)]
    sender.close()
    rx.close()


def test_a_request_to_an_idle_engine_crosses_without_waiting_for_the_loop(model_dir) -> None:
    """Idle TTFT: the API writes a message at once when no other request is in flight
    (no turn of the event loop first); while others are, messages of one turn are
    batched into one write."""
    import multiprocessing

    from mmserve.config import EngineConfig
    from mmserve.frontend.engine_client import EngineProcessClient

    client = EngineProcessClient(EngineConfig(model_path=str(model_dir)))
    rx, tx = multiprocessing.Pipe(duplex=False)
    loop = asyncio.new_event_loop()
    client._loop, client._tx, client._ready = loop, tx, True
    try:
        client._send(("abort", "r0"))  # nothing in flight: written now, loop not run
        assert rx.poll(0) and pickle.loads(rx.recv_bytes()) == [("abort", "r0")]
        client._slots.update({"a": object(), "b": object()})  # type: ignore[dict-item]
        client._send(("abort", "r1"))
        client._send(("abort", "r2"))
        assert not rx.poll(0)  # busy: queued for the end of this turn of the loop
        loop.run_until_complete(asyncio.sleep(0))
        assert pickle.loads(rx.recv_bytes()) == [("abort", "r1"), ("abort", "r2")]
    finally:
        loop.close()
        rx.close()
        tx.close()
