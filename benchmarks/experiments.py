"""Single-purpose benchmarks, each a ``python -m benchmarks`` subcommand (see
``benchmarks/README.md`` for what each measured): ``replicas`` (routers on Ray Serve),
``structured`` (jump-forward decoding),
``batch-order`` (batch jobs in cache-aware order), ``tensor-parallel`` (``--tp`` on CPU),
``image-memory`` (server RSS under large images), ``video-qa`` (per-frame QA, caches on
and off) and ``long-stream`` (per-token cost over one long answer).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks import over_http as http
from benchmarks import report, workloads
from benchmarks.in_process import MMServeRunner
from benchmarks.workloads import Prompt, Workload, ask
from mmserve.engine.request import SamplingParams

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
    from mmserve.model.loader import load_model

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
    from mmserve.model.loader import load_model

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


# ---- batch order ----------------------------------------------------------------------------


def batch_order(args: argparse.Namespace, model_dir: str) -> int:
    """``--images`` noise photos x ``--questions``, shuffled, through ``/v1/files`` +
    ``/v1/batches`` with ``--batch-order cache`` and ``submitted`` on fresh engines."""
    import openai
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import ServerSettings
    from mmserve.model.loader import load_model

    mm = MMServeRunner(load_model(model_dir), model_dir, max_total_tokens=args.max_total_tokens)
    rng = np.random.default_rng(args.seed)
    imgs = {f"img{i}": workloads.noise_image(rng, 64) for i in range(args.images)}
    prompts = [
        Prompt(ask(workloads.QUESTIONS[k % 16], system=False), [n])
        for n in imgs
        for k in range(args.questions)
    ]
    random.Random(args.seed).shuffle(prompts)
    wl = Workload("batch_order", "", imgs, [prompts], args.max_tokens)
    urls = {n: workloads.data_url(b) for n, b in imgs.items()}
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": workloads.openai_messages(p, urls),
                "temperature": 0,
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
            },
        }
        for i, p in enumerate(prompts)
    ]
    opt = workloads.optimal_hit_rate(mm.prompt_ids(wl))["optimal_hit_rate"]

    def run(order: str, lines: list[dict]) -> tuple:
        with tempfile.TemporaryDirectory() as d:
            settings = ServerSettings(served_model_name="m", data_dir=d, batch_order=order)
            with TestClient(create_app(mm.engine(), settings)) as client:
                oa = openai.OpenAI(
                    base_url="http://testserver/v1", api_key="-", http_client=client, max_retries=0
                )
                data = "\n".join(json.dumps(x) for x in lines).encode()
                f = oa.files.create(file=("in.jsonl", data), purpose="batch")
                t0 = time.perf_counter()
                b = oa.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                while b.status not in ("completed", "failed", "cancelled", "expired"):
                    time.sleep(0.05)
                    b = oa.batches.retrieve(b.id)
                wall = time.perf_counter() - t0
                tower = client.get("/v1/cache/stats").json()["vision_tower_images"]
        if b.status != "completed" or b.request_counts.failed:
            raise RuntimeError(f"batch in {order} order: {b}")
        hit = b.usage.input_tokens_details.cached_tokens / b.usage.input_tokens
        return order, f"{hit:.3f}", f"{hit / opt:.3f}", f"{tower} ({args.images})", f"{wall:.1f}"

    run("cache", lines[:4])  # warm-up (one-time costs), not shown
    rows = [run(order, lines) for order in ("cache", "submitted")]
    print(
        f"{args.images} images x {args.questions} questions, shuffled; KV pool "
        f"{args.max_total_tokens} tokens; offline optimum {opt:.3f}\n"
    )
    print(
        report.md_table(
            ("order", "hit rate", "/ optimum", "tower runs (distinct photos)", "wall s"), rows
        )
    )
    return 0


# ---- tensor parallelism -----------------------------------------------------------------------


def tensor_parallel(args: argparse.Namespace, model_dir: str) -> int:
    """One greedy batch on ``--tp 1`` with ``--threads`` threads, on ``--tp 1`` with
    ``threads / N``, and on ``--tp N`` with ``threads / N`` per rank: tokens/s, equal
    tokens, decoder weight bytes per rank."""
    from mmserve.config import EngineConfig
    from mmserve.engine.engine import Engine

    def run(tp: int, threads: int) -> tuple[list, float, list[int]]:
        torch.set_num_threads(threads)
        eng = Engine(EngineConfig(model_path=model_dir, tp=tp, max_total_tokens=8192))
        try:
            mk = eng.processor.make_request
            eng.generate([mk(prompt="warm up", params=SamplingParams(max_tokens=2))])
            params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            reqs = [
                mk(prompt=f"Story {k}: once upon a time", params=params) for k in range(args.batch)
            ]
            t0 = time.perf_counter()
            res = eng.generate(reqs)
            secs = time.perf_counter() - t0
            dec = eng.model.decoder
            # parameters sharing storage (tied weights) count once
            own = {
                (p.untyped_storage().data_ptr(), p.storage_offset()): p.numel() * p.element_size()
                for p in dec.parameters()
            }
            ranks = [sum(own.values()), *getattr(getattr(dec, "group", None), "worker_bytes", [])]
            return [r.output_ids for r in res], sum(len(r.output_ids) for r in res) / secs, ranks
        finally:
            eng.close()

    per_rank = max(1, args.threads // args.tp)
    ids1, tps1, bytes1 = run(1, args.threads)
    _, tps_few, _ = run(1, per_rank)
    idsn, tpsn, bytesn = run(args.tp, per_rank)
    out = {"tp": args.tp, "same_tokens": ids1 == idsn, "tokens_per_s_tp1": round(tps1, 1)}
    out[f"tokens_per_s_tp1_{per_rank}_threads"] = round(tps_few, 1)
    out.update({f"tokens_per_s_tp{args.tp}": round(tpsn, 1), "ratio": round(tpsn / tps1, 3)})
    out.update(decoder_bytes_tp1=bytes1[0], decoder_bytes_per_rank=bytesn)
    out["rank_fraction"] = [round(b / bytes1[0], 3) for b in bytesn]
    print(json.dumps(out))
    return 0


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
    from mmserve.model.loader import load_model
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


# ---- long stream -----------------------------------------------------------------------------


def long_stream(args: argparse.Namespace, model_dir: str) -> int:
    """Gaps between streamed chunks of one ``--tokens``-token answer over HTTP, and engine
    step times in-process: mean of the first and the last ``--window``, and their ratio."""
    from mmserve.model.loader import load_model

    msgs = [{"role": "user", "content": "Tell me a very long story."}]
    wl = Workload("long", "", {}, [[Prompt(msgs, [])]], args.tokens)
    with http.mmserve_server(model_dir) as (url, _):
        http.run_load(
            url, http.request_bodies(Workload("w", "", {}, [[Prompt(msgs, [])]], 64), None), [0.0]
        )
        [r], _ = http.run_load(url, http.request_bodies(wl, None), [0.0])
    gaps = {"http_stream": list(np.diff(r.chunk_times))}
    mm = MMServeRunner(load_model(model_dir), model_dir)
    eng = mm.engine()
    col, times = eng.track(mm.requests(eng, wl)[0]), []
    while not col.finished:  # thread CPU time: wall time drifts on a shared machine
        t0 = time.thread_time()
        eng.step()
        times.append(time.thread_time() - t0)
    gaps["engine_steps"] = times[1:]  # the first step is the prefill
    res = {"tokens": args.tokens, "window": args.window}
    for name, g in gaps.items():
        first, last = (statistics.fmean(x) * 1e3 for x in (g[: args.window], g[-args.window :]))
        res[name] = {"first_ms": first, "last_ms": last, "ratio": last / first}
        print(
            f"{name:13s} first {args.window}: {first:.3f} ms  last: {last:.3f} ms  ratio "
            f"{last / first:.2f} (target <= 1.2)"
        )
    report.write_json(args.out / "long_stream.json", res)
    return 0
