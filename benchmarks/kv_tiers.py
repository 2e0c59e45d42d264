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
on the same directory asks a question none of the workload asked about each of the
first 10 photos, and the share of image tokens that came back cached, the vision-tower
runs and the images whose features came from disk are reported (at page size 16 the
image's last partial page is recomputed from features on disk).

Last, time to first token for a new question about a photo whose KV and features are on
disk (``disk``) against a fresh engine without tiers computing tower and prefill
(``recompute``), ``--ttft-images`` photos, the two interleaved photo by photo. The files
are written by another engine first and, with ``--cold`` (default), dropped from the
OS page cache (``fsync`` + ``posix_fadvise(DONTNEED)``) so that loads read the device.
The first tokens of both must agree.

Requests go in groups of ``--concurrency`` to ``Engine.generate``; TTFT is per
request (arrival to first token), req/s is requests over the wall time of the run.

Usage::

    python -m benchmarks.kv_tiers                  # tiny model on CPU, about a minute
    python -m benchmarks.kv_tiers --size small --images 16 --page-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.workloads import QUESTIONS, photos
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.model.loader import LoadedModel, load_model
from mmserve.testing.checkpoints import ensure_model


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


#: A question the workload never asks: after a restart its prompt shares only the
#: template and the image with what is on disk.
NEW_QUESTION = "Where might this photo have been taken?"


def drop_page_cache(directory: str) -> int:
    """Write back and drop every file under ``directory`` from the OS page cache, so the
    next reads come from the device; returns the files dropped."""
    n = 0
    for path in Path(directory).rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def ttft_from_disk(
    args: argparse.Namespace, model_path: str, model: LoadedModel, images: list[bytes]
) -> dict:
    """TTFT of a new question about photos whose KV and features are on disk, against
    recomputing them on an engine without tiers; photo by photo, interleaved."""
    big = 4 * 8192
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as disk:
        writer = _engine(args, model_path, model, kv_disk_dir=disk, max_total_tokens=big)
        run_workload(writer, images, 1, 1, 1)
        writer.close()  # its tree's pages (and the features written on encode) to disk
        dropped = drop_page_cache(disk) if args.cold else 0
        loads = _engine(args, model_path, model, kv_disk_dir=disk, max_total_tokens=big)
        computes = _engine(args, model_path, model, max_total_tokens=big)
        ms: dict[str, list[float]] = {"recompute": [], "disk": []}
        firsts: dict[str, list[list[int]]] = {"recompute": [], "disk": []}
        for b in images:
            for name, eng in (("recompute", computes), ("disk", loads)):
                img = eng.processor.prepare_image(b)
                req = eng.processor.make_request(
                    messages=_messages(NEW_QUESTION), images=[img], params=one
                )
                res = eng.generate([req])[0]
                ms[name].append(res.ttft * 1e3)
                firsts[name].append(res.output_ids)
        stats = loads.cache_stats()
        p50 = {name: statistics.median(v) for name, v in ms.items()}
        out = {
            "images": len(images),
            "cold": bool(args.cold),
            "files_dropped_from_page_cache": dropped,
            "recompute_ttft_p50_ms": round(p50["recompute"], 1),
            "disk_ttft_p50_ms": round(p50["disk"], 1),
            "speedup_p50": round(p50["recompute"] / p50["disk"], 2),
            "disk_tower_runs": loads.runner.vision_tower_images,
            "recompute_tower_runs": computes.runner.vision_tower_images,
            "disk_feature_loads": stats["tier_feature_loads"],
            "disk_hit_tokens": stats["tier_disk_hit_tokens"],
            "disk_load_s": round(stats["tier_load_seconds"], 3),
            "first_tokens_equal": firsts["recompute"] == firsts["disk"],
        }
        loads.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line entry: runs :func:`run`, prints its tables; exit status 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, run every part, print the tables; returns the figures by setup
    (``off``, ``host``, ``disk``, ``optimum``, ``restart``, ``ttft``)."""
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
    p.add_argument("--ttft-images", type=int, default=6, help="photos of the TTFT part")
    p.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="drop the disk tier's files from the page cache before the TTFT loads",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = args.model or str(ensure_model(args.size))
    model = load_model(model_path, device=args.device)
    images = list(photos(args.images).values())
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
                messages=_messages(NEW_QUESTION), images=[im], params=params
            )
            res = restart.generate([r])[0]
            span = r.spans[0]
            image_tokens += span.end - span.start
            cached_image += max(0, min(res.cached_tokens, span.end) - span.start)
        out["restart"] = {
            "images": k,
            "image_tokens_cached_share": round(cached_image / image_tokens, 4),
            "vision_tower_runs": restart.runner.vision_tower_images,
            "feature_loads": restart.cache_stats()["tier_feature_loads"],
        }
        restart.close()
    out["ttft"] = ttft_from_disk(args, model_path, model, list(photos(args.ttft_images).values()))
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
    t = out["ttft"]
    print(
        f"TTFT, new question about a photo on disk: {t['disk_ttft_p50_ms']:.0f} ms vs "
        f"recompute {t['recompute_ttft_p50_ms']:.0f} ms (p50 of {t['images']}): "
        f"{t['speedup_p50']:.1f}x; tower runs {t['disk_tower_runs']} vs "
        f"{t['recompute_tower_runs']}; first tokens equal: {t['first_tokens_equal']}"
    )
    for f in out.values():
        f.pop("outputs", None)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
