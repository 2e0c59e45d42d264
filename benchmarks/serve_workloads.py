"""Workloads of the HTTP serving benchmark (:mod:`benchmarks.serve`) and their sizes.

The four of :mod:`benchmarks.workloads` (``many_questions``, ``multi_turn``,
``video_frames``, ``no_sharing``) plus ``llava_bench``, the shape of the SGLang paper's
LLaVA-bench-in-the-wild runs: many photos, a few questions each (24 images and 60
questions in the original). Over HTTP every workload is open-loop: requests go in
submission order (for ``multi_turn``, turn t of every session before turn t + 1; its
prompts hold canned assistant turns, so they do not depend on earlier answers) at the
times of the arrival process, whatever the server is doing.
"""

from __future__ import annotations

import random
from typing import Any

from benchmarks import workloads
from benchmarks.workloads import Prompt, Workload

WORKLOADS = ("many_questions", "llava_bench", "multi_turn", "video_frames", "no_sharing")

#: Sizes per scale; ``rates``: offered request rates (req/s; inf = a burst).
SCALES: dict[str, dict[str, Any]] = {
    "ci": dict(
        many_questions=dict(k=1, m=2),
        llava_bench=dict(k=2, m=1),
        multi_turn=dict(c=1, t=2),
        video_frames=dict(f=2, q=1),
        no_sharing=dict(n=2),
        max_tokens=3,
        rates=[float("inf")],
    ),
    "quick": dict(
        many_questions=dict(k=3, m=6),
        llava_bench=dict(k=8, m=2),
        multi_turn=dict(c=4, t=3),
        video_frames=dict(f=6, q=2),
        no_sharing=dict(n=4),
        max_tokens=8,
        rates=[1.0, float("inf")],
    ),
    "full": dict(
        many_questions=dict(k=4, m=10),
        llava_bench=dict(k=24, m=2.5),
        multi_turn=dict(c=8, t=5),
        video_frames=dict(f=16, q=4),
        no_sharing=dict(n=12),
        max_tokens=16,
        rates=[0.5, 1.0, 2.0, float("inf")],
    ),
}


def llava_bench(k: int, m: float, max_tokens: int, seed: int = 0) -> Workload:
    """``k`` photos with about ``m`` questions each (``round(k * m)`` in all, spread as
    evenly as possible), shared system prompt, shuffled: few questions per image, so
    most of what a cache can reuse is the system prompt, and each photo's features and
    KV only a couple of times."""
    rnd = random.Random(seed)
    imgs = workloads.photos(k)
    names = list(imgs)
    total = max(k, round(k * m))
    prompts = []
    for i, name in enumerate(names):
        count = total // k + (1 if i < total % k else 0)
        for q in workloads._pick(rnd, workloads.QUESTIONS, count):
            msgs = [
                {"role": "system", "content": workloads.SYSTEM_PROMPT},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]},
            ]
            prompts.append(Prompt(msgs, [name]))
    rnd.shuffle(prompts)
    return Workload(
        "llava_bench",
        f"{k} photos x ~{m:g} questions each ({total} requests; the SGLang paper's "
        "llava-bench-in-the-wild shape), shared system prompt, shuffled",
        imgs,
        [prompts],
        max_tokens,
        {"images": k, "questions": total, "max_tokens": max_tokens, "seed": seed},
        [f"images: {', '.join(names)} (beyond the 4 sample photos: flipped/rotated copies)"],
    )


def build(name: str, scale: dict[str, Any], seed: int = 0) -> Workload:
    """The workload ``name`` at ``scale`` (a value of :data:`SCALES`)."""
    n = scale["max_tokens"]
    p = scale[name]
    if name == "many_questions":
        return workloads.many_questions(p["k"], p["m"], n, seed)
    if name == "llava_bench":
        return llava_bench(p["k"], p["m"], n, seed)
    if name == "multi_turn":
        return workloads.multi_turn(p["c"], p["t"], n, seed)
    if name == "video_frames":
        return workloads.video_frames(p["f"], p["q"], n, seed)
    if name == "no_sharing":
        return workloads.no_sharing(p["n"], n, seed)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
