"""Batch jobs: cache-aware order against submitted order, side by side in one run.

A batch of ``--images`` synthetic photos x ``--questions`` questions, shuffled, goes
through ``/v1/files`` + ``/v1/batches`` (the ``openai`` client, in process) twice,
on a fresh engine each time, with ``--batch-order cache`` and ``--batch-order
submitted``. The KV pool (``--max-total-tokens``) holds only a few images, so the
order decides how often an image's KV is evicted before its next question.

Reported per order: hit rate (cached / prompt tokens, from the batch's usage), the
offline optimum (every request sharing the longest prefix any earlier request has,
as with an unbounded cache: sort the token sequences, sum the neighbours' common
prefixes), their ratio, vision-tower runs against distinct photos, and wall time.

Usage::

    python -m benchmarks.batch_order                  # 40 images x 5 questions, tiny, CPU
    python -m benchmarks.batch_order --images 10 --questions 3
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import tempfile
import time

import numpy as np
import openai
from fastapi.testclient import TestClient
from PIL import Image

from api.app import create_app
from api.settings import ServerSettings
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.model.make_checkpoint import ensure_model

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


def run_order(order: str, lines: list[dict], max_total_tokens: int) -> dict:
    """Run the batch with ``order`` on a fresh engine; its figures."""
    engine = Engine(
        EngineConfig(model_path=str(ensure_model("tiny")), max_total_tokens=max_total_tokens)
    )
    with tempfile.TemporaryDirectory() as d:
        settings = ServerSettings(served_model_name="tiny", data_dir=d, batch_order=order)
        with TestClient(create_app(engine, settings)) as http:
            client = openai.OpenAI(
                base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
            )
            data = "\n".join(json.dumps(ln) for ln in lines).encode()
            f = client.files.create(file=("in.jsonl", data), purpose="batch")
            t0 = time.perf_counter()
            batch = client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            while batch.status not in ("completed", "failed", "cancelled", "expired"):
                time.sleep(0.05)
                batch = client.batches.retrieve(batch.id)
            wall = time.perf_counter() - t0
            stats = http.get("/v1/cache/stats").json()
    assert batch.status == "completed" and batch.request_counts.failed == 0, batch
    u = batch.usage
    return {
        "order": order,
        "requests": batch.request_counts.completed,
        "hit_rate": u.input_tokens_details.cached_tokens / u.input_tokens,
        "tower_runs": stats["vision_tower_images"],
        "wall_s": wall,
        "engine": engine,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=40)
    p.add_argument("--questions", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool (tokens)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lines = workload(args.images, args.questions, args.max_tokens, args.seed)
    run_order("cache", lines[:4], args.max_total_tokens)  # warm-up (one-time costs), not shown
    rows = [run_order(o, lines, args.max_total_tokens) for o in ("cache", "submitted")]
    best, total = optimum(rows[0]["engine"], lines)
    print(
        f"{args.images} images x {args.questions} questions, shuffled; KV pool "
        f"{args.max_total_tokens} tokens; {total} prompt tokens; offline optimum hit rate "
        f"{best:.3f}\n"
    )
    print("| order | hit rate | / optimum | tower runs (distinct photos) | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['order']} | {r['hit_rate']:.3f} | {r['hit_rate'] / best:.3f} | "
            f"{r['tower_runs']} ({args.images}) | {r['wall_s']:.1f} |"
        )
    print(f"\nwall time, submitted / cache-aware: {rows[1]['wall_s'] / rows[0]['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
