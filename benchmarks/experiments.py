"""Single-purpose benchmarks, each a ``python -m benchmarks`` subcommand (what each
measured: ``benchmarks/README.md``): ``replicas``, ``structured``, ``batch-order``,
``batch-api``, ``kv-tiers``, ``image-memory`` and ``video-qa``."""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks import over_http as http
from benchmarks import report, workloads
from benchmarks.in_process import MMServeRunner, one_request
from benchmarks.report import percentiles
from benchmarks.workloads import Prompt, Workload, ask
from mmserve.engine.request import SamplingParams
from mmserve.model.loader import load_model

# ---- replicas --------------------------------------------------------------------------

#: Sizes of :func:`benchmarks.workloads.interleaved` per scale, and concurrent clients.
REPLICA_SCALES = {
    "ci": dict(k=3, m=3, c=2, t=3, max_tokens=4, concurrency=3),
    "quick": dict(k=6, m=4, c=3, t=4, max_tokens=8, concurrency=4),
    "full": dict(k=12, m=6, c=6, t=6, max_tokens=16, concurrency=8),
}
#: The setups compared: (name, replicas, router).
SETUPS = (
    ("1 replica", 1, "cache"),
    ("2 replicas, cache", 2, "cache"),
    ("2 replicas, pow2", 2, "pow2"),
    ("2 replicas, round_robin", 2, "round_robin"),
)


def run_setup(
    url: str,
    model: str,
    wl: Workload,
    clients: int,
    optimum: float | None = None,
    distinct: int | None = None,
) -> dict:
    """Upload ``wl``'s images once, drive its sessions closed-loop from ``clients`` clients
    and measure: hit rate (the endpoint's ``/v1/cache/stats`` before and after), tower runs
    per distinct image, pixel fetches, req/s, TTFT, the router's decisions, and ``replies``
    (each request's text and usage, in prompt order)."""
    ids = {
        name: http.post_json(f"{url}/v1/images", {"data": base64.b64encode(data).decode()})["id"]
        for name, data in wl.images.items()
    }
    before = http.get_json(f"{url}/v1/cache/stats")
    bodies = http.request_bodies(wl, model, urls=ids)
    results, wall = http.run_sessions(url, bodies, wl.sessions, clients)
    after = http.get_json(f"{url}/v1/cache/stats")
    delta = lambda k: (after.get(k) or 0) - (before.get(k) or 0)  # noqa: E731
    load = http.summarize(results, wl.max_tokens, http.SLO(float("inf"), float("inf")), wall)
    distinct = distinct or len(wl.images)
    hit = delta("cached_tokens") / delta("prompt_tokens") if delta("prompt_tokens") else 0.0
    out = dict(requests=len(results), errors=load["failed"], error_messages=load["errors"])
    out.update(wall_seconds=wall, requests_per_second=load["request_throughput"] or 0.0)
    out.update(output_tokens_per_second=load["output_throughput"] or 0.0)
    out.update({f"ttft_{p}_ms": 1000 * (load["ttft_s"][p] or 0.0) for p in ("p50", "p99")})
    out.update({k: delta(k) for k in ("prompt_tokens", "cached_tokens", "pixel_fetches")})
    out.update(retries=delta("retries"), hit_rate=hit, distinct_images=distinct)
    out["hit_rate_over_optimum"] = hit / optimum if optimum else None
    out["vision_tower_runs"] = tower = delta("vision_tower_images")
    out["tower_runs_per_image"] = tower / distinct
    keys = ("ok", "text", "prompt_tokens", "cached_tokens", "error")
    out["replies"] = [{k: getattr(r, k) for k in keys} for r in results]
    if after.get("router") is not None:
        out["router"] = after["router"]["by_reason"]
    if isinstance(after.get("replicas"), dict):
        keys = {"requests": "requests_finished", "hit_rate": "cache_hit_rate"}
        keys["tower_runs"] = "vision_tower_images"
        out["per_replica"] = {
            uid: {k: s.get(v) for k, v in keys.items()}
            for uid, s in after["replicas"].items()
            if isinstance(s, dict)
        }
    return out


