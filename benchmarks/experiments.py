"""The single-purpose subcommands (``replicas``, ``structured``, ``batch-order``, ``batch-api``,
``kv-tiers``, ``image-memory``, ``video-qa``, ``video-budget``; what each measures:
``benchmarks/README.md``)."""

from __future__ import annotations

import argparse
import base64
import io
import json
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

import httpx
import numpy as np
from PIL import Image

from benchmarks import over_http as http
from benchmarks import report, workloads
from benchmarks.in_process import CACHE_OFF, MMServeRunner, one_request
from benchmarks.in_process import model_dir as checkpoint
from benchmarks.workloads import Prompt, Workload, ask
from mmserve.types import SamplingParams

# ---- replicas --------------------------------------------------------------------------

#: Sizes of :func:`benchmarks.workloads.interleaved` per scale, and concurrent clients.
REPLICA_SCALES = {
    "ci": dict(k=3, m=3, c=2, t=3, max_tokens=4, concurrency=3),
    "quick": dict(k=6, m=4, c=3, t=4, max_tokens=8, concurrency=4),
    "full": dict(k=12, m=6, c=6, t=6, max_tokens=16, concurrency=8),
}
#: The setups compared: (name, replicas, router, encoders).
SETUPS = (
    ("1 replica", 1, "cache", 0),
    ("2 replicas, cache", 2, "cache", 0),
    ("2 replicas, pow2", 2, "pow2", 0),
    ("2 replicas, round_robin", 2, "round_robin", 0),
    ("2 replicas, pow2, 1 encoder", 2, "pow2", 1),
    ("2 replicas, cache, 1 encoder", 2, "cache", 1),
)
REPLICAS_TABLE = (
    "setup|hit rate=hit_rate:.3f|hit / optimum=hit_rate_over_optimum:.3f"
    "|tower runs / image=tower_runs_per_image:.2f|pixel fetches=pixel_fetches"
    "|req/s=requests_per_second:.2f|output tok/s=output_tokens_per_second:.1f"
    "|TTFT p50 ms=ttft_p50_ms:.0f|TTFT p99 ms=ttft_p99_ms:.0f|errors=errors|routed=routed"
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
    upload = lambda data: {"data": base64.b64encode(data).decode()}  # noqa: E731
    ids = {n: http.post_json(f"{url}/v1/images", upload(b))["id"] for n, b in wl.images.items()}
    before = http.get_json(f"{url}/v1/cache/stats")
    bodies = http.request_bodies(wl, model, urls=ids)
    results, wall = http.run_load(url, bodies, sessions=wl.sessions, clients=clients)
    after = http.get_json(f"{url}/v1/cache/stats")
    delta = lambda k: (after.get(k) or 0) - (before.get(k) or 0)  # noqa: E731
    load = http.summarize(results, wl.max_tokens, wall=wall)
    distinct = distinct or len(wl.images)
    hit = delta("cached_tokens") / delta("prompt_tokens") if delta("prompt_tokens") else 0.0
    out = dict(requests=len(results), errors=load["failed"], error_messages=load["errors"])
    out.update(wall_seconds=wall, requests_per_second=load["request_throughput"] or 0.0)
    out.update(output_tokens_per_second=load["output_throughput"] or 0.0)
    out.update({f"ttft_{p}_ms": 1000 * (load["ttft_s"][p] or 0.0) for p in ("p50", "p99")})
    out.update({k: delta(k) for k in ("prompt_tokens", "cached_tokens", "pixel_fetches")})
    out.update(retries=delta("retries"), hit_rate=hit, distinct_images=distinct)
    out["hit_rate_over_optimum"] = hit / optimum if optimum else None
    # tower runs across the deployment (replicas and encoders) where the endpoint says
    out["vision_tower_runs"] = tower = delta(
        "tower_runs" if "tower_runs" in after else "vision_tower_images"
    )
    out["tower_runs_per_image"] = tower / distinct
    keys = ("ok", "text", "prompt_tokens", "cached_tokens", "error")
    out["replies"] = [{k: getattr(r, k) for k in keys} for r in results]
    out["router"] = (after.get("router") or {}).get("by_reason", {})
    out["routed"] = ", ".join(f"{k} {v}" for k, v in sorted(out["router"].items()))
    keys = {"requests": "requests_finished", "hit_rate": "cache_hit_rate"}
    keys["tower_runs"] = "vision_tower_images"
    out["per_replica"] = {
        uid: {k: s.get(v) for k, v in keys.items()}
        for uid, s in (after.get("replicas") or {}).items()
        if isinstance(s, dict)
    }
    return out


def replicas(args: argparse.Namespace, model_dir: str) -> int:
    """Each of :data:`SETUPS` on Ray Serve on loopback in turn."""
    import ray
    from ray import serve

    from api.replicas.launch import APP_NAME, build_application
    from api.settings import ServerSettings
    from mmserve.config import EngineConfig
    from mmserve.fleet.deploy import init_ray_local
    from mmserve.fleet.settings import ReplicaSettings

    size = dict(REPLICA_SCALES[args.scale])
    clients = size.pop("concurrency")
    wl = workloads.interleaved(**size, seed=args.seed)
    mm = MMServeRunner.load(model_dir)
    opt = workloads.optimal_hit_rate(mm.prompt_ids(wl))
    distinct = len({mm.decoded[b].key for b in wl.images.values()})
    w = {**wl.params, "requests": wl.num_requests, "distinct_images": distinct, **opt}
    setups, url = {}, f"http://127.0.0.1:{args.port}"
    init_ray_local()
    try:
        http_options = {"host": "127.0.0.1", "port": args.port}
        log = {"log_level": "WARNING"}
        serve.start(proxy_location="HeadOnly", http_options=http_options, logging_config=log)
        for name, n, router, encoders in SETUPS:
            rs = ReplicaSettings(
                replicas=n,
                replica_router=router,
                cpus_per_replica=0.5,
                encoders=encoders,
                cpus_per_encoder=0.5,
            )
            app = build_application(EngineConfig(model_path=model_dir), ServerSettings(), rs)
            serve.run(app, name=APP_NAME, logging_config=log)
            deadline = time.time() + 300
            while http.get_json(f"{url}/health").get("healthy_replicas", 0) < n:
                if time.time() > deadline:
                    raise TimeoutError(f"{url} not healthy with {n} replicas in 300 s")
                time.sleep(0.5)
            r = run_setup(url, Path(model_dir).name, wl, clients, opt["optimal_hit_rate"], distinct)
            del r["replies"]
            setups[name] = {**r, "replicas": n, "router_policy": router, "encoders": encoders}
            print(f"{name:<24} hit {r['hit_rate']:.3f}  errors {r['errors']}", flush=True)
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    md = (
        f"{w['requests']} requests ({w['images']} images x {w['questions']} questions + "
        f"{w['sessions']} sessions x {w['turns']} turns) from {clients} clients, "
        f"{w['max_tokens']} tokens each, {distinct} distinct images, offline-optimal hit rate "
        f"{w['optimal_hit_rate']:.3f}; model `{Path(model_dir).name}`.\n\n"
    )
    out = {"scale": args.scale, "model": model_dir, "workload": {**w, "concurrency": clients}}
    return report.emit(
        args.out, "replicas", {**out, "setups": setups}, md + report.table(setups, REPLICAS_TABLE)
    )


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
    names, q = list(imgs), STRUCTURED_QUESTIONS
    prompts = [Prompt(ask(q[i // 4 % 4], system=False), [names[i % 4]]) for i in range(n)]
    if mode == "free":
        params = SamplingParams(max_tokens=free_tokens, ignore_eos=True)
    else:
        params = SamplingParams(max_tokens=max_tokens, guided=GuidedSpec.json_schema(SCHEMA))
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
    """Jump-forward off, on, and free decoding of JSON-schema answers."""
    mm = MMServeRunner.load(model_dir)
    n = args.requests or (16 if args.scale == "quick" else 32)
    off = structured_run(mm, n, "off", args.max_tokens)
    on = structured_run(mm, n, "on", args.max_tokens)
    free = structured_run(mm, n, "free", args.max_tokens, max(1, round(off["mean_output_tokens"])))
    cols = "mode|decode steps=decode_steps|extend steps=extend_steps|engine steps=engine_steps"
    cols += "|tokens/request=mean_output_tokens|jumped tokens=jumped_tokens|wall s=wall_s"
    cols += "|tok/s=output_tokens_per_s|chars/s=output_chars_per_s|requests/s=requests_per_s"
    cols += "|step (ms)=step_ms|masks (ms/step)=mask_ms_per_step|masks (us/row)=mask_us_per_row"
    saved = 1 - on["decode_steps"] / off["decode_steps"]
    md = report.table({"jump-forward off": off, "jump-forward on": on, "free": free}, cols) + (
        f"\n- decode steps saved by jump-forward: {saved:.0%} ({off['decode_steps']} -> "
        f"{on['decode_steps']}; engine steps {off['engine_steps']} -> {on['engine_steps']}); "
        f"target >= 30%: {'met' if saved >= 0.3 else 'MISSED'}\n"
        f"- with jump-forward: {on['output_chars_per_s'] / off['output_chars_per_s']:.2f}x "
        f"characters/s, {on['requests_per_s'] / off['requests_per_s']:.2f}x requests/s\n"
        f"- grammar masks: {off['mask_ms_per_step']:.3f} ms per step "
        f"({off['mask_us_per_row']:.1f} us per row) against a free step of {free['step_ms']:.1f} ms"
        f"\n- example (jump-forward on): {on['example']}"
    )
    out = {"model": model_dir, "requests": n, "schema": SCHEMA, "runs": [off, on, free]}
    return report.emit(args.out, "structured", out, md)


# ---- batch jobs ------------------------------------------------------------------------------

BATCH_TABLE = (
    "run|hit rate=hit_rate:.3f|/ optimum=of_opt:.3f|tower runs (photos)=towers|wall s=wall_s:.1f"
)


def _batch_workload(args: argparse.Namespace, images: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    imgs = {f"img{i}": workloads.noise_image(rng, 64) for i in range(images)}
    return workloads.questions_about(imgs, args.questions, args.max_tokens, seed)


@contextmanager
def _batch_server(model_dir: str, args: argparse.Namespace, *flags: str) -> Iterator[str]:
    """``mmserve serve`` with a temporary ``--data-dir``; with ``args.replicas`` > 1, that
    many replicas (cache router, half a core each) on a local Ray, once all are up."""
    with tempfile.TemporaryDirectory() as d:
        flags += ("--max-total-tokens", str(args.max_total_tokens), "--data-dir", d)
        n = getattr(args, "replicas", 1)
        if n > 1:
            flags += ("--replicas", str(n), "--cpus-per-replica", "0.5")
        with http.mmserve_server(model_dir, flags, args.threads) as (url, _):
            deadline = time.time() + 300
            while http.get_json(f"{url}/health").get("healthy_replicas", 1) < n:
                if time.time() > deadline:
                    raise TimeoutError(f"{url} not healthy with {n} replicas in 300 s")
                time.sleep(0.5)
            yield url


def _timed(url: str, wl: Workload, opt: float, batch: bool = True) -> dict:
    """``wl`` from cold caches through ``/v1/files`` + ``/v1/batches`` (or as a chat burst):
    requests answered, hit rate, tower runs and wall time."""
    http.flush(url)

    def towers() -> int:  # across the deployment under --replicas (replicas and encoders)
        s = http.get_json(f"{url}/v1/cache/stats")
        return s["tower_runs"] if "tower_runs" in s else s["vision_tower_images"]

    t0, tower = time.perf_counter(), towers()
    if batch:
        b = http.wait_batch(url, http.create_batch(url, wl))
        u, n = b["usage"], b["request_counts"]["completed"]
        hit = u["input_tokens_details"]["cached_tokens"] / u["input_tokens"]
    else:
        results, _ = http.run_load(url, http.request_bodies(wl, None), [0.0] * wl.num_requests)
        s = http.summarize(results, wl.max_tokens)
        n, hit = s["completed"], s["cache_hit_rate"]
    out = {"requests": n, "hit_rate": hit, "of_opt": hit / opt, "wall_s": time.perf_counter() - t0}
    out["tower_runs"] = towers() - tower
    return {**out, "towers": f"{out['tower_runs']} ({len(wl.images)})"}


def batch_order(args: argparse.Namespace, model_dir: str) -> int:
    """``--images`` noise photos x ``--questions``, shuffled, as a batch on fresh servers
    with ``--batch-order cache`` and ``submitted``: hit rate against the optimum."""
    wl = _batch_workload(args, args.images, args.seed)
    opt = MMServeRunner.load(model_dir).optimum(wl)
    runs = {}
    for order in ("cache", "submitted"):
        with _batch_server(model_dir, args, "--batch-order", order) as url:
            runs[order] = _timed(url, wl, opt)
    md = (
        f"{wl.description}, shuffled; KV pool {args.max_total_tokens} tokens; optimum {opt:.3f}\n\n"
    )
    return report.emit(
        args.out, "batch_order", {"optimum": opt, **runs}, md + report.table(runs, BATCH_TABLE)
    )


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
    during and after a ``--ttft-scale`` times larger batch; each part from cold caches
    (``--replicas N``: on N replicas behind one endpoint)."""
    wl = _batch_workload(args, args.images, args.seed)
    opt = MMServeRunner.load(model_dir).optimum(wl)
    long = _batch_workload(args, args.images * args.ttft_scale, args.seed + 1)
    n, period = args.probes, args.probe_period
    with _batch_server(model_dir, args) as url:
        out = {"optimum": opt, "batch": _timed(url, wl, opt), "burst": _timed(url, wl, opt, False)}
        http.flush(url)
        _probes(url, 0.0, 1000, lambda c: c >= 3)  # warm-up: first-request costs
        before = _probes(url, period, 0, lambda c: c >= n)
        bid = http.create_batch(url, long)
        done = lambda: http.get_json(f"{url}/v1/batches/{bid}")["status"] in http.TERMINAL  # noqa: E731
        during = _probes(url, period, n, lambda c: c > 0 and done())
        http.wait_batch(url, bid)
        after = _probes(url, period, 10 * n, lambda c: c >= n)
    idle, busy = statistics.median(before + after), statistics.median(during)
    out["ttft"] = {"before_p50": statistics.median(before), "after_p50": statistics.median(after)}
    out["ttft"].update(idle_p50=idle, during_p50=busy, during_n=len(during), ratio=busy / idle)
    a, b = out["batch"], out["burst"]
    out["replicas"] = args.replicas
    where = f"{args.replicas} replicas (cache router), each with a " if args.replicas > 1 else ""
    md = (
        f"{wl.description}, shuffled; {where}KV pool {args.max_total_tokens} tokens; "
        f"optimum {opt:.3f}\n\n"
        + report.table({"/v1/batches": a, "chat burst": b}, BATCH_TABLE)
        + f"\nthroughput, batch / burst: {b['wall_s'] / a['wall_s']:.2f}\ninteractive TTFT p50: "
        f"{idle * 1e3:.1f} ms without the batch, {busy * 1e3:.1f} ms during a batch of "
        f"{long.num_requests} ({len(during)} probes); ratio {busy / idle:.2f}"
    )
    return report.emit(args.out, "batch_api", out, md)


# ---- KV tiers ----------------------------------------------------------------------------------

#: A question the workload never asks: after a restart its prompt shares only the template
#: and the image with what is on disk.
NEW_QUESTION = "Where might this photo have been taken?"
TIERS_TABLE = (
    "setup|hit rate=cache_hit_rate:.3f|/ optimum=of_opt:.3f|req/s=requests_per_s:.2f"
    "|vs off=vs_off:.2f|TTFT p50 ms=ttft_p50_s:ms|p90 ms=ttft_p90_s:ms"
    "|tower runs=vision_tower_runs"
)


def _new_question(imgs: dict[str, bytes], max_tokens: int) -> Workload:
    wl = workloads.questions_about(imgs, 1, max_tokens, None)
    for p in wl.prompts:
        p.messages[-1]["content"][-1]["text"] = NEW_QUESTION
    return wl


def kv_tiers(args: argparse.Namespace, model_dir: str) -> int:
    """Host and disk KV tiers against tiers off and a pool holding everything (the optimum),
    questions asked round-robin over a pool of ``--pool-images`` photos' KV; a restart on
    the disk directory; TTFT of a new question from disk against recomputing it."""
    mm = MMServeRunner.load(model_dir, page_size=args.page_size)
    imgs = workloads.photos(args.images)
    prompts = workloads.questions_about(imgs, args.questions, args.max_tokens, None).prompts
    c = args.concurrency
    rounds = [prompts[i : i + c] for i in range(0, len(prompts), c)]
    wl = Workload("kv_tiers", "", imgs, rounds, args.max_tokens)
    per_image = max(map(len, mm.prompt_ids(one_request(wl, 0))))
    pool = int(per_image * args.pool_images) // args.page_size * args.page_size
    total_kv = per_image * args.images
    mm.run(one_request(wl, 0), "warm-up", check_leaks=False)
    out, host_bytes = {}, 4 * total_kv * mm.engine().pool.bytes_per_token()
    with tempfile.TemporaryDirectory() as disk:
        for name, kw in (
            ("off", {}),
            ("host", {"kv_host_bytes": host_bytes}),
            ("disk", {"kv_disk_dir": disk}),
            ("optimum", {"max_total_tokens": 2 * total_kv}),
        ):
            r = mm.run(wl, name, check_leaks=False, **{"max_total_tokens": pool, **kw})
            keys = ("tier_host_hit_tokens", "tier_disk_hit_tokens", "tier_feature_loads")
            out[name] = {**r.summary(), **{k: mm.last_engine.cache_stats().get(k, 0) for k in keys}}
            mm.last_engine.close()  # the disk engine writes its tree's pages
            if name == "off":
                ref = r.outputs
            assert name == "optimum" or r.outputs == ref, f"{name}: outputs differ"
        eng = mm.engine(kv_disk_dir=disk, max_total_tokens=pool)
        k = min(10, args.images)
        reqs = mm.requests(eng, _new_question(imgs, args.max_tokens))[:k]
        spans = [r.spans[0] for r in reqs]
        res = eng.generate(reqs)
        cached = sum(
            max(0, min(x.cached_tokens, s.end) - s.start) for x, s in zip(res, spans, strict=True)
        )
        r = out["restart"] = {"images": k, "vision_tower_runs": eng.runner.vision_tower_images}
        r["image_tokens_cached_share"] = cached / sum(s.end - s.start for s in spans)
        r["feature_loads"] = eng.cache_stats()["tier_feature_loads"]
        eng.close()
    for name in ("off", "host", "disk", "optimum"):
        out[name]["of_opt"] = out[name]["cache_hit_rate"] / out["optimum"]["cache_hit_rate"]
        out[name]["vs_off"] = out[name]["requests_per_s"] / out["off"]["requests_per_s"]
    out["ttft"] = t = ttft_from_disk(mm, args)
    md = report.table({k: out[k] for k in ("off", "host", "disk", "optimum")}, TIERS_TABLE)
    md += (
        f"restart: {r['image_tokens_cached_share']:.3f} of the image tokens of {r['images']} "
        f"photos cached, tower runs {r['vision_tower_runs']}, feature loads {r['feature_loads']}"
        f"\nTTFT, new question about a photo on disk: {t['disk_ttft_p50_ms']:.0f} ms vs "
        f"recompute {t['recompute_ttft_p50_ms']:.0f} ms (p50 of {t['images']}): "
        f"{t['speedup_p50']:.1f}x; tower runs {t['disk_tower_runs']} vs "
        f"{t['recompute_tower_runs']}; first tokens equal: {t['first_tokens_equal']}"
    )
    return report.emit(args.out, "kv_tiers", out, md)


def ttft_from_disk(mm: MMServeRunner, args: argparse.Namespace) -> dict:
    """TTFT of a new question about photos whose KV and features are on disk (written by
    another engine, dropped from the page cache unless ``--no-cold``) against recomputing
    them without tiers; photo by photo, interleaved. First tokens must agree."""
    imgs = workloads.photos(args.ttft_images)
    wl, big = _new_question(imgs, 1), 4 * 8192
    with tempfile.TemporaryDirectory() as disk:
        writer = mm.engine(kv_disk_dir=disk, max_total_tokens=big)
        writer.generate(mm.requests(writer, workloads.questions_about(imgs, 1, 1, None)))
        writer.close()  # its tree's pages (and the features written on encode) to disk
        dropped = 0  # files written back and dropped from the page cache: loads read the device
        for path in [p for p in Path(disk).rglob("*") if p.is_file()] if args.cold else []:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(fd)
        engines = {
            "recompute": mm.engine(max_total_tokens=big),
            "disk": mm.engine(kv_disk_dir=disk, max_total_tokens=big),
        }
        got: dict[str, list] = {"recompute": [], "disk": []}
        for i in range(wl.num_requests):
            for name, eng in engines.items():
                reqs = mm.requests(eng, one_request(wl, i), cached=False)
                got[name].append(eng.generate(reqs)[0])
        p50 = {n: statistics.median(r.ttft * 1e3 for r in v) for n, v in got.items()}
        st = engines["disk"].cache_stats()
        out = {"images": args.ttft_images, "cold": args.cold, "files_dropped": dropped}
        out.update(recompute_ttft_p50_ms=p50["recompute"], disk_ttft_p50_ms=p50["disk"])
        out["speedup_p50"] = p50["recompute"] / p50["disk"]
        out["disk_tower_runs"] = engines["disk"].runner.vision_tower_images
        out["recompute_tower_runs"] = engines["recompute"].runner.vision_tower_images
        out["disk_feature_loads"] = st["tier_feature_loads"]
        out["disk_hit_tokens"] = st["tier_disk_hit_tokens"]
        ids = {n: [r.output_ids for r in v] for n, v in got.items()}
        out["first_tokens_equal"] = ids["recompute"] == ids["disk"]
        engines["disk"].close()
    return out


# ---- image memory ---------------------------------------------------------------------------


MEMORY_TABLE = (
    "server|baseline=baseline:.0f|1 request: peak=one_peak|after=one_after"
    "|2 at once: peak=two_peak|after=two_after|VmHWM=VmHWM:.0f|status=status"
)


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
            status = [
                r.status_code
                for r in ex.map(lambda b: httpx.post(url, json=b, timeout=900), bodies)
            ]
    finally:
        stop.set()
        thread.join()
    return peak[0], status


def _chat(images: list[bytes]) -> dict:
    """A chat request asking about ``images`` (data URLs), 4 tokens."""
    parts = [{"type": "image_url", "image_url": {"url": workloads.data_url(b)}} for b in images]
    parts.append({"type": "text", "text": "Describe the pictures."})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}


def image_memory(args: argparse.Namespace, model_dir: str | None) -> int:
    """Server RSS at rest, under one request with eight distinct ``--side``-pixel PNGs,
    then under two such requests at once (``VmRSS`` polled every 5 ms; per ``--repo``)."""
    mb, pngs, rows = 1 << 20, [big_png(args.side, s) for s in range(24)], {}
    groups = [[_chat(pngs[:8])], [_chat(pngs[8:16]), _chat(pngs[16:])]]
    for repo in [Path(r).resolve() for r in args.repo or [workloads.ROOT]]:
        with http.mmserve_server(model_dir, args.flags, 2, repo=repo) as (url, proc):
            chat = f"{url}/v1/chat/completions"
            hi = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            httpx.post(chat, json=hi, timeout=300)
            httpx.post(
                chat, json=_chat([big_png(64, 99)]), timeout=300
            )  # the image path once: lazy imports
            time.sleep(2)
            base, figs, status = _rss(proc.pid), [], []
            for group in groups:
                peak, got = _send_watching(proc.pid, chat, group)
                time.sleep(3)
                figs += [peak, _rss(proc.pid)]
                status += got
            hwm = _rss(proc.pid, "VmHWM")
        row = rows[str(repo)] = {"baseline": base / mb, "VmHWM": hwm / mb, "status": status}
        for k, v in zip(("one_peak", "one_after", "two_peak", "two_after"), figs, strict=True):
            row[k] = f"{v / mb:.0f} (+{(v - base) / mb:.0f})"
    md = (
        f"eight distinct {args.side}x{args.side} PNGs per request; resident MB (above baseline)\n\n"
    )
    md += report.table(rows, MEMORY_TABLE)
    return report.emit(args.out, "image_memory", rows, md)


# ---- video QA --------------------------------------------------------------------------------


def video_qa(args: argparse.Namespace, model_dir: str) -> int:
    """Per-frame QA over ``samples/video/pans.mp4`` (``/v1/videos/{id}/qa`` in process),
    caches on and off: seconds, tower runs, hit rate, and whether the answers agree."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from samples.video_qa import QUESTIONS

    mm = MMServeRunner.load(model_dir, max_total_tokens=32768)
    video = (workloads.ROOT / "samples" / "video" / "pans.mp4").read_bytes()
    body = {"questions": QUESTIONS, "num_frames": args.num_frames, "temperature": 0.0}
    out, texts = {}, {}
    for name, kw in (("on", {}), ("off", CACHE_OFF)):
        with TestClient(create_app(mm.engine(**kw))) as c:
            hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            c.post("/v1/chat/completions", json=hi)  # warm-up, text only
            vid = c.post("/v1/videos", files={"file": ("v.mp4", video)}).json()["id"]
            t0 = time.perf_counter()
            answer = c.post(f"/v1/videos/{vid}/qa", json={**body, "max_tokens": args.max_tokens})
            secs = time.perf_counter() - t0
        events = [json.loads(x) for x in answer.text.splitlines()]
        s = events[-1]
        out[name] = {"seconds": secs, "tower_runs": s["vision_tower_runs"], "answers": s["answers"]}
        out[name]["cache_hit_rate"] = s["cache_hit_rate"]
        texts[name] = sorted(
            (e["frame"], e["question_index"], e["text"]) for e in events if e["type"] == "answer"
        )
    same = texts["on"] == texts["off"]
    cols = "caches|seconds=seconds:.2f|tower runs=tower_runs|hit rate=cache_hit_rate:.3f"
    md = report.table(out, cols + "|answers=answers") + f"same answers: {same}"
    return report.emit(args.out, "video_qa", {"model": model_dir, **out, "same_answers": same}, md)


# ---- video-budget ----------------------------------------------------------------------


def long_clip(seconds: int, fps: int = 10) -> bytes:
    """A ``seconds``-long H.264 MP4 at ``fps`` from ``samples/video/pans.mp4``'s frames,
    each shifted a little so that no two frames are equal (160x120)."""
    import io

    import av

    with av.open(io.BytesIO((workloads.ROOT / "samples" / "video" / "pans.mp4").read_bytes())) as c:
        base = [f.to_ndarray(format="rgb24")[::2, ::2] for f in c.decode(video=0)]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = 160, 120, "yuv420p"
        s.options = {"preset": "ultrafast"}
        for k in range(seconds * fps):
            frame = np.roll(base[k % len(base)], k, axis=1)
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), "rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


#: Frame fields of each video-budget request (clip mode), by row name.
BUDGET_REQUESTS = {
    "default (8 frames)": {},
    "fps=1": {"fps": 1},
    "fps=2": {"fps": 2},
    "fps=10": {"fps": 10},
    "fps=10, max_frames=16": {"fps": 10, "max_frames": 16},
}


def video_budget(args: argparse.Namespace, model_dir: str) -> int:
    """``--max-video-tokens`` on a long clip: the frames each request takes and the video
    tokens its prompt holds (``/v1/videos/{id}/qa`` clip mode, in process)."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import ServerSettings

    mm = MMServeRunner.load(model_dir, max_total_tokens=args.max_total_tokens)
    eng = mm.engine()
    settings = ServerSettings(
        max_video_tokens=args.max_video_tokens,
        max_video_frames=args.max_video_frames,
        max_video_bytes=256 << 20,
    )
    clip = long_clip(args.seconds)
    rows: dict[str, dict] = {}
    with TestClient(create_app(eng, settings)) as c:
        vid = c.post("/v1/videos", files={"file": ("v.mp4", clip)}).json()["id"]
        info = c.get(f"/v1/videos/{vid}").json()
        cost = eng.processor.frame_cost(info["width"], info["height"], "frame")

        def ask(fields: dict) -> dict:
            body = {"questions": ["What happens?"], "mode": "clip", "max_tokens": 1, **fields}
            r = c.post(f"/v1/videos/{vid}/qa", json={"temperature": 0.0, **body})
            r.raise_for_status()
            events = [json.loads(x) for x in r.text.splitlines()]
            return {"frames": events[0]["frames"], "prompt": events[-1]["prompt_tokens"]}

        one = ask({"num_frames": 1})["prompt"]
        quarter = max(1, args.max_video_tokens // 4)  # a request's own, lower budget
        lower = {f"fps=10, max_video_tokens={quarter}": {"fps": 10, "max_video_tokens": quarter}}
        asks = {**BUDGET_REQUESTS, **lower}
        for name, fields in asks.items():
            got = ask(fields)
            times = [f["timestamp"] for f in got["frames"]]
            cap = min(args.max_video_tokens, fields.get("max_video_tokens", 1 << 62))
            used = got["prompt"] - one + cost.tokens(1)
            rows[name] = {
                "frames": len(times),
                "first_s": times[0],
                "last_s": times[-1],
                "spacing_s": (times[-1] - times[0]) / max(1, len(times) - 1),
                "video_tokens": used,
                "cap": cap,
                "within": used <= cap,
            }
        # an exact count one past what fits: refused, naming num_frames
        too_many = min(cost.fit(args.max_video_tokens), args.max_video_frames) + 1
        over = c.post(
            f"/v1/videos/{vid}/qa",
            json={"questions": ["x"], "mode": "clip", "num_frames": too_many},
        )
    head = (
        f"{args.seconds} s clip ({info['num_frames']} frames), --max-video-tokens "
        f"{args.max_video_tokens}, --max-video-frames {args.max_video_frames}, "
        f"{cost.per_frame} tokens/frame + {cost.per_video}; load {report.loadavg()}\n\n"
    )
    cols = (
        "request|frames=frames|first s=first_s:.1f|last s=last_s:.1f|spacing s=spacing_s:.2f"
        "|video tokens=video_tokens|cap=cap|within=within"
    )
    refused = over.json().get("error", {})
    tail = f"\nnum_frames={too_many}: {over.status_code} {refused.get('message')}"
    md = head + report.table(rows, cols) + tail
    out = {"model": model_dir, "info": info, "per_frame": cost.per_frame, "rows": rows}
    out["exact_over"] = {"status": over.status_code, "error": refused}
    return report.emit(args.out, "video_budget", out, md)


def image_detail(args: argparse.Namespace, model_dir: str | None) -> int:
    """``detail`` low vs high: image tokens and TTFT of one photo per family (caches off).

    TTFT is from the encoded file to the first token: decode, preprocessing, vision tower
    and prefill, one request at a time on a fresh engine with the prefix and embedding
    caches off, so every repeat pays all of it; the median of ``--repeats``.
    """
    photo = Image.open(workloads.ROOT / "samples" / "images" / "astronaut.png").convert("RGB")
    side = [int(x) for x in args.photo.split("x")]
    buf = io.BytesIO()
    photo.resize(side).save(buf, "PNG")
    data = buf.getvalue()
    rows: dict[str, dict] = {}
    for family in args.families.split(","):
        path = model_dir or checkpoint(args.size or "small", family)
        mm = MMServeRunner.load(path)
        eng = mm.engine(**CACHE_OFF)
        proc = eng.processor
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for detail in ("high", "low", "high", "low")[: 2 if args.scale == "ci" else 4]:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                img = proc.prepare_image(data, proc.image_mode(1, detail))
                req = proc.make_request(
                    messages=msgs, images=[img], params=params, details=[detail]
                )
                (res,) = eng.generate([req])
                times.append(req.arrival - t0 + res.ttft)
            # high and low alternate, so drift on a shared machine hits both alike
            row = rows.setdefault(f"{family} {detail}", {"image_tokens": req.spans[0].length})
            row.setdefault("ttft_s", []).extend(times)
            row["prompt_tokens"] = res.prompt_tokens
    for row in rows.values():
        row["ttft_s"] = statistics.median(row["ttft_s"])
    for family in args.families.split(","):
        hi, lo = rows[f"{family} high"], rows[f"{family} low"]
        lo["ttft_ratio_vs_high"] = lo["ttft_s"] / hi["ttft_s"]
        hi["ttft_ratio_vs_high"] = 1.0
    cols = "view|image tokens=image_tokens|prompt tokens=prompt_tokens"
    cols += "|TTFT s (median)=ttft_s:.4f|TTFT / high=ttft_ratio_vs_high:.3f"
    md = report.table(rows, cols) + f"photo {args.photo}, load {report.loadavg()}"
    return report.emit(args.out, "image_detail", {"photo": args.photo, **rows}, md)
