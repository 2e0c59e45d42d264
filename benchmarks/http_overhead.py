"""HTTP overhead: a workload through the engine in-process and through the server.

:func:`replay_in_process` plays the same requests at the same arrival times through
an :class:`~mmserve.engine.engine.Engine` in this process, doing at each arrival the
front-end work the server does besides HTTP (decode and hash the image bytes, render
the chat template and tokenize) and stepping the engine in between. Compared with the
HTTP run of the same schedule it gives the overhead of everything the server adds:
JSON parsing and pydantic validation, base64 data URLs, the event loop and thread
hops, server-sent-event chunks, the client's connections.

:func:`breakdown` reads the per-thread cProfile of a server run
(:mod:`benchmarks.profiled_server`) and sums self time by category, so the
overhead can be placed: which of JSON, base64, image decoding, tokenizing, the
event loop and the engine's own work took the CPU.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.workloads import Workload
from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.output import OutputCollector
from mmserve.engine.request import SamplingParams
from mmserve.model.loader import LoadedModel


@torch.inference_mode()
def replay_in_process(
    model: LoadedModel,
    model_dir: str,
    wl: Workload,
    arrivals: list[float],
    **engine_kw: Any,
) -> dict[str, Any]:
    """Run ``wl`` on a fresh in-process engine with requests arriving at ``arrivals``.

    Returns:
        ``duration_s`` (first arrival to last finish), ``cpu_s`` (this process),
        TTFT and TPOT percentiles (from each request's scheduled arrival), hit rate,
        tower runs and ``steps``: prefill and decode steps with their seconds and the
        mean decode batch (where the time goes against the cost bound).
    """
    eng = Engine(EngineConfig(model_path=model_dir, **engine_kw), model=model)
    params = SamplingParams(max_tokens=wl.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = wl.prompts
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    cols: dict[int, OutputCollector] = {}
    nxt = 0
    steps: dict[str, Any] = {"prefill": 0, "prefill_s": 0.0, "decode": 0, "decode_s": 0.0}
    steps.update(decode_tokens=0, prefill_detail=[])
    c0 = time.process_time()
    t0 = time.perf_counter()
    while nxt < len(order) or eng.has_work():
        now = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            p = prompts[i]
            images = [eng.processor.prepare_image(wl.images[n]) for n in p.images]  # decode + hash
            msg = eng.processor.make_request(messages=p.messages, images=images, params=params)
            cols[i] = eng.track(dataclasses.replace(msg, arrival=t0 + arrivals[i]))
            nxt += 1
        if eng.has_work():
            pre, dec = eng.stats.prefill_steps, eng.stats.decode_steps
            # engine state read between steps, on this (the engine's) thread
            done = {r.rid: (r.computed_len, r.cached_len) for r in eng.live_requests()}
            s0 = time.perf_counter()
            batch = eng.step()
            dt = time.perf_counter() - s0
            if eng.stats.prefill_steps > pre:
                steps["prefill"] += 1
                steps["prefill_s"] += dt
                grew = [
                    r.computed_len - c - (r.cached_len if c == 0 else 0)
                    for r in {x.rid: x for x in [*eng.live_requests(), *batch]}.values()
                    for c, _ in [done.get(r.rid, (0, 0))]
                    if r.computed_len > c
                ]
                steps["prefill_detail"].append(
                    {"requests": len(grew), "new_tokens": sum(grew), "seconds": dt}
                )
            elif eng.stats.decode_steps > dec:
                steps["decode"] += 1
                steps["decode_s"] += dt
                steps["decode_tokens"] += len(batch)
        elif nxt < len(order):
            time.sleep(max(0.0, arrivals[order[nxt]] - (time.perf_counter() - t0)))
    results = {i: c.result for i, c in cols.items()}
    end = max(r.latency + t0 + arrivals[i] for i, r in results.items())
    wall = end - (t0 + min(arrivals))
    cpu = time.process_time() - c0
    ttft = [r.ttft for r in results.values() if r.completion_tokens]
    tpot = [
        (r.latency - r.ttft) / (r.completion_tokens - 1)
        for r in results.values()
        if r.completion_tokens > 1
    ]
    stats = eng.cache_stats()
    return {
        "requests": len(results),
        "duration_s": wall,
        "cpu_s": cpu,
        "request_throughput": len(results) / wall if wall else None,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
        "tpot_p50_s": float(np.percentile(tpot, 50)) if tpot else None,
        "cache_hit_rate": stats["cache_hit_rate"],
        "all_finished": all(r.finish_reason == "length" for r in results.values()),
        "vision_tower_images": stats["vision_tower_images"],
        "steps": {
            **steps,
            "mean_decode_batch": steps["decode_tokens"] / steps["decode"] if steps["decode"] else 0,
        },
    }


#: Categories of self time, first match wins: (name, substrings of "file:function").
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("JSON (parse, dump)", ("json/", "_json", "json.", "orjson")),
    ("pydantic validation", ("pydantic",)),
    ("base64 / data URL", ("base64", "binascii", "b2a_", "a2b_", "api/media.py")),
    (
        "image decode + hash",
        (
            "PIL/",
            "PIL.",
            "Imaging",
            "xxhash",
            "mmserve/vision/image.py",
            "mmserve/vision/hashing.py",
        ),
    ),
    (
        "tokenize + chat template",
        (
            "tokenizers",
            "tokenization",
            "jinja2",
            "mmserve/engine/prompt.py",
            "mmserve/engine/processor.py",
            "api/generation.py",
        ),
    ),
    ("SSE chunks", ("api/openai_format.py", "sse", "StreamingResponse")),
    (
        "event loop + HTTP",
        (
            "asyncio",
            "uvicorn",
            "h11",
            "httptools",
            "starlette",
            "fastapi",
            "anyio",
            "selectors",
            "socket",
            "api/",
            "concurrent/futures",
            "threading.py",
            "queue.py",
            "select.",
            "method 'acquire'",
            "method 'wait'",
        ),
    ),
    ("engine (model, scheduler, cache)", ("mmserve/", "torch")),
]


def _category(key: tuple[str, int, str]) -> str:
    filename, _, func = key
    text = f"{filename}:{func}"
    for name, needles in CATEGORIES:
        if any(n in text for n in needles):
            return name
    return "other"


def _split_builtin(st: dict, key: tuple[str, int, str], depth: int = 0) -> dict[str, float]:
    """Self time of ``key`` by category; a C function's (file ``~``) goes to the
    categories of its callers, in proportion to the time each caller spent in it."""
    cc, nc, tt, ct, callers = st[key]
    if key[0] != "~" or not callers or depth > 4:
        return {_category(key): tt}
    out: dict[str, float] = defaultdict(float)
    total = sum(v[2] for v in callers.values()) or 1.0
    for caller, v in callers.items():
        share = tt * v[2] / total
        if caller in st:
            for cat, x in _split_builtin(st, caller, depth + 1).items():
                w = sum(_split_builtin(st, caller, depth + 1).values()) or 1.0
                out[cat] += share * x / w
        else:
            out[_category(caller)] += share
    return out


#: Engine-thread functions whose cumulative time is "model forward" and "sampling"
#: (file suffix, function names); the rest of ``Engine.step`` is the engine's overhead.
FORWARD = ("engine/model_runner.py", ("prefill", "decode"))
SAMPLING = (
    "engine/sampling.py",
    ("sample_batch", "batch_logprobs", "sample_token", "token_logprob"),
)


def engine_step_share(st: dict) -> dict[str, float] | None:
    """Where the engine thread's steps go, from one thread's pstats dict.

    Returns:
        ``step_s`` (cumulative seconds in ``Engine.step``), ``forward_s`` (in
        ``ModelRunner.prefill``/``decode``: embedding, vision tower, decoder, logits),
        ``sampling_s`` (the sampling functions) and ``outside_share``: the share of
        step time in neither (scheduling, grammar, page tables, deltas); None if the
        thread never stepped.
    """

    def cum(suffix: str, names: tuple[str, ...]) -> float:
        return sum(v[3] for k, v in st.items() if k[0].endswith(suffix) and k[2] in names)

    step = cum("engine/engine.py", ("step",))
    if step <= 0:
        return None
    forward, sampling = cum(*FORWARD), cum(*SAMPLING)
    return {
        "step_s": step,
        "forward_s": forward,
        "sampling_s": sampling,
        "outside_share": max(0.0, 1.0 - (forward + sampling) / step),
    }


def breakdown(profile_path: Path, top: int = 12) -> dict[str, Any]:
    """Self time by thread and by category from a :mod:`benchmarks.profiled_server` dump.

    Blocking waits (a thread sleeping in ``select``, on a lock or a condition) are self
    time in cProfile and are left out everywhere. ``threads_s``: each thread's busy
    self time; the engine thread (``mmserve-engine``) counts whole, the other threads
    (event loop, worker pool) are split by category; ``largest`` is the top category
    that is not the engine's; ``engine_thread`` is :func:`engine_step_share` of the
    engine thread.
    """
    stats: dict[str, dict] = pickle.loads(Path(profile_path).read_bytes())
    by_thread: dict[str, float] = {}
    cats: dict[str, float] = defaultdict(float)
    funcs: dict[str, float] = defaultdict(float)
    waits = ("select", "acquire", "wait", "sleep", "epoll", "poll", "_worker")
    for thread, st in stats.items():
        busy = sum(v[2] for k, v in st.items() if not any(w in k[2] for w in waits))
        by_thread[thread] = busy  # self time outside waits
        if thread.startswith("mmserve-engine"):
            continue
        for key, v in st.items():
            func = key[2]
            if any(w in func for w in waits):
                continue
            for cat, x in _split_builtin(st, key).items():
                cats[cat] += x
            funcs[f"{Path(key[0]).name}:{key[1]}({func})"] += v[2]
    engine = next(
        (engine_step_share(st) for t, st in stats.items() if t.startswith("mmserve-engine")), None
    )
    ranked = sorted(cats.items(), key=lambda kv: -kv[1])
    work = [(k, v) for k, v in ranked if not k.startswith("engine") and k != "other"]
    return {
        "threads_s": dict(sorted(by_thread.items(), key=lambda kv: -kv[1])),
        "categories_s": dict(ranked),
        "top_functions_s": dict(sorted(funcs.items(), key=lambda kv: -kv[1])[:top]),
        "largest": work[0][0] if work else None,
        "engine_thread": engine,
        "note": "cProfile self time (deterministic profiler: Python-heavy code is inflated "
        "relative to C); a C function's time goes to its callers' categories; engine "
        "thread reported whole, other threads by category",
    }
