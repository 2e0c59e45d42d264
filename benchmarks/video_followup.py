"""``video-followup``: a second question about the same video frames against the first.

Per round and family (interleaved: round 1 of every family, then round 2, ...), a fresh
engine (empty caches) gets a question about ``--num-frames`` uniform frames of
``samples/video/pans.mp4`` in a video part, then a second, different question about the
same frames. Reported per family (medians over ``--rounds``): prompt tokens, cached
tokens, vision-tower runs and time to first token (engine arrival to the first token;
the frames' preparation happens before, in the front end) of each question, and the
TTFT ratio. The second question should find every frame's features and the prompt up to
its text in the cache, so its TTFT is the question's prefill and one decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks import report, workloads
from benchmarks.in_process import MMServeRunner, model_dir

#: The two questions of each round.
QUESTIONS = ("What happens in this clip?", "Which colours does the camera pass over?")


def _frames(eng: Any, data: bytes, num_frames: int) -> list:
    """``num_frames`` uniform frames of ``data``, decoded and hashed as the server does."""
    from mmserve.vision.hashing import image_key
    from mmserve.vision.inputs import ImageInput
    from mmserve.vision.video import FrameSelection, Video, VideoLimits

    video = Video(data, VideoLimits())
    indices = video.indices(FrameSelection(num_frames=num_frames))
    key = eng.processor.fingerprint
    return [ImageInput(image_key(im, key), im) for im in video.frames(indices)]


def _ask(eng: Any, frames: list, question: str, max_tokens: int) -> dict[str, float]:
    from mmserve.types import SamplingParams

    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    req = eng.processor.make_request(messages=msgs, videos=[frames], params=params)
    prepare = time.perf_counter() - t0
    (res,) = eng.generate([req])
    return {
        "prompt_tokens": res.prompt_tokens,
        "cached_tokens": res.cached_tokens,
        "tower_runs": res.vision_tower_runs,
        "ttft_ms": res.ttft * 1000,
        "prepare_ms": prepare * 1000,
    }


def video_followup(args: argparse.Namespace, model: str) -> int:
    """``video-followup``: cached tokens and TTFT of a second question about a video's
    frames against the first, per family (interleaved rounds, medians)."""
    families = [f for f in args.families.split(",") if f]
    dirs = {f: model if f == args.family else model_dir(args.size, f) for f in families}
    runners = {f: MMServeRunner.load(d, max_total_tokens=32768) for f, d in dirs.items()}
    data = (workloads.ROOT / "samples" / "video" / "pans.mp4").read_bytes()
    samples: dict[str, dict[str, list[dict]]] = {f: {"first": [], "second": []} for f in families}
    frames = {f: _frames(runners[f].engine(), data, args.num_frames) for f in families}
    for f in families:  # warm-up: one text-only request per model
        eng = runners[f].engine()
        hi = eng.processor.make_request(messages=[{"role": "user", "content": "hi"}])
        eng.generate([hi])
    for _ in range(args.rounds):
        for f in families:
            eng = runners[f].engine()  # empty caches
            for name, q in zip(("first", "second"), QUESTIONS, strict=True):
                samples[f][name].append(_ask(eng, frames[f], q, args.max_tokens))
    rows: dict[str, dict] = {}
    for f in families:
        per = runners[f].model.family.video_frame_tokens()
        for name in ("first", "second"):
            runs = samples[f][name]
            row: dict[str, Any] = {"family": f, "question": name, "per_frame": per}
            for k in runs[0]:
                row[k] = statistics.median(r[k] for r in runs)
            rows[f"{f} {name}"] = row
        first, second = rows[f"{f} first"], rows[f"{f} second"]
        second["ttft_ratio"] = second["ttft_ms"] / first["ttft_ms"]
    cols = (
        "row|per frame=per_frame|prompt=prompt_tokens|cached=cached_tokens|tower runs=tower_runs"
        "|TTFT ms=ttft_ms:.1f|prepare ms=prepare_ms:.1f|TTFT / first=ttft_ratio:.3f"
    )
    md = (
        f"{args.num_frames} frames of samples/video/pans.mp4, {args.rounds} interleaved rounds "
        f"(medians), {args.max_tokens} answer tokens, load {report.loadavg()}\n\n"
    )
    md += report.table(rows, cols)
    out = {"models": dirs, "num_frames": args.num_frames, "rounds": args.rounds, "rows": rows}
    return report.emit(args.out, "video_followup", out, md)


#: The subcommand's own options (:data:`benchmarks.__main__.COMMANDS`).
OPTIONS = [
    (("--families",), dict(default="llava-next-video", help="comma-separated, interleaved")),
    (("--num-frames",), dict(type=int, default=8)),
    (("--rounds",), dict(type=int, default=5)),
    (("--max-tokens",), dict(type=int, default=4)),
]
