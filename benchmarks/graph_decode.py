"""Decode speed with and without CUDA graphs, and where the engine thread's step goes.

``python -m benchmarks.graph_decode [--device cuda] [--size onevision-0.5b ...]`` (also
``python -m benchmarks graph-decode``; the GPU check runs it):

* **decode tokens/s** at each ``--batches`` size, per engine configuration: on CUDA
  FlashInfer with CUDA graphs, FlashInfer eager (``disable_cuda_graph``) and the torch
  backend (eager: its kernels cannot be captured); on the CPU eager and the padded CPU
  twin (``cuda_graph_twin``). ``B`` text requests, greedy, ``ignore_eos``, submitted at
  once; tokens/s counts only steps without a prefill. Each configuration's tokens are
  compared with the first one's (``tokens_equal``: requests whose output ids match);
  on CUDA also the synchronizing calls per decode step (torch's sync debug mode).
* **engine-thread profile** on many_questions, every request submitted at once (its peak
  rate): per step, wall time of :meth:`Engine.step`, of the model calls
  (``ModelRunner.prefill``/``decode``: on CUDA only their launch, the kernels run
  asynchronously) and of sampling (``sample_batch`` + ``batch_logprobs``: on CUDA this
  holds the wait for the device, the step's one sync, measured apart as ``wait`` by a
  synchronize just before it). ``host`` = step - model - sampling - wait: the engine
  thread's own work (scheduling, metadata, logits processors, grammar, bookkeeping),
  ``host_share`` = host / step; on CUDA ``busy_share`` = 1 - wait / step, the part of
  a step in which the engine thread, not the device, is the bottleneck.

Seconds are wall time on a machine that may be shared: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import workloads
from benchmarks.in_process import MMServeRunner
from benchmarks.in_process import model_dir as checkpoint
from benchmarks.report import emit, loadavg, write_json
from mmserve.config import EngineConfig
from mmserve.engine import engine as engine_module
from mmserve.frontend.frontend import Engine
from mmserve.model.loader import load_model
from mmserve.types import SamplingParams

#: Engine configurations per device: name -> EngineConfig fields.
CONFIGS = {
    "cuda": {
        "flashinfer+graphs": {"attention_backend": "flashinfer"},
        "flashinfer eager": {"attention_backend": "flashinfer", "disable_cuda_graph": True},
        "torch eager": {"attention_backend": "torch"},
    },
    "cpu": {"eager": {}, "padded twin": {"cuda_graph_twin": True}},
}


@contextlib.contextmanager
def profiled(eng: Engine) -> Iterator[dict[str, float]]:
    """Accumulate ``step``, ``model``, ``sample`` and ``wait`` seconds (and ``steps``) of
    ``eng`` while inside; the engine module's sampling functions are restored on exit.
    On CUDA, ``wait`` is a synchronize just before sampling (which would wait there
    anyway): the time the engine thread waits for the device, kept out of ``sample``."""
    acc = {"steps": 0, "step_s": 0.0, "model_s": 0.0, "sample_s": 0.0, "wait_s": 0.0}
    cuda = eng.config.device.startswith("cuda")

    def timed(fn: Any, key: str) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t0

        return wrapper

    saved = engine_module.sample_batch, engine_module.batch_logprobs
    runner = eng.runner
    runner.prefill = timed(type(runner).prefill.__get__(runner), "model_s")
    runner.decode = timed(type(runner).decode.__get__(runner), "model_s")
    sample = timed(saved[0], "sample_s")

    def waited_sample(*a: Any, **kw: Any) -> Any:
        if cuda:
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            acc["wait_s"] += time.perf_counter() - t0
        return sample(*a, **kw)

    engine_module.sample_batch = waited_sample
    engine_module.batch_logprobs = timed(saved[1], "sample_s")
    step = eng.step

    def counted_step() -> list:
        t0 = time.perf_counter()
        out = step()
        acc["step_s"] += time.perf_counter() - t0
        acc["steps"] += 1
        return out

    eng.step = counted_step
    try:
        yield acc
    finally:
        engine_module.sample_batch, engine_module.batch_logprobs = saved
        del runner.prefill, runner.decode, eng.step


def summarize(acc: dict[str, float]) -> dict[str, float]:
    """Per-step milliseconds and shares from :func:`profiled`'s sums: ``host_share`` (the
    engine thread's own work outside model calls and sampling) and, on CUDA,
    ``busy_share`` = 1 - wait / step (the part of a step the engine thread spends not
    waiting for the device: what overlapping the next step's host work could hide)."""
    n = max(1, acc["steps"])
    step = acc["step_s"]
    host = step - acc["model_s"] - acc["sample_s"] - acc["wait_s"]
    return {
        "steps": acc["steps"],
        "step_ms": step / n * 1e3,
        "model_ms": acc["model_s"] / n * 1e3,
        "sample_ms": acc["sample_s"] / n * 1e3,
        "wait_ms": acc["wait_s"] / n * 1e3,
        "host_ms": host / n * 1e3,
        "host_share": host / step if step else 0.0,
        "busy_share": 1 - acc["wait_s"] / step if step else 0.0,
    }


@contextlib.contextmanager
def sync_warnings() -> Iterator[list]:
    """The synchronizing CUDA calls made inside (torch's sync debug mode, "warn"), as a
    list of warnings filled on exit."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def syncs_per_decode_step(eng: Engine, batch: int, tokens: int) -> float:
    """Mean synchronizing CUDA calls in a step without a prefill (``batch`` greedy text
    requests of ``tokens`` tokens): 1 is the sampled tokens' read alone."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        text = f"{workloads.QUESTIONS[i % 16]} (sync {i})"
        msg = [{"role": "user", "content": text}]
        eng.track(eng.processor.make_request(messages=msg, params=params))
    counts = []
    while eng.has_work():
        pre = eng.stats.prefill_steps
        with sync_warnings() as caught:
            eng.step()
        if eng.stats.prefill_steps == pre:
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return sum(counts) / len(counts) if counts else 0.0


def decode_rate(eng: Engine, batch: int, tokens: int) -> tuple[float, list[list[int]], dict]:
    """``batch`` text requests of ``tokens`` greedy tokens at once: decode tokens/s over
    the steps without a prefill, their output ids, and the step profile."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    msgs = [
        eng.processor.make_request(
            messages=[{"role": "user", "content": f"{workloads.QUESTIONS[i % 16]} ({i})"}],
            params=params,
        )
        for i in range(batch)
    ]
    cols = [eng.track(m) for m in msgs]
    sync = torch.cuda.synchronize if eng.config.device.startswith("cuda") else lambda: None
    decode_s, decode_tokens = 0.0, 0
    with profiled(eng) as acc:
        while eng.has_work():
            pre = eng.stats.prefill_steps
            sync()
            t0 = time.perf_counter()
            got = eng.step()
            sync()
            if eng.stats.prefill_steps == pre:
                decode_s += time.perf_counter() - t0
                decode_tokens += len(got)
    outputs = [list(c.result.output_ids) for c in cols]
    return decode_tokens / decode_s if decode_s else 0.0, outputs, summarize(acc)


def rates(
    model_dir: str,
    device: str,
    dtype: str,
    batches: list[int],
    tokens: int,
    on_row: Callable[[dict], None] = lambda _: None,
) -> dict:
    """:func:`decode_rate` for every configuration of :data:`CONFIGS` on ``device``;
    ``on_row(result so far)`` after each configuration."""
    model = load_model(model_dir, device=device, dtype=getattr(torch, dtype))
    out: dict[str, Any] = {"device": device, "dtype": dtype, "tokens": tokens, "configs": {}}
    first: dict[int, list[list[int]]] | None = None
    for name, kw in CONFIGS["cuda" if device.startswith("cuda") else "cpu"].items():
        t0 = time.perf_counter()
        cfg = EngineConfig(model_path=model_dir, device=device, dtype=dtype, **kw)
        eng = Engine(cfg, model=model)
        graphs = eng.runner.graphs
        row: dict[str, Any] = {
            "start_s": time.perf_counter() - t0,
            "captured": sorted(graphs.graphs) if graphs else [],
            "capture_s": graphs.capture_seconds if graphs else 0.0,
            "capture_mib": graphs.capture_bytes / 2**20 if graphs else 0.0,
            "backend": eng.runner.backend.name,
        }
        decode_rate(eng, 2, 4)  # warm-up: kernels built, allocator primed
        outs = {}
        for b in batches:
            tps, outs[b], prof = decode_rate(eng, b, tokens)
            row[f"bs{b}_tok_s"] = tps
            row[f"bs{b}_host_share"] = prof["host_share"]
        if device.startswith("cuda"):
            row["syncs_per_decode_step"] = syncs_per_decode_step(eng, min(batches[-1], 8), 8)
        if first is None:
            first = outs
        row["tokens_equal"] = {
            b: sum(x == y for x, y in zip(outs[b], first[b], strict=True)) for b in batches
        }
        out["configs"][name] = row
        on_row(out)
        del eng
    return out


def many_questions_profile(model_dir: str, device: str, dtype: str, scale: tuple) -> dict:
    """The engine-thread profile (:func:`profiled`) of many_questions (``scale``: photos,
    questions per photo, max tokens) for every configuration of :data:`CONFIGS`."""
    wl = workloads.many_questions(*scale)
    runner = MMServeRunner(
        load_model(model_dir, device=device, dtype=getattr(torch, dtype)), model_dir
    )
    out = {}
    for name, kw in CONFIGS["cuda" if device.startswith("cuda") else "cpu"].items():
        eng = runner.engine(device=device, dtype=dtype, **kw)
        eng.generate(runner.requests(eng, workloads.many_questions(1, 1, 2)))  # warm-up
        reqs = runner.requests(eng, wl)
        with profiled(eng) as acc:
            eng.generate(reqs)
        out[name] = summarize(acc)
    return out


def table(res: dict) -> str:
    """Markdown tables of :func:`rates` and :func:`many_questions_profile` results."""
    lines = []
    if "rates" in res:
        r = res["rates"]
        bs = [
            k[2:].removesuffix("_tok_s")
            for k in next(iter(r["configs"].values()))
            if k.endswith("_tok_s")
        ]
        lines.append(f"decode tokens/s ({r['device']}, {r['dtype']}, {r['tokens']} tokens each)")
        head = " | ".join(f"bs {b}" for b in bs)
        lines.append(f"| config | {head} | capture | same tokens | syncs per decode step |")
        lines.append("|---" * (len(bs) + 4) + "|")
        for name, row in r["configs"].items():
            cells = [f"{row[f'bs{b}_tok_s']:.0f}" for b in bs]
            cap = (
                f"{len(row['captured'])} in {row['capture_s']:.1f} s, {row['capture_mib']:.0f} MiB"
            )
            same = ", ".join(f"{v}/{b}" for b, v in row["tokens_equal"].items())
            syncs = row.get("syncs_per_decode_step", "n/a (CPU)")
            syncs = f"{syncs:.1f}" if isinstance(syncs, float) else syncs
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {cap} | {same} | {syncs} |")
    if "profile" in res:
        lines.append(
            "\nengine thread per step on many_questions (ms; host = step - model - sampling - wait)"
        )
        lines.append(
            "| config | steps | step | model | sampling | device wait | host | host share "
            "| not waiting |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for name, p in res["profile"].items():
            lines.append(
                f"| {name} | {p['steps']} | {p['step_ms']:.2f} | {p['model_ms']:.2f} | "
                f"{p['sample_ms']:.2f} | {p['wait_ms']:.2f} | {p['host_ms']:.2f} | "
                f"{p['host_share']:.1%} | {p['busy_share']:.1%} |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace, model_dir: str) -> int:
    """The ``graph-decode`` subcommand: :func:`rates` and :func:`many_questions_profile`;
    prints the tables, writes ``graph_decode.json`` and ``.md`` into ``--out``."""
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    res: dict[str, Any] = {}
    parts = args.parts.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "graph_decode.partial.json"  # what a timed-out run leaves
    if "rates" in parts:
        batches = [int(b) for b in args.batches.split(",")]
        save = lambda r: write_json(partial, {"rates": r})  # noqa: E731
        res["rates"] = rates(model_dir, args.device, dtype, batches, args.tokens, save)
    if "profile" in parts:
        scale = (args.images, args.questions, args.profile_tokens)
        res["profile"] = many_questions_profile(
            args.profile_model or model_dir, args.device, dtype, scale
        )
    res["loadavg"] = loadavg()
    partial.unlink(missing_ok=True)
    return emit(args.out, "graph_decode", res, table(res) + f"\n\nload average {res['loadavg']}")


#: The subcommand's options (flags, kwargs), shared with ``python -m benchmarks``.
OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--device",), dict(default="cpu")),
    (("--dtype",), dict(default=None, help="default: bfloat16 on CUDA, float32 on the CPU")),
    (("--parts",), dict(default="rates,profile", help="rates and/or profile")),
    (("--batches",), dict(default="1,8,32")),
    (("--tokens",), dict(type=int, default=32, help="decode tokens per request")),
    (("--images",), dict(type=int, default=4, help="many_questions photos")),
    (("--questions",), dict(type=float, default=4, help="many_questions questions per photo")),
    (("--profile-tokens",), dict(type=int, default=16, help="many_questions answer tokens")),
    (("--profile-model",), dict(type=Path, help="checkpoint of the profile (default: --model)")),
]


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.graph_decode``: the subcommand without the benchmark CLI's
    extras (the GPU check runs it this way)."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.graph_decode", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--size", default="small")
    ap.add_argument("--family", default="llava")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    for flags, kw in OPTIONS:
        ap.add_argument(*flags, **kw)
    args = ap.parse_args(argv)
    return run(args, checkpoint(args.size, args.family, args.model))


if __name__ == "__main__":
    sys.exit(main())
