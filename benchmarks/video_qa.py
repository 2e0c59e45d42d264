"""Per-frame video QA with the prefix and vision caches on vs off (sample video, small model).

Usage: python -m benchmarks.video_qa [--size small] [--num-frames 8] [--max-tokens 16]

Uploads samples/video/pans.mp4 to an in-process server and asks the four
questions of samples/video_qa.py about each of ``num_frames`` frames; prints
the wall time, the vision-tower runs and the cache hit rate for each setting
(off: ``disable_radix_cache`` and no vision-embedding cache).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.model.make_checkpoint import ensure_model
from samples.video_qa import QUESTIONS

VIDEO = Path(__file__).resolve().parents[1] / "samples" / "video" / "pans.mp4"


def run(model: str, cache: bool, num_frames: int, max_tokens: int) -> dict:
    kw = {} if cache else {"disable_radix_cache": True, "vision_cache_bytes": 0}
    engine = Engine(EngineConfig(model_path=model, max_total_tokens=32768, **kw))
    with TestClient(create_app(engine)) as c:
        c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )  # warm-up, text only
        vid = c.post("/v1/videos", files={"file": ("v.mp4", VIDEO.read_bytes())}).json()["id"]
        body = {
            "questions": QUESTIONS,
            "num_frames": num_frames,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        t0 = time.perf_counter()
        r = c.post(f"/v1/videos/{vid}/qa", json=body)
        seconds = time.perf_counter() - t0
    events = [json.loads(x) for x in r.text.splitlines()]
    s = events[-1]
    answers = sorted(
        (e for e in events if e["type"] == "answer"),
        key=lambda e: (e["frame"], e["question_index"]),
    )
    return {
        "cache": cache,
        "seconds": round(seconds, 2),
        "vision_tower_runs": s["vision_tower_runs"],
        "answers": s["answers"],
        "prompt_tokens": s["prompt_tokens"],
        "cached_tokens": s["cached_tokens"],
        "cache_hit_rate": round(s["cache_hit_rate"], 3),
        "texts": [a["text"] for a in answers],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--num-frames", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    model = str(ensure_model(args.size))
    on = run(model, True, args.num_frames, args.max_tokens)
    off = run(model, False, args.num_frames, args.max_tokens)
    same = on.pop("texts") == off.pop("texts")
    print(json.dumps({"model": args.size, "on": on, "off": off, "same_answers": same}, indent=1))


if __name__ == "__main__":
    main()
