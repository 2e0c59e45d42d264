"""``salt``: what a cache salt (a tenant) lets a probe learn, and what salting costs.

Isolation, per round (interleaved: the three cases in turn, each on a fresh engine with
empty caches): tenant A asks about a photo, then tenant B sends the same photo and
question (B's salt: the probe of another tenant's cached image); against B asking about
it on an engine that never saw it (the cold probe), and A asking again (the hit the
salt hides). Each request is timed from the bytes (decode, hash, preprocess, tokenize:
the front end, as the server does it) to the first token; the probe should take what
the cold one takes (ratio within the noise: it learns nothing) and report no cached
tokens.

Cost: the same workload (``--images`` photos x ``--questions`` questions) unsalted and
all under one salt: the hit rate (cached / prompt tokens) should be equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks import report, workloads
from benchmarks.in_process import MMServeRunner


def _ask(eng: Any, data: bytes, question: str, salt: str) -> dict[str, float]:
    from mmserve.types import SamplingParams

    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    image = eng.processor.prepare_image(data)
    req = eng.processor.make_request(messages=msgs, images=[image], params=params, cache_salt=salt)
    front = time.perf_counter() - t0
    (res,) = eng.generate([req])
    return {
        "ttft_ms": (front + res.ttft) * 1000,
        "cached_tokens": res.cached_tokens,
        "prompt_tokens": res.prompt_tokens,
        "tower_runs": res.vision_tower_runs,
    }


def cache_salt(args: argparse.Namespace, model: str) -> int:
    """``salt``: TTFT of a probe for another tenant's cached image against a cold probe
    (interleaved rounds, medians), and the hit rate salted against unsalted."""
    runner = MMServeRunner.load(model, max_total_tokens=32768)
    photos = list(workloads.photos(max(args.images, 2)).values())
    question = "What is in this photo?"
    warm = runner.engine()
    _ask(warm, photos[-1], "hi", "")  # one-time costs out of the first round
    cases: dict[str, list[dict]] = {"cold probe": [], "other tenant's image": [], "own image": []}
    for r in range(args.rounds):
        data = photos[r % len(photos)]
        for name in cases:
            eng = runner.engine()  # empty caches
            # tenant A's request first in every case (the cold case: about another
            # photo), so each probe is its engine's second request
            first = photos[(r + 1) % len(photos)] if name == "cold probe" else data
            _ask(eng, first, question, "tenant-a")
            probe = "tenant-a" if name == "own image" else "tenant-b"
            cases[name].append(_ask(eng, data, question, probe))
    rows: dict[str, dict] = {}
    cold = statistics.median(s["ttft_ms"] for s in cases["cold probe"])
    for name, runs in cases.items():
        row = {k: statistics.median(s[k] for s in runs) for k in runs[0]}
        row["ratio"] = row["ttft_ms"] / cold
        q = statistics.quantiles([s["ttft_ms"] for s in runs], n=4)
        row["iqr_ms"] = q[2] - q[0]  # the noise the ratio is judged against
        rows[name] = row
    hit: dict[str, float] = {}
    for label, salt in (("no salt", ""), ("one salt", "tenant-a")):
        eng = runner.engine()
        cached = prompt = 0
        for q in range(args.questions):
            for data in photos[: args.images]:
                s = _ask(eng, data, f"Question {q} about this photo?", salt)
                cached += s["cached_tokens"]
                prompt += s["prompt_tokens"]
        hit[label] = cached / prompt
    cols = (
        "row|TTFT ms=ttft_ms:.1f|IQR ms=iqr_ms:.1f|TTFT / cold=ratio:.3f|cached=cached_tokens"
        "|tower runs=tower_runs|prompt=prompt_tokens"
    )
    md = (
        f"{args.rounds} interleaved rounds (medians), TTFT from the image bytes to the first "
        f"token, load {report.loadavg()}\n\n" + report.table(rows, cols) + "\n\n"
        f"Hit rate, {args.images} photos x {args.questions} questions: no salt "
        f"{hit['no salt']:.4f}, one salt {hit['one salt']:.4f}\n"
    )
    out = {"model": model, "rounds": args.rounds, "rows": rows, "hit_rate": hit}
    return report.emit(args.out, "salt", out, md)


#: The subcommand's own options (:data:`benchmarks.__main__.COMMANDS`).
OPTIONS = [
    (("--rounds",), dict(type=int, default=15)),
    (("--images",), dict(type=int, default=4)),
    (("--questions",), dict(type=int, default=3)),
]
