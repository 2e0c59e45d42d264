"""Replica routing benchmark: ``python -m benchmarks.replicas [--quick] [--size small]``.

One workload, run against engine replicas on Ray Serve (a local Ray instance on
loopback) with each request router, plus one replica as the reference:

- ``1 replica``: the cache hit rate a single engine gets (the ceiling for N replicas);
- ``2 replicas, cache``: :class:`~api.replicas.router.CacheAwareRouter` (longest
  prefix of the token sequence, images included, unless the load is uneven);
- ``2 replicas, pow2``: Ray Serve's default power-of-two-choices router;
- ``2 replicas, round_robin``: each replica in turn.

The workload (:func:`interleaved`) mixes K images asked M questions each (shared
system prompt) and C multi-turn chat sessions of T turns (each with its own photo in
the first turn; the history holds canned answers, so every setup sees the same
prompts), all arriving interleaved from ``concurrency`` clients; a session sends its
next turn when its previous answer arrives. Images are uploaded once through the
endpoint (``POST /v1/images``) and referred to by id.

Per setup: requests/s and output tokens/s over wall time, TTFT p50/p99 measured by
the streaming client, the cache hit rate (cached / prompt tokens, from the
endpoint's ``/v1/cache/stats`` before and after), the hit rate over the offline
optimum (SGLang Theorem 3.1 over the prompts' token ids, computed here with the
same front end), vision-tower runs per distinct image, pixel fetches and the
router's decisions. On a 2-core machine throughput does not grow with replicas
(they share the cores); hit rate and tower runs are the measure. Writes
``<out>/replicas.json`` and ``<out>/replicas.md`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import workloads
from benchmarks.loadgen import SLO, RequestResult, _one, summarize

DEFAULT_OUT = Path(__file__).resolve().parent / "results"

#: Workload sizes per scale (images x questions, sessions x turns, output tokens,
#: concurrent clients).
SCALES = {
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


# ---- workload ----------------------------------------------------------------------


@dataclass
class Job:
    """One chat request: engine-style messages (image parts ``{"type": "image"}``) and the
    names of the images filling them, in order; ``session``/``turn`` for chat turns."""

    messages: list[dict]
    images: list[str]
    session: int | None = None
    turn: int = 0


@dataclass
class Interleaved:
    """Questions about images plus chat sessions, in a seeded arrival order.

    Attributes:
        images: encoded image bytes by name.
        arrivals: independent questions and each session's first turn, interleaved.
        sessions: each session's turns in order.
        max_tokens: output tokens per request (``ignore_eos``: always this many).
        params: the generator's arguments.
    """

    images: dict[str, bytes]
    arrivals: list[Job]
    sessions: list[list[Job]]
    max_tokens: int
    params: dict = field(default_factory=dict)

    def jobs(self) -> list[Job]:
        """Every request (questions, then all turns of every session)."""
        return [j for j in self.arrivals if j.session is None] + [
            j for s in self.sessions for j in s
        ]

    @property
    def num_requests(self) -> int:
        """Requests in the workload."""
        return len(self.jobs())

    @property
    def distinct_images(self) -> int:
        """Distinct images the requests refer to."""
        return len({name for j in self.jobs() for name in j.images})


def interleaved(k: int, m: int, c: int, t: int, max_tokens: int, seed: int = 0) -> Interleaved:
    """``k`` images x ``m`` questions and ``c`` sessions x ``t`` turns, interleaved.

    Questions come from :func:`benchmarks.workloads.many_questions` and sessions from
    :func:`benchmarks.workloads.multi_turn` (its turns in order per session); sessions
    use images ``k .. k + c - 1`` of :func:`benchmarks.workloads.photos`, so they share
    no image with the questions.
    """
    mq = workloads.many_questions(k, m, max_tokens, seed)
    mt = workloads.multi_turn(c, t, max_tokens, seed + 1)
    # multi_turn's photos are photos(c), the first c of the same list: rename them to
    # images k.. so sessions and questions use different pictures
    all_photos = workloads.photos(k + c)
    names = list(all_photos)
    session_names = dict(zip(list(mt.images), names[k : k + c], strict=True))
    images = {n: all_photos[n] for n in names[: k + c]}
    questions = [Job(p.messages, list(p.images)) for p in mq.prompts]
    prompts = mt.prompts
    sessions = [
        [
            Job(prompts[i].messages, [session_names[n] for n in prompts[i].images], s, turn)
            for turn, i in enumerate(turns)
        ]
        for s, turns in enumerate(mt.sessions)
    ]
    arrivals = questions + [s[0] for s in sessions]
    random.Random(seed).shuffle(arrivals)
    params = {"images": k, "questions": m, "sessions": c, "turns": t, "max_tokens": max_tokens}
    return Interleaved(images, arrivals, sessions, max_tokens, params)


def openai_messages(job: Job, ids: dict[str, str]) -> list[dict]:
    """``job``'s messages with image parts as ``image_url`` parts naming uploaded ids."""
    names = iter(job.images)
    out = []
    for msg in job.messages:
        content = msg["content"]
        if isinstance(content, str):
            out.append(msg)
            continue
        parts = []
        for p in content:
            if p["type"] == "image":
                parts.append({"type": "image_url", "image_url": {"url": ids[next(names)]}})
            else:
                parts.append(p)
        out.append({**msg, "content": parts})
    return out


