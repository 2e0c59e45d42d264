"""Host and disk KV tiers against tiers off, in one run: many photos, a small pool.

N photos, Q questions about each, asked round-robin (every photo's first question,
then every photo's second, ...), the way many users ask about their own photos
minutes apart: by the time a photo's next question comes, the pool (``--pool-images``
photos' worth of KV) has evicted it. The same workload runs on fresh engines over one
loaded model:

* ``off``: radix cache only (the pool);
* ``host``: plus a host-memory tier big enough for every photo (``kv_host_bytes``);
* ``disk``: plus a disk tier in a temporary directory (``kv_disk_dir``), host tier off;
* ``optimum``: a pool holding everything, the offline bound on the hit rate.

Then a restart: the ``disk`` engine shuts down (writing its tree's pages), a new engine
on the same directory asks one question about each of the first 10 photos, and the
share of image tokens that came back cached and the vision-tower runs are reported.

Requests go in groups of ``--concurrency`` to ``Engine.generate``; TTFT is per
request (arrival to first token), req/s is requests over the wall time of the run.

Usage::

    python -m benchmarks.kv_tiers                  # tiny model on CPU, about a minute
    python -m benchmarks.kv_tiers --size small --images 24 --page-size 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from benchmarks.many_questions import QUESTIONS, sample_images
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.model.loader import LoadedModel, load_model
from mmserve.model.make_checkpoint import ensure_model


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def _engine(args: argparse.Namespace, model_path: str, model: LoadedModel, **kw) -> Engine:
    return Engine(
        EngineConfig(
            model_path=model_path,
            device=args.device,
            page_size=args.page_size,
            max_total_tokens=kw.pop("max_total_tokens", None) or args.pool_tokens,
            **kw,
        ),
        model=model,
    )


def run_workload(
    eng: Engine, images: list[bytes], questions: int, concurrency: int, max_tokens: int
) -> dict:
    """Ask ``questions`` questions about every image, round-robin; returns the figures."""
    imgs = [eng.processor.prepare_image(b) for b in images]
    order = [(q, i) for q in range(questions) for i in range(len(imgs))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = []
    t0 = time.perf_counter()
    for g in range(0, len(order), concurrency):
        reqs = [
            eng.processor.make_request(
                messages=_messages(QUESTIONS[q % len(QUESTIONS)]), images=[imgs[i]], params=params
            )
            for q, i in order[g : g + concurrency]
        ]
        results += eng.generate(reqs)
    wall = time.perf_counter() - t0
    eng.scheduler.check_accounting()
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    ttft = sorted(r.ttft * 1e3 for r in results)
    stats = eng.cache_stats()
    return {
        "requests": len(results),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 3),
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p90_ms": round(ttft[int(0.9 * (len(ttft) - 1))], 1),
        "hit_rate": round(cached / prompt, 4),
        "vision_tower_runs": eng.runner.vision_tower_images,
        "host_hit_tokens": stats.get("tier_host_hit_tokens", 0),
        "disk_hit_tokens": stats.get("tier_disk_hit_tokens", 0),
        "disk_load_s": round(stats.get("tier_load_seconds", 0.0), 3),
        "outputs": [r.output_ids for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", help="checkpoint size of make_checkpoint")
    p.add_argument("--model", default=None, help="checkpoint directory (overrides --size)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--pool-images", type=float, default=2.0, help="pool size in photos' KV")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = args.model or str(ensure_model(args.size))
    model = load_model(model_path, device=args.device)
    images = sample_images(args.images)
    probe = _engine(args, model_path, model, max_total_tokens=8192)
    img = probe.processor.prepare_image(images[0])
    req = probe.processor.make_request(messages=_messages(QUESTIONS[0]), images=[img])
    per_image = req.prompt_len
    args.pool_tokens = int(per_image * args.pool_images) // args.page_size * args.page_size
    total_kv = per_image * args.images
    run_workload(probe, images[:2], 1, 1, 2)  # warm-up: one-time costs untimed
    print(
        f"{args.images} photos x {args.questions} questions, ~{per_image} prompt tokens each; "
        f"pool {args.pool_tokens} tokens = 1/{total_kv / args.pool_tokens:.1f} of their KV; "
        f"page size {args.page_size}"
    )
    out = {}
    host_bytes = 4 * total_kv * probe.pool.bytes_per_token()
    with tempfile.TemporaryDirectory() as disk:
        setups = {
            "off": {},
            "host": {"kv_host_bytes": host_bytes},
            "disk": {"kv_disk_dir": disk},
            "optimum": {"max_total_tokens": 2 * total_kv},
        }
        engines = {}
        for name, kw in setups.items():
            engines[name] = eng = _engine(args, model_path, model, **kw)
            out[name] = run_workload(eng, images, args.questions, args.concurrency, args.max_tokens)
        for name in ("host", "disk"):
            assert out[name]["outputs"] == out["off"]["outputs"], f"{name}: outputs differ"
        engines["host"].close()
        engines["disk"].close()  # shutdown: tree pages to disk
        restart = _engine(args, model_path, model, kv_disk_dir=disk)
        k = min(10, args.images)
        imgs = [restart.processor.prepare_image(b) for b in images[:k]]
        image_tokens = cached_image = 0
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for im in imgs:
            r = restart.processor.make_request(
                messages=_messages(QUESTIONS[0]), images=[im], params=params
            )
            res = restart.generate([r])[0]
            span = r.spans[0]
            image_tokens += span.end - span.start
            cached_image += max(0, min(res.cached_tokens, span.end) - span.start)
        out["restart"] = {
            "images": k,
            "image_tokens_cached_share": round(cached_image / image_tokens, 4),
            "vision_tower_runs": restart.runner.vision_tower_images,
        }
        restart.close()
    opt = out["optimum"]["hit_rate"]
    print("| setup | hit rate | / optimum | req/s | vs off | TTFT p50 ms | p90 ms | tower runs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in ("off", "host", "disk", "optimum"):
        f = out[name]
        print(
            f"| {name} | {f['hit_rate']:.3f} | {f['hit_rate'] / opt:.3f} | "
            f"{f['requests_per_s']:.2f} | {f['requests_per_s'] / out['off']['requests_per_s']:.2f}x"
            f" | {f['ttft_p50_ms']:.0f} | {f['ttft_p90_ms']:.0f} | {f['vision_tower_runs']} |"
        )
    print("restart:", json.dumps(out["restart"]))
    for f in out.values():
        f.pop("outputs", None)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
