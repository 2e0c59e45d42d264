"""Upload each sample photo to a running mmserve and ask it three questions.

Usage: python samples/ask.py [--url http://127.0.0.1:8000] [--images DIR]

Prints each answer with its prompt tokens, cached tokens and latency; the
second and third questions about a photo should report the image's 576 tokens
(and the text before it) as cached. Uses only the standard library.
"""

from __future__ import annotations

import argparse
import base64
import json
import time
import urllib.request
from pathlib import Path

QUESTIONS = ["What is in this photo?", "What colours stand out?", "Where might it be taken?"]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--images", default=str(Path(__file__).parent / "images"))
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    with urllib.request.urlopen(f"{args.url}/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    total_prompt = total_cached = 0
    for path in sorted(Path(args.images).iterdir()):
        if path.suffix.lower() not in (".png", ".jpg", ".jpeg"):
            continue
        data = base64.b64encode(path.read_bytes()).decode()
        info = post(f"{args.url}/v1/images", {"data": data})
        print(f"\n{path.name}: id={info['id']} {info['width']}x{info['height']}")
        for q in QUESTIONS:
            t0 = time.perf_counter()
            out = post(
                f"{args.url}/v1/chat/completions",
                {
                    "model": model,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": info["id"]}},
                                {"type": "text", "text": q},
                            ],
                        }
                    ],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                },
            )
            dt = time.perf_counter() - t0
            u = out["usage"]
            cached = u["prompt_tokens_details"]["cached_tokens"]
            total_prompt += u["prompt_tokens"]
            total_cached += cached
            answer = out["choices"][0]["message"]["content"]
            print(f"  Q: {q}\n  A: {answer!r}")
            print(f"     prompt={u['prompt_tokens']} cached={cached} time={dt:.2f}s")
    if total_prompt:
        print(f"\ncached fraction of prompt tokens: {total_cached / total_prompt:.3f}")


if __name__ == "__main__":
    main()