def prompt_ids(model_dir: str | Path, wl: Interleaved) -> tuple[list[list[int]], int]:
    """Token ids (image pseudo-ids included) of every request, by the served front end,
    and the number of distinct image keys the requests use (two names may be the same
    pixels: :func:`benchmarks.workloads.photos` repeats a photo after 8 variants)."""
    from api.replicas.frontend import FrontEnd, load_frontend_model
    from mmserve.config import EngineConfig
    from mmserve.engine.request import SamplingParams

    front = FrontEnd(EngineConfig(model_path=str(model_dir)), load_frontend_model(model_dir))
    images = {n: front.processor.prepare_image(b) for n, b in wl.images.items()}
    params = SamplingParams(max_tokens=wl.max_tokens)
    seqs = [
        front.processor.make_request(
            messages=j.messages, images=[images[n] for n in j.images], params=params
        ).input_ids
        for j in wl.jobs()
    ]
    keys = {images[n].key for j in wl.jobs() for n in j.images}
    return seqs, len(keys)


# ---- driver --------------------------------------------------------------------------


def upload_images(url: str, images: dict[str, bytes], timeout: float = 60) -> dict[str, str]:
    """Upload every image through the endpoint; ``{name: id}``."""
    ids = {}
    with httpx.Client(timeout=timeout) as http:
        for name, data in images.items():
            r = http.post(f"{url}/v1/images", files={"file": (name, data, "image/png")})
            r.raise_for_status()
            ids[name] = r.json()["id"]
    return ids