def replicas(args: argparse.Namespace, model_dir: str) -> int:
    """Each of :data:`SETUPS` on Ray Serve on loopback in turn; ``replicas.json``/``.md``."""
    import ray
    from ray import serve

    from api.replicas.launch import APP_NAME, build_application, init_ray_local
    from api.replicas.settings import ReplicaSettings
    from api.settings import ServerSettings
    from mmserve.config import EngineConfig

    size = dict(REPLICA_SCALES[args.scale])
    clients = size.pop("concurrency")
    wl = workloads.interleaved(**size, seed=args.seed)
    mm = MMServeRunner(load_model(model_dir), model_dir)
    opt = workloads.optimal_hit_rate(mm.prompt_ids(wl))
    distinct = len({mm.decoded[b].key for b in wl.images.values()})
    params = {**wl.params, "requests": wl.num_requests, "distinct_images": distinct, **opt}
    results = {"scale": args.scale, "model": model_dir, "setups": {}}
    results["workload"] = {**params, "concurrency": clients}
    init_ray_local()
    url = f"http://127.0.0.1:{args.port}"
    try:
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": "127.0.0.1", "port": args.port},
            logging_config={"log_level": "WARNING"},
        )
        for name, n, router in SETUPS:
            rs = ReplicaSettings(replicas=n, replica_router=router, cpus_per_replica=0.5)
            app = build_application(EngineConfig(model_path=model_dir), ServerSettings(), rs)
            serve.run(app, name=APP_NAME, logging_config={"log_level": "WARNING"})
            deadline = time.time() + 300
            while http.get_json(f"{url}/health").get("healthy_replicas", 0) < n:
                if time.time() > deadline:
                    raise TimeoutError(f"{url} not healthy with {n} replicas in 300 s")
                time.sleep(0.5)
            r = run_setup(url, Path(model_dir).name, wl, clients, opt["optimal_hit_rate"], distinct)
            results["setups"][name] = {**r, "replicas": n, "router_policy": router}
            print(
                f"{name:<24} hit {r['hit_rate']:.3f}  tower/image "
                f"{r['tower_runs_per_image']:.2f}  errors {r['errors']}",
                flush=True,
            )
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    for r in results["setups"].values():
        r.pop("replies")
    report.write_json(args.out / "replicas.json", results)
    md = report.replicas_table(results)
    (args.out / "replicas.md").write_text(md)
    print(md)
    return 0


# ---- structured output -------------------------------------------------------------------

#: Long fixed keys and short values: jump-forward's best case (and a common one).
SCHEMA = {
    "type": "object",
    "properties": {
        "the_main_subject_of_the_photograph": {"type": "string", "maxLength": 12},
        "the_dominant_colour_in_the_background": {
            "enum": ["black", "white", "red", "green", "blue", "other"]
        },
        "estimated_number_of_people_visible": {"type": "integer", "minimum": 0, "maximum": 20},
        "is_the_photograph_taken_indoors_or_outdoors": {"enum": ["indoors", "outdoors"]},
        "a_short_list_of_notable_objects_in_view": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "maxItems": 3,
        },
    },
}
SCHEMA["required"] = list(SCHEMA["properties"])
STRUCTURED_QUESTIONS = (
    "Describe the photo as JSON.",
    "What is in this picture?",
    "List what you see.",
    "Fill in the form about the photo.",
)


