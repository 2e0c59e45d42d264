"""``python -m benchmarks determinism``: what ``--deterministic`` costs and what it buys.

Cost: many_questions req/s (in-process engine, ``--size`` checkpoint) and batch-1 /
batch-8 decode ms per step on the OneVision-0.5B shape (``--decode-size``, seeded random
weights; a ``--decode-context``-token cached text prefix), the mode off and on in
interleaved rounds, medians. Gain: one request asked 10 times under different
cache histories, chunk budgets and concurrency, greedy: how many distinct answers
(token ids and logprobs) with the mode off and on. Dtype: what ``--dtype auto`` picks on
this machine unless ``--dtype`` says.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from benchmarks import workloads
from benchmarks.in_process import MMServeRunner, model_dir
from benchmarks.workloads import Prompt, Workload, ask, photos
from mmserve.config import EngineConfig
from mmserve.types import SamplingParams

OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--dtype",), dict(default="auto", help="model dtype (auto: what serve picks)")),
    (("--repeats",), dict(type=int, default=3, help="off/on rounds")),
    (("--decode-size",), dict(default="onevision-0.5b", help="checkpoint of the decode part")),
    (("--decode-model",), dict(help="decode part: this checkpoint folder, not --decode-size's")),
    (("--decode-tokens",), dict(type=int, default=8, help="decode steps per run")),
    (("--decode-context",), dict(type=int, default=512, help="decode part: context tokens")),
    (("--parts",), dict(default="answers,serve,decode", help="answers, serve and/or decode")),
]


def _dtype(path: str, asked: str) -> str:
    if asked != "auto":
        return asked
    return str(EngineConfig(model_path=path).torch_dtype()).removeprefix("torch.")


def distinct_answers(path: str, dtype: str, deterministic: bool) -> int:
    """Distinct ``(token ids, logprobs)`` of one photo question asked 10 times: alone on a
    fresh engine, after other questions about the photo (cache warm, several chunk budgets
    and page sizes), among concurrent requests, and with the cache off."""
    runner = MMServeRunner.load(path, dtype=dtype)
    img = photos(1)
    wl = Workload("q", "", img, [[Prompt(ask(workloads.QUESTIONS[1]), list(img))]], 8)
    others = Workload(
        "o", "", img, [[Prompt(ask(q), list(img)) for q in workloads.QUESTIONS[2:5]]], 8
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    settings: list[dict[str, Any]] = [
        {},
        {"page_size": 16},
        {"max_prefill_tokens": 97},
        {"max_prefill_tokens": 256, "max_num_batched_tokens": 64},
        {"disable_radix_cache": True},
    ]
    answers = set()
    for k in range(10):
        cfg = settings[k % len(settings)]
        eng = runner.engine(deterministic=deterministic, **cfg)
        target = runner.requests(eng, wl, params)
        extra = runner.requests(eng, others, params)
        if k >= 5:  # concurrent: the others share the step
            res = eng.generate([*extra, *target])[-1]
        else:  # history: the others first (a cache warm with the photo), except k == 0
            if k:
                eng.generate(extra)
            res = eng.generate(target)[0]
        answers.add((tuple(res.output_ids), tuple(t.logprob for t in res.logprobs or [])))
    return len(answers)


def serve_rate(path: str, dtype: str, repeats: int) -> dict[str, Any]:
    """many_questions (8 photos x 4 questions, 8 tokens) req/s, off/on interleaved."""
    runner = MMServeRunner.load(path, dtype=dtype)
    wl = workloads.many_questions(8, 4, 8)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        for mode in ("off", "on"):
            run = runner.run(wl, mode, check_leaks=False, deterministic=mode == "on")
            rates[mode].append(run.requests / run.wall_s)
    return {k: statistics.median(v) for k, v in rates.items()} | {"rounds": rates}


def _passage(tokenizer: Any, tokens: int) -> str:
    """Text of at least ``tokens`` tokens (the questions repeated), for a decode context."""
    words = " ".join(workloads.QUESTIONS)
    text = words
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += " " + words
    return text


def decode_ms(path: str, dtype: str, repeats: int, tokens: int, context: int) -> dict[str, Any]:
    """Decode ms per step (median of the steps, then of the rounds) at batch 1 and 8, the
    mode off and on in interleaved rounds.

    One engine per mode for the whole run: a ``context``-token text prefix is prefilled
    once (its KV then cached), and each round sends ``batch`` requests, each the prefix
    plus its own short question (a prefill of the question's tokens only), decoded
    ``tokens`` steps at ``batch`` rows: the decode steps, not the prefills, are timed.
    """
    runner = MMServeRunner.load(path, dtype=dtype, max_total_tokens=32768)
    engines = {m: runner.engine(deterministic=m == "on") for m in ("off", "on")}
    prefix = _passage(runner.model.tokenizer, context)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def steps(eng: Any, questions: list[str]) -> tuple[float, float]:
        """Median ``(wall, CPU)`` ms of the decode steps of ``questions`` run together."""
        cols = [
            eng.track(
                eng.processor.make_request(
                    messages=[{"role": "user", "content": f"{prefix}\n\n{q}"}], params=params
                )
            )
            for q in questions
        ]
        wall, cpu = [], []
        while eng.has_work():
            t0, c0, before = time.perf_counter(), time.process_time(), eng.stats.prefill_steps
            eng.step()
            if eng.stats.prefill_steps == before:
                wall.append((time.perf_counter() - t0) * 1e3)
                cpu.append((time.process_time() - c0) * 1e3)
        assert all(c.finished for c in cols)
        return statistics.median(wall), statistics.median(cpu)

    for eng in engines.values():  # the prefix's KV, once per engine
        steps(eng, ["Summarize."])
    out: dict[str, Any] = {"context_tokens": context, "load": [os.getloadavg()[0]]}
    for batch in (1, 8):
        per: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        for rep in range(repeats):
            qs = [f"{workloads.QUESTIONS[i % 16]} (take {rep}.{i})" for i in range(batch)]
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                per[mode].append(steps(engines[mode], qs))
        row: dict[str, Any] = {}
        for k, label in ((0, ""), (1, "_cpu")):
            for mode in ("off", "on"):
                row[mode + label] = statistics.median(r[k] for r in per[mode])
            # the median of the rounds' own on/off ratios: a round's pair ran back to back
            row["on_over_off" + label] = statistics.median(
                a[k] / b[k] for a, b in zip(per["on"], per["off"], strict=True)
            )
        out[f"batch{batch}"] = row | {"rounds": per}
        print(f"decode batch {batch} ms/step:", row, flush=True)
    out["load"].append(os.getloadavg()[0])
    return out


def determinism(args: argparse.Namespace, path: str) -> int:
    """``--deterministic`` off vs on: distinct answers, many_questions req/s, decode ms."""
    dtype = _dtype(path, args.dtype)
    parts = set(args.parts.split(","))
    res: dict[str, Any] = {"dtype": dtype, "cpus": os.cpu_count(), "load": os.getloadavg()[0]}
    if "answers" in parts:
        res["distinct_answers"] = {
            m: distinct_answers(path, dtype, m == "on") for m in ("off", "on")
        }
        print("distinct answers of 10:", res["distinct_answers"], flush=True)
    if "serve" in parts:
        res["many_questions_req_s"] = serve_rate(path, dtype, args.repeats)
        print("many_questions req/s:", res["many_questions_req_s"], flush=True)
    if "decode" in parts:
        ov = args.decode_model or model_dir(args.decode_size, "llava-onevision")
        res["decode_dtype"] = _dtype(ov, args.dtype)
        res["decode_ms"] = decode_ms(
            ov, res["decode_dtype"], args.repeats, args.decode_tokens, args.decode_context
        )
        print("decode ms/step:", res["decode_ms"], flush=True)
    (args.out / "determinism.json").write_text(json.dumps(res, indent=1))
    return 0