def request_body(model: str, job: Job, ids: dict[str, str], max_tokens: int) -> bytes:
    """The streamed, greedy chat completion of ``job`` (``ignore_eos``: exactly
    ``max_tokens`` tokens), as :mod:`benchmarks.loadgen` sends it."""
    body = {
        "model": model,
        "messages": openai_messages(job, ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


async def drive(
    url: str, model: str, wl: Interleaved, ids: dict[str, str], concurrency: int
) -> tuple[list[RequestResult], float]:
    """Run the workload with ``concurrency`` closed-loop clients.

    Clients take jobs in arrival order; when a session's turn is answered, its next
    turn joins the end of the queue. Each request is measured by
    :mod:`benchmarks.loadgen` (TTFT to the first content chunk, usage from the final
    chunk).

    Returns:
        One :class:`~benchmarks.loadgen.RequestResult` per request in :meth:`Interleaved.jobs`
        order, and the wall seconds of the run.
    """
    jobs = wl.jobs()
    index = {id(j): i for i, j in enumerate(jobs)}
    results: list[RequestResult | None] = [None] * len(jobs)
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in wl.arrivals:
        queue.put_nowait(job)
    left = len(jobs)
    finished = asyncio.Event()
    endpoint = f"{url}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}

    async def client(http: httpx.AsyncClient, t0: float) -> None:
        nonlocal left
        while left:
            get = asyncio.ensure_future(queue.get())
            stop = asyncio.ensure_future(finished.wait())
            await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not get.done():
                get.cancel()
                return
            job = get.result()
            i = index[id(job)]
            res = RequestResult(i, time.perf_counter() - t0)
            body = request_body(model, job, ids, wl.max_tokens)
            await _one(http, endpoint, body, res, t0, headers)
            results[i] = res
            if job.session is not None and job.turn + 1 < len(wl.sessions[job.session]):
                queue.put_nowait(wl.sessions[job.session][job.turn + 1])
            left -= 1
            if not left:
                finished.set()

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, t0) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def get_json(url: str) -> dict:
    """GET ``url`` and parse the JSON body."""
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def run_setup(
    url: str,
    model: str,
    wl: Interleaved,
    concurrency: int,
    optimum: float | None = None,
    distinct: int | None = None,
) -> dict:
    """Upload the images, drive the workload against ``url`` and measure it.

    Args:
        optimum: the offline-optimal hit rate (for ``hit_rate_over_optimum``).
        distinct: distinct images (keys) the workload uses (default: its image names).

    Returns:
        The setup's figures (see the module docstring); ``replies`` holds each
        request's text and usage in :meth:`Interleaved.jobs` order.
    """
    distinct = distinct or wl.distinct_images
    ids = upload_images(url, wl.images)
    before = get_json(f"{url}/v1/cache/stats")
    results, wall = asyncio.run(drive(url, model, wl, ids, concurrency))
    after = get_json(f"{url}/v1/cache/stats")

    def delta(key: str) -> float:
        return (after.get(key) or 0) - (before.get(key) or 0)

    load = summarize(results, wl.max_tokens, SLO(ttft_s=math.inf, tpot_s=math.inf), wall)
    prompt, cached = delta("prompt_tokens"), delta("cached_tokens")
    tower = delta("vision_tower_images")
    hit = cached / prompt if prompt else 0.0
    ttft = load["ttft_s"]
    out = {
        "requests": len(results),
        "errors": load["failed"],
        "error_messages": load["errors"],
        "wall_seconds": wall,
        "requests_per_second": load["request_throughput"] or 0.0,
        "output_tokens_per_second": load["output_throughput"] or 0.0,
        "ttft_p50_ms": 1000 * (ttft["p50"] or 0.0),
        "ttft_p99_ms": 1000 * (ttft["p99"] or 0.0),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": hit,
        "client_hit_rate": load["cache_hit_rate"],
        "hit_rate_over_optimum": hit / optimum if optimum else None,
        "distinct_images": distinct,
        "vision_tower_runs": tower,
        "tower_runs_per_image": tower / distinct if distinct else 0.0,
        "pixel_fetches": delta("pixel_fetches"),
        "retries": delta("retries"),
        "replies": [
            {
                "ok": r.ok,
                "text": r.text,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "error": r.error,
            }
            for r in results
        ],
    }
    if after.get("router") is not None:
        out["router"] = after["router"]["by_reason"]
    if isinstance(after.get("replicas"), dict):
        out["per_replica"] = {
            uid: {
                "requests": s.get("requests_finished"),
                "hit_rate": s.get("cache_hit_rate"),
                "tower_runs": s.get("vision_tower_images"),
            }
            for uid, s in after["replicas"].items()
            if isinstance(s, dict)
        }
    return out


# ---- Ray setups ----------------------------------------------------------------------


def wait_healthy(url: str, replicas: int, timeout: float = 300) -> None:
    """Wait until ``/health`` reports ``replicas`` healthy replicas.

    Raises:
        TimeoutError: not within ``timeout`` seconds.
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if get_json(f"{url}/health").get("healthy_replicas", 0) >= replicas:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy with {replicas} replicas in {timeout} s")


def run_all(
    model_dir: Path, scale: str, port: int, setups: Sequence[tuple[str, int, str]] = SETUPS
) -> dict:
    """Start Ray on loopback, deploy and measure each setup in turn, shut Ray down."""
    from api.replicas.launch import APP_NAME, build_application, init_ray_local
    from api.replicas.settings import ReplicaSettings
    from api.settings import ServerSettings
    from mmserve.config import EngineConfig

    size = SCALES[scale]
    wl = interleaved(size["k"], size["m"], size["c"], size["t"], size["max_tokens"])
    seqs, distinct = prompt_ids(model_dir, wl)
    opt = workloads.optimal_hit_rate(seqs)
    results: dict = {
        "scale": scale,
        "model": str(model_dir),
        "workload": {
            **wl.params,
            "requests": wl.num_requests,
            "distinct_images": distinct,
            "concurrency": size["concurrency"],
            **opt,
        },
        "setups": {},
    }
    init_ray_local()
    import ray
    from ray import serve

    url = f"http://127.0.0.1:{port}"
    try:
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": "127.0.0.1", "port": port},
            logging_config={"log_level": "WARNING"},
        )
        for name, n, router in setups:
            config = EngineConfig(model_path=str(model_dir))
            rs = ReplicaSettings(replicas=n, replica_router=router, cpus_per_replica=0.5)
            t0 = time.perf_counter()
            app = build_application(config, ServerSettings(), rs)
            serve.run(app, name=APP_NAME, logging_config={"log_level": "WARNING"})
            wait_healthy(url, n)
            start = time.perf_counter() - t0
            res = run_setup(
                url, model_dir.name, wl, size["concurrency"], opt["optimal_hit_rate"], distinct
            )
            res["replicas"], res["router_policy"], res["startup_seconds"] = n, router, start
            results["setups"][name] = res
            print(summary_line(name, res), flush=True)
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def summary_line(name: str, r: dict) -> str:
    """One setup's figures in one line."""
    return (
        f"{name:<24} hit {r['hit_rate']:.3f} (x{r['hit_rate_over_optimum'] or 0:.3f} of optimum)"
        f"  tower/image {r['tower_runs_per_image']:.2f}  {r['requests_per_second']:.2f} req/s"
        f"  TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms"
        f"  errors {r['errors']}"
    )


def summary_markdown(results: dict) -> str:
    """The setups side by side as a markdown table."""
    w = results["workload"]
    lines = [
        "# Replica routing benchmark",
        "",
        f"Workload: {w['images']} images x {w['questions']} questions + {w['sessions']} "
        f"sessions x {w['turns']} turns = {w['requests']} requests, interleaved from "
        f"{w['concurrency']} clients; {w['max_tokens']} output tokens each; "
        f"{w['distinct_images']} distinct images; offline-optimal hit rate "
        f"{w['optimal_hit_rate']:.3f}. Model: `{Path(results['model']).name}`.",
        "",
        "| setup | hit rate | hit / optimum | tower runs / image | pixel fetches | req/s "
        "| output tok/s | TTFT p50 ms | TTFT p99 ms | errors | routed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results["setups"].items():
        routed = ", ".join(f"{k} {v}" for k, v in sorted((r.get("router") or {}).items()))
        lines.append(
            f"| {name} | {r['hit_rate']:.3f} | {r['hit_rate_over_optimum'] or 0:.3f} "
            f"| {r['tower_runs_per_image']:.2f} | {r['pixel_fetches']:.0f} "
            f"| {r['requests_per_second']:.2f} | {r['output_tokens_per_second']:.1f} "
            f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['errors']} | {routed} |"
        )
    lines += [
        "",
        "Hit rate: cached / prompt tokens over the run (the endpoint's totals). Tower runs "
        "per image: vision-encoder runs over all replicas / distinct images (1.0: each "
        "image encoded once). Throughput and TTFT: replicas share this machine's cores.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.replicas", description=__doc__)
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--quick", action="store_const", const="quick", dest="scale")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--model", type=Path, help="checkpoint directory (default: --size)")
    p.add_argument("--port", type=int, default=8470, help="HTTP port of the endpoint")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    from mmserve.model.make_checkpoint import ensure_model

    model_dir = args.model or ensure_model(args.size)
    results = run_all(Path(model_dir), args.scale, args.port)
    args.out.mkdir(parents=True, exist_ok=True)
    slim = {
        **results,
        "setups": {
            n: {k: v for k, v in r.items() if k != "replies"} for n, r in results["setups"].items()
        },
    }
    (args.out / "replicas.json").write_text(json.dumps(slim, indent=2))
    md = summary_markdown(results)
    (args.out / "replicas.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
