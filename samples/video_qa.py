"""Upload the sample video to a running mmserve and ask questions about its frames.

Usage: python samples/video_qa.py [--url http://127.0.0.1:8000] [--video FILE]
       [--num-frames 8] [--mode per_frame|clip]

Streams the answers (newline-delimited JSON) as they finish: frame, timestamp,
question, text and cached tokens, then the summary with totals, the cache hit
rate and the vision-tower runs. Uses only the standard library.
"""

from __future__ import annotations

import argparse
import base64
import json
import time
import urllib.request
from pathlib import Path

QUESTIONS = [
    "What is in this frame?",
    "What colours stand out?",
    "Is anything moving?",
    "Where might it be?",
]


def post(url: str, body: dict):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--video", default=str(Path(__file__).parent / "video" / "pans.mp4"))
    ap.add_argument("--num-frames", type=int, default=8)
    ap.add_argument("--mode", default="per_frame", choices=["per_frame", "clip"])
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    data = base64.b64encode(Path(args.video).read_bytes()).decode()
    with post(f"{args.url}/v1/videos", {"data": data}) as r:
        info = json.loads(r.read())
    print(
        f"{info['id']}: {info['duration']:.1f} s, {info['num_frames']} frames at "
        f"{info['fps']:g} fps, {info['width']}x{info['height']}"
    )
    body = {
        "questions": QUESTIONS,
        "num_frames": args.num_frames,
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
    }
    t0 = time.perf_counter()
    with post(f"{args.url}/v1/videos/{info['id']}/qa", body) as r:
        for line in r:
            ev = json.loads(line)
            if ev["type"] == "frames":
                times = ", ".join(f"{f['timestamp']:.1f}s" for f in ev["frames"])
                print(f"frames: {times}; {ev['num_answers']} answers to come")
            elif ev["type"] == "answer":
                where = f"frame {ev['frame']} @ {ev['timestamp']:.1f}s" if "frame" in ev else "clip"
                print(
                    f"[{ev['completed']}/{ev['total']}] {where} q{ev['question_index']}: "
                    f"{ev['text']!r} (cached {ev['cached_tokens']}/{ev['prompt_tokens']})"
                )
            elif ev["type"] == "summary":
                print(
                    f"\n{ev['answers']} answers, {ev['frames']} frames "
                    f"({ev['distinct_frames']} distinct), {ev['questions']} questions; "
                    f"prompt {ev['prompt_tokens']} tokens, cached {ev['cached_tokens']} "
                    f"(hit rate {ev['cache_hit_rate']:.1%}); vision tower runs "
                    f"{ev['vision_tower_runs']}; {time.perf_counter() - t0:.2f} s"
                )
            else:
                print(ev)


if __name__ == "__main__":
    main()
