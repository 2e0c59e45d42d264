"""A real server under pressure: clients that disconnect, and bursts beyond the queue limit."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.live_server import get_json, live_server, metric

MODEL = "tiny"
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(model_dir: Path):
    args = [
        "--served-model-name",
        MODEL,
        "--max-total-tokens",
        "16384",
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "3",
    ]
    with live_server(model_dir, *args) as url:
        yield url


def chat_body(text: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def scrape(server: str) -> str:
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as r:
        return r.read().decode()


def wait_idle(server: str, timeout: float = 30) -> str:
    """Poll /metrics until nothing runs, waits or is queued; returns the last scrape."""
    deadline = time.time() + timeout
    while True:
        text = scrape(server)
        busy = (
            metric(text, "mmserve_num_requests_running")
            + metric(text, "mmserve_num_requests_waiting")
            + metric(text, "mmserve_queue_length")
        )
        if busy == 0 or time.time() > deadline:
            return text
        time.sleep(0.05)


def assert_healthy(server: str) -> None:
    body = json.dumps(chat_body("Say hi.", max_tokens=3, temperature=0)).encode()
    req = urllib.request.Request(
        f"{server}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == 3
    stats = get_json(f"{server}/v1/cache/stats")
    assert stats["running_requests"] == 0 and stats["live_requests"] == 0
    assert stats["accounting"]["ok"] and stats["accounting"]["running"] == 0
    assert stats["free_pages"] + stats["tree_pages"] == stats["pool_pages"]


def test_streaming_client_that_disconnects_is_aborted(server: str) -> None:
    text = scrape(server)
    before = metric(text, "mmserve_requests_total", {"finish_reason": "abort"}, 0.0)
    generated = metric(text, "mmserve_generation_tokens_total", default=0.0)
    with httpx.Client(timeout=60) as http:
        body = chat_body("Tell me everything.", stream=True, **LONG)
        with http.stream("POST", f"{server}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got == 4:
                    # still generating; leaving the loop closes the connection
                    assert metric(scrape(server), "mmserve_num_requests_running") == 1
                    break
    text = wait_idle(server)
    assert metric(text, "mmserve_num_requests_running") == 0
    assert metric(text, "mmserve_requests_total", {"finish_reason": "abort"}) == before + 1
    # it stopped long before max_tokens
    assert metric(text, "mmserve_generation_tokens_total") - generated < 4000
    assert_healthy(server)


def test_non_streaming_client_that_disconnects_is_aborted(server: str) -> None:
    u = urlparse(server)
    body = json.dumps(chat_body("Tell me everything, slowly.", **LONG)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = metric(scrape(server), "mmserve_generation_tokens_total")
    aborts = metric(scrape(server), "mmserve_requests_total", {"finish_reason": "abort"}, 0.0)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head + body)
        deadline = time.time() + 10
        while metric(scrape(server), "mmserve_num_requests_running") < 1:
            assert time.time() < deadline
            time.sleep(0.02)
    text = wait_idle(server)
    assert metric(text, "mmserve_num_requests_running") == 0
    assert metric(text, "mmserve_generation_tokens_total") - before < 4000
    assert metric(text, "mmserve_requests_total", {"finish_reason": "abort"}) == aborts + 1
    assert_healthy(server)


def test_burst_beyond_the_queue_limit_gets_503_with_retry_after(server: str) -> None:
    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        body = chat_body(f"Request {i}: count.", max_tokens=48, ignore_eos=True, temperature=0)
        return await http.post(f"{server}/v1/chat/completions", json=body)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(24)))

    rejected_before = metric(scrape(server), "mmserve_requests_rejected_total")
    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(busy) == 24, [r.status_code for r in responses]
    # requests arriving together all wait for their first token: 3 fit, the rest get 503
    # (later ones may get in as earlier ones start decoding or finish)
    assert len(ok) >= 3 and len(busy) >= 1
    for r in busy:
        assert r.headers["Retry-After"] == "1"
        err = r.json()["error"]
        assert err["code"] == "queue_full" and "retry" in err["message"]
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 48
    text = wait_idle(server)
    assert metric(text, "mmserve_requests_rejected_total") - rejected_before == len(busy)
    assert metric(text, "mmserve_queue_length") == 0
    assert_healthy(server)