def structured_run(
    mm: MMServeRunner, n: int, mode: str, max_tokens: int, free_tokens: int = 0
) -> dict:
    """``n`` requests at once about the sample photos (their prefixes warmed first, so only
    decoding is compared); ``mode``: "off" (constrained, jump-forward off), "on", or "free"
    (unconstrained, ``ignore_eos``, ``free_tokens`` tokens).

    Raises:
        AssertionError: a constrained answer fails the schema or does not end with "stop".
    """
    import jsonschema

    from mmserve.structured.spec import GuidedSpec

    eng = mm.engine(max_total_tokens=65536, disable_jump_forward=mode == "off")
    imgs = workloads.photos(4)
    names = list(imgs)
    q = STRUCTURED_QUESTIONS
    prompts = [Prompt(ask(q[i // 4 % 4], system=False), [names[i % 4]]) for i in range(n)]
    params = (
        SamplingParams(max_tokens=free_tokens, ignore_eos=True)
        if mode == "free"
        else SamplingParams(max_tokens=max_tokens, guided=GuidedSpec.json_schema(SCHEMA))
    )
    warm = Workload("warm", "", imgs, [[Prompt(ask(".", system=False), [m]) for m in names]], 1)
    eng.generate(mm.requests(eng, warm, SamplingParams(max_tokens=1)))
    reqs = mm.requests(eng, Workload("structured", "", imgs, [prompts], max_tokens), params)
    decode0, prefill0 = eng.stats.decode_steps, eng.stats.prefill_steps
    t0 = time.perf_counter()
    results = eng.generate(reqs)
    wall = time.perf_counter() - t0
    for r in results if mode != "free" else []:
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.finish_reason == "stop", r.finish_reason
    eng.check_accounting()
    g, tokens = eng.guided.stats, sum(len(r.output_ids) for r in results)
    decode = eng.stats.decode_steps - decode0
    steps = decode + eng.stats.prefill_steps - prefill0
    out = dict(mode=mode, requests=n, decode_steps=decode, engine_steps=steps)
    out.update(extend_steps=eng.scheduler.extend_batches, jumped_tokens=g.jumped_tokens)
    out.update(output_tokens=tokens, mean_output_tokens=tokens / n, wall_s=wall)
    out.update(output_tokens_per_s=tokens / wall, requests_per_s=n / wall)
    out["output_chars_per_s"] = sum(len(r.text) for r in results) / wall
    out["step_ms"] = 1000 * wall / max(1, steps)
    out["mask_ms_per_step"] = 1000 * g.mask_seconds / max(1, g.mask_steps)
    out["mask_us_per_row"] = 1e6 * g.mask_seconds / max(1, g.masked_rows)
    return {**out, "example": results[0].text}


def structured(args: argparse.Namespace, model_dir: str) -> int:
    """Jump-forward off, on, and free decoding; writes ``structured.json``/``.md``."""

    mm = MMServeRunner(load_model(model_dir), model_dir)
    n = args.requests or (16 if args.scale == "quick" else 32)
    off = structured_run(mm, n, "off", args.max_tokens)
    on = structured_run(mm, n, "on", args.max_tokens)
    free = structured_run(mm, n, "free", args.max_tokens, max(1, round(off["mean_output_tokens"])))
    cols = "mode decode_steps extend_steps engine_steps mean_output_tokens jumped_tokens wall_s"
    cols = (cols + " output_tokens_per_s output_chars_per_s requests_per_s step_ms").split()
    cols += ["mask_ms_per_step", "mask_us_per_row"]
    saved = 1 - on["decode_steps"] / off["decode_steps"]
    md = report.md_table(cols, [[r[c] for c in cols] for r in (off, on, free)]) + (
        f"\n- decode steps saved by jump-forward: {saved:.0%} ({off['decode_steps']} -> "
        f"{on['decode_steps']}; engine steps {off['engine_steps']} -> {on['engine_steps']}); "
        f"target >= 30%: {'met' if saved >= 0.3 else 'MISSED'}\n"
        f"- with jump-forward: {on['output_chars_per_s'] / off['output_chars_per_s']:.2f}x "
        f"characters/s, {on['requests_per_s'] / off['requests_per_s']:.2f}x requests/s\n"
        f"- grammar masks: {off['mask_ms_per_step']:.3f} ms per step "
        f"({off['mask_us_per_row']:.1f} us per row) against a free step of {free['step_ms']:.1f} ms"
    )
    report.write_json(
        args.out / "structured.json",
        {"model": model_dir, "requests": n, "schema": SCHEMA, "runs": [off, on, free]},
    )
    (args.out / "structured.md").write_text(md + "\n")
    print(md, f"\nexample (jump-forward on): {on['example']}")
    return 0


# ---- batch jobs ------------------------------------------------------------------------------


def _batch_workload(args: argparse.Namespace, images: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    imgs = {f"img{i}": workloads.noise_image(rng, 64) for i in range(images)}
    return workloads.questions_about(imgs, args.questions, args.max_tokens, seed)


@contextmanager
def _batch_server(model_dir: str, args: argparse.Namespace, *flags: str) -> Iterator[tuple]:
    with tempfile.TemporaryDirectory() as d:
        flags += ("--max-total-tokens", str(args.max_total_tokens), "--data-dir", d)
        with http.mmserve_server(model_dir, flags, args.threads) as got:
            yield got


def _towers(url: str) -> int:
    return http.get_json(f"{url}/v1/cache/stats")["vision_tower_images"]


def _timed_batch(url: str, wl: Workload) -> dict:
    """``wl`` through ``/v1/files`` + ``/v1/batches`` from cold caches: hit rate, tower runs
    and wall time."""
    http.flush(url)
    t0, tower = time.perf_counter(), _towers(url)
    b = http.wait_batch(url, http.create_batch(url, http.request_bodies(wl, None, stream=False)))
    u, wall = b["usage"], time.perf_counter() - t0
    hit = u["input_tokens_details"]["cached_tokens"] / u["input_tokens"]
    out = {"requests": b["request_counts"]["completed"], "hit_rate": hit, "wall_s": wall}
    return {**out, "tower_runs": _towers(url) - tower}


def _batch_rows(runs: dict[str, dict], opt: float, images: int) -> str:
    rows = [
        (
            name,
            f"{r['hit_rate']:.3f}",
            f"{r['hit_rate'] / opt:.3f}",
            f"{r['tower_runs']} ({images})",
        )
        + (f"{r['wall_s']:.1f}",)
        for name, r in runs.items()
    ]
    return report.md_table(("run", "hit rate", "/ optimum", "tower runs (photos)", "wall s"), rows)


def batch_order(args: argparse.Namespace, model_dir: str) -> int:
    """``--images`` noise photos x ``--questions``, shuffled, as a batch on fresh servers
    with ``--batch-order cache`` and ``submitted``: hit rate against the optimum."""
    wl = _batch_workload(args, args.images, args.seed)
    mm = MMServeRunner(load_model(model_dir), model_dir)
    opt = workloads.optimal_hit_rate(mm.prompt_ids(wl))["optimal_hit_rate"]
    runs = {}
    for order in ("cache", "submitted"):
        with _batch_server(model_dir, args, "--batch-order", order) as (url, _):
            runs[order] = _timed_batch(url, wl)
    print(f"{wl.description}, shuffled; KV pool {args.max_total_tokens} tokens; optimum {opt:.3f}")
    print(_batch_rows(runs, opt, args.images))
    report.write_json(args.out / "batch_order.json", {"optimum": opt, **runs})
    return 0


def _probes(url: str, period: float, start: int, until: Any) -> list[float]:
    """TTFT (s) of short streaming chats, one every ``period`` s, until ``until(count)``."""
    out: list[float] = []
    tick = time.perf_counter()
    while not until(len(out)):
        msgs = [{"role": "user", "content": f"Say hello to visitor number {start + len(out)}."}]
        body = http.request_bodies(Workload("probe", "", {}, [[Prompt(msgs, [])]], 4), None)
        [r], _ = http.run_load(url, body, [0.0])
        out.append(r.ttft if r.ttft is not None else r.latency)  # all bytes held back: the end
        tick += period
        time.sleep(max(0.0, tick - time.perf_counter()))
    return out


def batch_api(args: argparse.Namespace, model_dir: str) -> int:
    """A batch against the same requests as a chat burst, and interactive TTFT before,
    during and after a ``--ttft-scale`` times larger batch; caches flushed between."""
    wl = _batch_workload(args, args.images, args.seed)
    mm = MMServeRunner(load_model(model_dir), model_dir)
    opt = workloads.optimal_hit_rate(mm.prompt_ids(wl))["optimal_hit_rate"]
    out: dict[str, Any] = {"optimum": opt}
    long = _batch_workload(args, args.images * args.ttft_scale, args.seed + 1)
    n, period = args.probes, args.probe_period
    with _batch_server(model_dir, args) as (url, _):  # each part from cold caches
        out["batch"] = _timed_batch(url, wl)
        http.flush(url)
        tower, bodies = _towers(url), http.request_bodies(wl, None)
        results, wall = http.run_load(url, bodies, [0.0] * wl.num_requests)
        s = http.summarize(results, wl.max_tokens, http.SLO(math.inf, math.inf), wall)
        out["burst"] = {"requests": s["completed"], "hit_rate": s["cache_hit_rate"]}
        out["burst"].update(tower_runs=_towers(url) - tower, wall_s=wall)
        http.flush(url)
        _probes(url, 0.0, 1000, lambda c: c >= 3)  # warm-up: first-request costs
        before = _probes(url, period, 0, lambda c: c >= n)
        bid = http.create_batch(url, http.request_bodies(long, None, stream=False))
        done = lambda: http.get_json(f"{url}/v1/batches/{bid}")["status"] in http.TERMINAL  # noqa: E731
        during = _probes(url, period, n, lambda c: c > 0 and done())
        http.wait_batch(url, bid)
        after = _probes(url, period, 10 * n, lambda c: c >= n)
    idle, busy = statistics.median(before + after), statistics.median(during)
    out["ttft"] = {"before_p50": statistics.median(before), "after_p50": statistics.median(after)}
    out["ttft"].update(idle_p50=idle, during_p50=busy, during_n=len(during), ratio=busy / idle)
    a, b, c = out["batch"], out["burst"], out["ttft"]
    print(f"{wl.description}, shuffled; KV pool {args.max_total_tokens} tokens; optimum {opt:.3f}")
    print(_batch_rows({"/v1/batches": a, "chat burst": b}, opt, args.images))
    print(
        f"throughput, batch / burst: {b['wall_s'] / a['wall_s']:.2f}\ninteractive TTFT p50: "
        f"{idle * 1e3:.1f} ms without the batch, {busy * 1e3:.1f} ms during a batch of "
        f"{long.num_requests} ({len(during)} probes); ratio {c['ratio']:.2f}"
    )
    report.write_json(args.out / "batch_api.json", out)
    return 0


# ---- KV tiers ----------------------------------------------------------------------------------

#: A question the workload never asks: after a restart its prompt shares only the template
#: and the image with what is on disk.
NEW_QUESTION = "Where might this photo have been taken?"


def drop_page_cache(directory: str) -> int:
    """Write back and drop every file under ``directory`` from the OS page cache (so the
    next reads come from the device); the number of files."""
    n = 0
    for path in (p for p in Path(directory).rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def _tier_run(mm: MMServeRunner, wl: Workload, name: str, **kw: Any) -> dict:
    r = mm.run(wl, name, closed_loop=False, check_leaks=False, **kw)
    s, st = r.summary(), mm.last_engine.cache_stats()
    out = {k: s[k] for k in ("requests", "wall_s", "requests_per_s", "cache_hit_rate")}
    out.update(ttft_p50_ms=1e3 * s["ttft_p50_s"], ttft_p90_ms=1e3 * percentiles(r.ttfts_s)["p90"])
    out.update(vision_tower_runs=r.vision_tower_runs, outputs=r.outputs)
    for k in (
        "tier_host_hit_tokens",
        "tier_disk_hit_tokens",
        "tier_feature_loads",
        "tier_load_seconds",
    ):
        out[k] = st.get(k, 0)
    return out


def kv_tiers(args: argparse.Namespace, model_dir: str) -> int:
    """Host and disk KV tiers against tiers off and a pool holding everything (the optimum),
    questions asked round-robin over a pool of ``--pool-images`` photos' KV; a restart on
    the disk directory; TTFT of a new question from disk against recomputing it."""
    mm = MMServeRunner(load_model(model_dir), model_dir, page_size=args.page_size)
    imgs = workloads.photos(args.images)
    prompts = workloads.questions_about(imgs, args.questions, args.max_tokens, None).prompts
    c = args.concurrency
    wl = Workload(
        "kv_tiers",
        "",
        imgs,
        [prompts[i : i + c] for i in range(0, len(prompts), c)],
        args.max_tokens,
    )
    per_image = max(map(len, mm.prompt_ids(one_request(wl, 0))))
    pool = int(per_image * args.pool_images) // args.page_size * args.page_size
    total_kv = per_image * args.images
    mm.run(one_request(wl, 0), "warm-up", check_leaks=False)
    print(f"{wl.num_requests} requests, ~{per_image} prompt tokens each; pool {pool} tokens")
    out, host_bytes = {}, 4 * total_kv * mm.engine().pool.bytes_per_token()
    ask_new = workloads.questions_about(imgs, 1, args.max_tokens, None)
    for p in ask_new.prompts:
        p.messages[-1]["content"][-1]["text"] = NEW_QUESTION
    with tempfile.TemporaryDirectory() as disk:
        for name, kw in (
            ("off", {}),
            ("host", {"kv_host_bytes": host_bytes}),
            ("disk", {"kv_disk_dir": disk}),
            ("optimum", {"max_total_tokens": 2 * total_kv}),
        ):
            out[name] = _tier_run(mm, wl, name, **{"max_total_tokens": pool, **kw})
            mm.last_engine.close()  # the disk engine writes its tree's pages
        for name in ("host", "disk"):
            assert out[name]["outputs"] == out["off"]["outputs"], f"{name}: outputs differ"
        eng = mm.engine(kv_disk_dir=disk, max_total_tokens=pool)
        k = min(10, args.images)
        reqs = mm.requests(eng, ask_new)[:k]
        res = eng.generate(reqs)
        spans = [r.spans[0] for r in reqs]
        cached = sum(
            max(0, min(x.cached_tokens, s.end) - s.start) for x, s in zip(res, spans, strict=True)
        )
        out["restart"] = {
            "images": k,
            "image_tokens_cached_share": cached / sum(s.end - s.start for s in spans),
        }
        out["restart"].update(vision_tower_runs=eng.runner.vision_tower_images)
        out["restart"]["feature_loads"] = eng.cache_stats()["tier_feature_loads"]
        eng.close()
    out["ttft"] = ttft_from_disk(mm, args)
    for f in out.values():
        f.pop("outputs", None)
    print(report.tiers_summary(out))
    report.write_json(args.out / "kv_tiers.json", out)
    return 0


def ttft_from_disk(mm: MMServeRunner, args: argparse.Namespace) -> dict:
    """TTFT of a new question about photos whose KV and features are on disk (written by
    another engine, dropped from the page cache unless ``--no-cold``) against recomputing
    them without tiers; photo by photo, interleaved. First tokens must agree."""
    imgs = workloads.photos(args.ttft_images)
    wl = workloads.questions_about(imgs, 1, 1, None)
    for p in wl.prompts:
        p.messages[-1]["content"][-1]["text"] = NEW_QUESTION
    big = 4 * 8192
    with tempfile.TemporaryDirectory() as disk:
        writer = mm.engine(kv_disk_dir=disk, max_total_tokens=big)
        writer.generate(mm.requests(writer, workloads.questions_about(imgs, 1, 1, None)))
        writer.close()  # its tree's pages (and the features written on encode) to disk
        dropped = drop_page_cache(disk) if args.cold else 0
        engines = {
            "recompute": mm.engine(max_total_tokens=big),
            "disk": mm.engine(kv_disk_dir=disk, max_total_tokens=big),
        }
        got: dict[str, list] = {"recompute": [], "disk": []}
        for i in range(wl.num_requests):
            for name, eng in engines.items():
                got[name].append(
                    eng.generate(mm.requests(eng, one_request(wl, i), cached=False))[0]
                )
        p50 = {n: statistics.median(r.ttft * 1e3 for r in v) for n, v in got.items()}
        st = engines["disk"].cache_stats()
        out = {
            "images": args.ttft_images,
            "cold": args.cold,
            "files_dropped_from_page_cache": dropped,
        }
        out.update(recompute_ttft_p50_ms=p50["recompute"], disk_ttft_p50_ms=p50["disk"])
        out["speedup_p50"] = p50["recompute"] / p50["disk"]
        out["disk_tower_runs"] = engines["disk"].runner.vision_tower_images
        out["recompute_tower_runs"] = engines["recompute"].runner.vision_tower_images
        out.update(
            disk_feature_loads=st["tier_feature_loads"], disk_hit_tokens=st["tier_disk_hit_tokens"]
        )
        out["first_tokens_equal"] = [r.output_ids for r in got["recompute"]] == [
            r.output_ids for r in got["disk"]
        ]
        engines["disk"].close()
    return out


# ---- image memory ---------------------------------------------------------------------------


def big_png(side: int, seed: int) -> bytes:
    """A ``side``-pixel square PNG that compresses well (stripes, a gradient) and differs
    from every other seed's."""
    x = np.arange(side)
    r = np.broadcast_to((((x // (40 + seed)) % 2 * 200 + seed * 7) % 256)[None, :], (side, side))
    g = np.broadcast_to((x * 255 // side)[:, None], (side, side))
    arr = np.stack([r, g, np.full((side, side), seed * 37 % 256)], axis=-1).astype(np.uint8)
    return workloads.png(Image.fromarray(arr, "RGB"))


def _rss(pid: int, field: str = "VmRSS") -> int:
    """``field`` of ``/proc/PID/status`` in bytes (``VmRSS``: resident; ``VmHWM``: its peak)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(ln.split()[1] for ln in status if ln.startswith(field + ":"))) * 1024


def _send_watching(pid: int, url: str, bodies: list[dict]) -> tuple[int, list[int]]:
    """POST ``bodies`` to ``url`` at once; ``(largest resident size of pid while they ran,
    polled every 5 ms; their statuses)``."""
    peak, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _rss(pid))

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        with ThreadPoolExecutor(len(bodies)) as ex:
            status = [s for s, _ in ex.map(lambda b: http.post(url, b, 900), bodies)]
    finally:
        stop.set()
        thread.join()
    return peak[0], status


def _chat(images: list[bytes]) -> dict:
    """A chat request asking about ``images`` (data URLs), 4 tokens."""
    names = [str(i) for i in range(len(images))]
    msgs = [{"role": "user", "content": [{"type": "image"}] * len(images) + [
        {"type": "text", "text": "Describe the pictures."}]}]  # fmt: skip
    urls = {n: workloads.data_url(b) for n, b in zip(names, images, strict=True)}
    return {"messages": workloads.openai_messages(Prompt(msgs, names), urls), "max_tokens": 4}


def image_memory(args: argparse.Namespace, model_dir: str | None) -> int:
    """Server RSS at rest, under one request with eight distinct ``--side``-pixel PNGs,
    then under two such requests at once (``VmRSS`` polled every 5 ms; per ``--repo``)."""
    mb = 1 << 20
    pngs = [big_png(args.side, s) for s in range(24)]
    groups = [[_chat(pngs[:8])], [_chat(pngs[8:16]), _chat(pngs[16:])]]
    rows = []
    for repo in [Path(r).resolve() for r in args.repo or [workloads.ROOT]]:
        with http.mmserve_server(model_dir, args.flags, 2, repo=repo, timeout=300) as (url, proc):
            chat = f"{url}/v1/chat/completions"
            http.post(chat, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            http.post(chat, _chat([big_png(64, 99)]))  # the image path once: lazy imports
            time.sleep(2)
            base, figs, status = _rss(proc.pid), [], []
            for group in groups:
                peak, got = _send_watching(proc.pid, chat, group)
                figs.append(peak)
                status += got
                time.sleep(3)
                figs.append(_rss(proc.pid))
            hwm = _rss(proc.pid, "VmHWM")
        above = [f"{v / mb:.0f} (+{(v - base) / mb:.0f})" for v in figs]
        rows.append((str(repo), f"{base / mb:.0f}", *above, f"{hwm / mb:.0f}", status))
    print(f"eight distinct {args.side}x{args.side} PNGs per request; resident MB (above baseline)")
    head = ("server", "baseline", "1 request: peak", "after", "2 at once: peak", "after")
    head += ("VmHWM", "status")
    print(report.md_table(head, rows))
    return 0


# ---- video QA --------------------------------------------------------------------------------


def video_qa(args: argparse.Namespace, model_dir: str) -> int:
    """Per-frame QA over ``samples/video/pans.mp4`` (``/v1/videos/{id}/qa`` in process),
    caches on and off: seconds, tower runs, hit rate, and whether the answers agree."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from samples.video_qa import QUESTIONS

    mm = MMServeRunner(load_model(model_dir), model_dir, max_total_tokens=32768)
    out = {}
    for name, kw in (("on", {}), ("off", {"disable_radix_cache": True, "vision_cache_bytes": 0})):
        with TestClient(create_app(mm.engine(**kw))) as c:
            hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            c.post("/v1/chat/completions", json=hi)  # warm-up, text only
            video = (workloads.ROOT / "samples" / "video" / "pans.mp4").read_bytes()
            vid = c.post("/v1/videos", files={"file": ("v.mp4", video)}).json()["id"]
            body = {"questions": QUESTIONS, "num_frames": args.num_frames, "temperature": 0.0}
            body["max_tokens"] = args.max_tokens
            t0 = time.perf_counter()
            answer = c.post(f"/v1/videos/{vid}/qa", json=body).text
            secs = round(time.perf_counter() - t0, 2)
        events = [json.loads(x) for x in answer.splitlines()]
        s = events[-1]
        out[name] = {"seconds": secs, "answers": s["answers"], "tower_runs": s["vision_tower_runs"]}
        out[name]["cache_hit_rate"] = round(s["cache_hit_rate"], 3)
        texts = [
            (e["frame"], e["question_index"], e["text"]) for e in events if e["type"] == "answer"
        ]
        out[name]["texts"] = sorted(texts)
    same = out["on"].pop("texts") == out["off"].pop("texts")
    print(json.dumps({"model": model_dir, **out, "same_answers": same}, indent=1))
    return 0
