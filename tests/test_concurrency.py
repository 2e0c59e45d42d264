"""32 clients at once, 4 questions each about one of 4 images, on a real server.

Every answer must equal the answer to the same request sent alone (greedy; the
near-tie rule of invariant (4) in docs/architecture.md, section 2, judged from the
reference's top-2 logprobs), each image must go through the vision tower once, and
the cache hit rate reported by /metrics must be above 0.7.
"""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import TIE_EPS
from tests.live_server import live_server, metric

MODEL = "tiny"
CLIENTS = 32
PER_CLIENT = 4
QUESTIONS = [
    "What is in this picture?",
    "What colours stand out?",
    "Where might it be?",
    "Is anything moving?",
    "What time of day is it?",
    "Describe the background.",
]


@pytest.fixture(scope="module")
def server(model_dir: Path):
    with live_server(model_dir, "--served-model-name", MODEL) as url:
        yield url


def request_body(image_id: str, question: str) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": image_id}},
        {"type": "text", "text": question},
    ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }


def plan(image_ids: list[str]) -> list[list[tuple[str, str]]]:
    """Client c asks about image c % 4, questions (c + k) % 6 for k < 4."""
    return [
        [
            (image_ids[c % len(image_ids)], QUESTIONS[(c + k) % len(QUESTIONS)])
            for k in range(PER_CLIENT)
        ]
        for c in range(CLIENTS)
    ]


async def run_clients(server: str, work: list[list[tuple[str, str]]]) -> list[list[dict]]:
    async def client(http: httpx.AsyncClient, asks: list[tuple[str, str]]) -> list[dict]:
        out = []
        for image_id, q in asks:
            r = await http.post(f"{server}/v1/chat/completions", json=request_body(image_id, q))
            assert r.status_code == 200, r.text
            out.append(r.json())
        return out

    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        return await asyncio.gather(*(client(http, w) for w in work))


def assert_same_answer(ours: dict, ref: dict, what: str) -> None:
    """Token strings equal, unless the reference had a near-tie where they first differ."""
    a = [t["token"] for t in ours["choices"][0]["logprobs"]["content"]]
    b = [t["token"] for t in ref["choices"][0]["logprobs"]["content"]]
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            top = ref["choices"][0]["logprobs"]["content"][step]["top_logprobs"]
            gap = top[0]["logprob"] - top[1]["logprob"]
            assert gap < TIE_EPS, f"{what}: step {step} {x!r} vs {y!r}, top-2 gap {gap:.3g}"
            return
    assert a == b, what
    assert ours["choices"][0]["message"] == ref["choices"][0]["message"], what


def test_32_clients_4_questions_4_images(server: str, photos: dict[str, bytes]) -> None:
    names = [n for n in sorted(photos) if n.endswith((".png", ".jpg"))][:4]
    assert len(names) == 4
    with httpx.Client(timeout=60) as http:
        image_ids = [
            http.post(
                f"{server}/v1/images", json={"data": base64.b64encode(photos[n]).decode()}
            ).json()["id"]
            for n in names
        ]
    work = plan(image_ids)

    t0 = time.perf_counter()
    answers = asyncio.run(run_clients(server, work))
    wall = time.perf_counter() - t0

    with httpx.Client(timeout=60) as http:
        text = http.get(f"{server}/metrics").text
        stats = http.get(f"{server}/v1/cache/stats").json()
    n_requests = CLIENTS * PER_CLIENT
    out_tokens = sum(a["usage"]["completion_tokens"] for client in answers for a in client)
    hit_rate = metric(text, "mmserve_cache_hit_rate")
    print(
        f"\n{n_requests} requests from {CLIENTS} clients in {wall:.2f} s: "
        f"{n_requests / wall:.1f} req/s, {out_tokens / wall:.1f} output tok/s, "
        f"cache hit rate {hit_rate:.3f}"
    )
    assert metric(text, "mmserve_requests_total", {"finish_reason": "length"}) == n_requests
    assert hit_rate > 0.7
    assert metric(text, "mmserve_vision_tower_runs_total") == 4  # each image encoded once
    assert metric(text, "mmserve_num_requests_running") == 0
    assert stats["accounting"]["ok"] and stats["accounting"]["running"] == 0

    # the same requests one by one
    reference: dict[tuple[str, str], dict] = {}
    with httpx.Client(timeout=60) as http:
        for image_id, q in sorted({ask for client in work for ask in client}):
            r = http.post(f"{server}/v1/chat/completions", json=request_body(image_id, q))
            reference[(image_id, q)] = r.json()
    assert len(reference) == 24
    for c, (asks, outs) in enumerate(zip(work, answers, strict=True)):
        for ask, out in zip(asks, outs, strict=True):
            assert_same_answer(out, reference[ask], f"client {c} {ask}")
            assert out["usage"]["prompt_tokens"] == reference[ask]["usage"]["prompt_tokens"]
