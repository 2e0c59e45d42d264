"""Batch jobs against a live server: cache hits, throughput, and interactive TTFT.

One run starts ``mmserve serve`` (tiny checkpoint, CPU, one thread, 127.0.0.1) three
times, each fresh, with the same flags (``--max-total-tokens`` KV pool, ``--data-dir`` a
temporary directory), and measures the issue's three figures side by side:

a. **Cache order.** ``--images`` synthetic photos x ``--questions`` questions, shuffled
   (:func:`benchmarks.batch_order.workload`), through ``/v1/files`` + ``/v1/batches``:
   hit rate (cached / prompt tokens, from the batch's ``usage``) against the offline
   optimum (:func:`benchmarks.batch_order.optimum`), and vision-tower runs
   (``/v1/cache/stats``) against distinct photos. Wall time from ``batches.create`` to
   ``completed`` (validation included).
b. **Throughput.** The same requests sent to ``/v1/chat/completions`` all at once from
   one client (non-streaming, one connection each), on a fresh server: requests/s of
   the batch over requests/s of the burst.
c. **Interactive TTFT.** On a third fresh server, a client sends one short streaming
   chat request at a time, one every ``--probe-period`` seconds, and times its first
   content chunk: ``--probes`` before the batch, then while a batch ``--ttft-scale``
   times larger (as many questions about that many times the photos, so that it runs
   long enough for a few dozen probes) runs, until it completes, then ``--probes``
   after. TTFT p50 during the batch / p50 of the
   probes before and after (pooled, so a drift in machine load over the run shows in
   neither alone).

Usage::

    python -m benchmarks.batch_api                    # 40 photos x 10 questions, ~2 min
    python -m benchmarks.batch_api --images 8 --questions 3 --probes 5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import shlex
import statistics
import tempfile
import time

import httpx
import numpy as np
from PIL import Image

from benchmarks.over_http import mmserve_server
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.testing.checkpoints import ensure_model

QUESTIONS = [
    "What is in this photo?",
    "Describe the colours you can see.",
    "Is this photo taken indoors or outdoors?",
    "What is the main object?",
    "Write a one-sentence caption.",
    "How many objects are visible?",
    "What time of day is it?",
    "Give this picture a title.",
    "What is in the background?",
    "Which object is largest?",
]


def photos(n: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct 64x64 PNGs (seeded noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def workload(n_images: int, n_questions: int, max_tokens: int, seed: int) -> list[dict]:
    """The batch's lines (as dicts), shuffled with ``seed``."""
    lines = []
    for i, png in enumerate(photos(n_images, seed)):
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        for k in range(n_questions):
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": QUESTIONS[k % len(QUESTIONS)]},
            ]
            body = {
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            lines.append(
                {
                    "custom_id": f"img{i}-q{k}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": body,
                }
            )
    random.Random(seed).shuffle(lines)
    return lines


def optimum(engine: Engine, lines: list[dict]) -> tuple[float, int]:
    """Offline optimum hit rate of ``lines`` and their prompt tokens in all.

    With an unbounded cache, each request at best reuses the longest prefix of any
    other request before it; over all orders that is maximised by a depth-first
    order, where it is the common prefix with the lexicographic predecessor (capped
    at all but the last token, which is always computed).
    """
    images: dict[str, object] = {}
    seqs = []
    for ln in lines:
        parts = ln["body"]["messages"][0]["content"]
        url = parts[0]["image_url"]["url"]
        if url not in images:
            images[url] = engine.processor.prepare_image(base64.b64decode(url.split(",", 1)[1]))
        msgs = [{"role": "user", "content": [{"type": "image"}, parts[1]]}]
        req = engine.processor.make_request(
            messages=msgs, images=[images[url]], params=SamplingParams(max_tokens=1)
        )
        seqs.append(req.input_ids)
    seqs.sort()
    total = sum(len(s) for s in seqs)
    cached = 0
    for prev, cur in zip(seqs, seqs[1:], strict=False):
        lcp = 0
        for a, b in zip(prev, cur, strict=False):
            if a != b:
                break
            lcp += 1
        cached += min(lcp, len(cur) - 1)
    return cached / total, total


MODEL = "tiny"
TERMINAL = ("completed", "failed", "cancelled", "expired")


def server_flags(data_dir: str, max_total_tokens: int) -> list[str]:
    """``mmserve serve`` flags shared by the three servers."""
    return [
        "--served-model-name",
        MODEL,
        "--max-total-tokens",
        str(max_total_tokens),
        "--data-dir",
        data_dir,
    ]


async def create_batch(http: httpx.AsyncClient, lines: list[dict]) -> str:
    """Upload ``lines`` and create a chat-completions batch over them; its id."""
    data = "\n".join(json.dumps(ln) for ln in lines).encode()
    r = await http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)})
    r.raise_for_status()
    r = await http.post(
        "/v1/batches",
        json={
            "input_file_id": r.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    r.raise_for_status()
    return r.json()["id"]


async def wait_batch(http: httpx.AsyncClient, batch_id: str, timeout: float = 900) -> dict:
    """Poll the batch every 50 ms until it ends; the final batch object.

    Raises:
        TimeoutError: after ``timeout`` seconds.
    """
    deadline = time.perf_counter() + timeout
    while True:
        b = (await http.get(f"/v1/batches/{batch_id}")).json()
        if b["status"] in TERMINAL:
            return b
        if time.perf_counter() > deadline:
            raise TimeoutError(f"batch {batch_id} still {b['status']} after {timeout} s")
        await asyncio.sleep(0.05)


async def run_batch(url: str, lines: list[dict]) -> dict:
    """(a): the batch's hit rate, tower runs and wall time on the server at ``url``."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        b = await wait_batch(http, await create_batch(http, lines))
        wall = time.perf_counter() - t0
        stats = (await http.get("/v1/cache/stats")).json()
    assert b["status"] == "completed" and b["request_counts"]["failed"] == 0, b
    u = b["usage"]
    return {
        "requests": b["request_counts"]["completed"],
        "hit_rate": u["input_tokens_details"]["cached_tokens"] / u["input_tokens"],
        "tower_runs": stats["vision_tower_images"],
        "wall_s": wall,
    }


async def run_burst(url: str, lines: list[dict]) -> dict:
    """(b): every line's body sent to ``/v1/chat/completions`` at once; hit rate and wall."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(body: dict) -> dict:
            r = await http.post("/v1/chat/completions", json={"model": MODEL, **body})
            r.raise_for_status()
            return r.json()["usage"]

        t0 = time.perf_counter()
        usages = await asyncio.gather(*(one(ln["body"]) for ln in lines))
        wall = time.perf_counter() - t0
        stats = (await http.get("/v1/cache/stats")).json()
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {
        "requests": len(usages),
        "hit_rate": cached / prompt,
        "tower_runs": stats["vision_tower_images"],
        "wall_s": wall,
    }


async def probe(http: httpx.AsyncClient, k: int) -> float:
    """One short streaming chat request; seconds from send to its first content chunk."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say hello to visitor number {k}."}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    ttft = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or []:
                if ttft is None and (choice.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - sent
    if ttft is None:  # every token decoded to held-back bytes: the end is the first text
        ttft = time.perf_counter() - sent
    return ttft


async def probes(http: httpx.AsyncClient, period: float, start: int, until) -> list[float]:  # noqa: ANN001
    """Probe every ``period`` seconds (one at a time) until ``until(count)`` is true."""
    out: list[float] = []
    tick = time.perf_counter()
    while not until(len(out)):
        out.append(await probe(http, start + len(out)))
        tick += period
        await asyncio.sleep(max(0.0, tick - time.perf_counter()))
    return out


async def run_ttft(url: str, lines: list[dict], n: int, period: float) -> dict:
    """(c): probe TTFTs before, during and after the batch on the server at ``url``."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for k in range(3):  # warm-up: first-request costs, not counted
            await probe(http, 1000 + k)
        before = await probes(http, period, 0, lambda c: c >= n)
        batch_id = await create_batch(http, lines)
        done = asyncio.ensure_future(wait_batch(http, batch_id))
        during = await probes(http, period, n, lambda c: c > 0 and done.done())
        b = await done
        after = await probes(http, period, 10 * n, lambda c: c >= n)
    assert b["status"] == "completed" and b["request_counts"]["failed"] == 0, b
    base = statistics.median(before + after)
    busy = statistics.median(during)
    return {
        "before_p50": statistics.median(before),
        "after_p50": statistics.median(after),
        "idle_p50": base,
        "during_p50": busy,
        "during_n": len(during),
        "ratio": busy / base,
    }


def main(argv: list[str] | None = None) -> dict:
    """Run (a), (b) and (c), print the table; the figures as a dict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny one)")
    p.add_argument("--images", type=int, default=40)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool (tokens)")
    p.add_argument("--probes", type=int, default=20, help="TTFT probes before and after")
    p.add_argument("--probe-period", type=float, default=0.3, help="seconds between probes")
    p.add_argument("--ttft-scale", type=int, default=3, help="photos x this in (c)'s batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-flags", default="", help="more mmserve serve flags (one string)")
    args = p.parse_args(argv)
    flags = shlex.split(args.server_flags)
    model = args.model or ensure_model("tiny")
    lines = workload(args.images, args.questions, args.max_tokens, args.seed)
    engine = Engine(EngineConfig(model_path=str(model), max_total_tokens=args.max_total_tokens))
    best, total = optimum(engine, lines)
    n_long = args.images * args.ttft_scale
    long_lines = workload(n_long, args.questions, args.max_tokens, args.seed + 1)
    del engine
    results = {}
    for name, fn in (
        ("batch", lambda url: run_batch(url, lines)),
        ("burst", lambda url: run_burst(url, lines)),
        ("ttft", lambda url: run_ttft(url, long_lines, args.probes, args.probe_period)),
    ):
        with (
            tempfile.TemporaryDirectory() as d,
            mmserve_server(model, server_flags(d, args.max_total_tokens) + flags) as (url, _),
        ):
            results[name] = asyncio.run(fn(url))
    a, b, c = results["batch"], results["burst"], results["ttft"]
    n = len(lines)
    print(
        f"flags: {' '.join(flags) or '(defaults)'}; "
        f"{args.images} photos x {args.questions} questions, shuffled ({n} requests, "
        f"{total} prompt tokens); KV pool {args.max_total_tokens} tokens; offline optimum "
        f"hit rate {best:.3f}\n"
    )
    print("| run | hit rate | / optimum | tower runs (photos) | wall s | req/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, r in (("/v1/batches", a), ("chat burst", b)):
        print(
            f"| {label} | {r['hit_rate']:.3f} | {r['hit_rate'] / best:.3f} | "
            f"{r['tower_runs']} ({args.images}) | {r['wall_s']:.1f} | {n / r['wall_s']:.1f} |"
        )
    print(f"\nthroughput, batch / burst: {b['wall_s'] / a['wall_s']:.2f}")
    print(
        f"interactive TTFT p50: {c['idle_p50'] * 1e3:.1f} ms without the batch (before "
        f"{c['before_p50'] * 1e3:.1f}, after {c['after_p50'] * 1e3:.1f}), "
        f"{c['during_p50'] * 1e3:.1f} ms during a batch of {len(long_lines)} "
        f"({c['during_n']} probes); "
        f"ratio {c['ratio']:.2f}"
    )
    out = {"optimum": best, **results}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
