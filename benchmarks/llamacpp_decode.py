"""``llamacpp-decode``: batch-1 decode tokens/s of mmserve's int4 / int8 against llama.cpp's
Q4_0 / Q8_0 on the same weights, side by side (issue 49; what it measures and why:
``benchmarks/README.md``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import report, workloads
from benchmarks.in_process import MMServeRunner
from benchmarks.llamacpp import DEFAULT_DIR
from benchmarks.real_shapes import decode_weight_bytes, read_bandwidth
from benchmarks.workloads import Prompt, Workload

med = statistics.median

SPLIT_COLS = (
    "step_cpu_ms",
    "step_cpu_ms_without_matmuls",
    "matmul_cpu_ms",
    "matmul_gb_per_cpu_s",
    "bound_cpu_ms",
)
#: mmserve quantization -> the llama.cpp type at the same bit width.
PAIRS = {"int4": "Q4_0", "int8": "Q8_0", "none": "f16"}

OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--llamacpp-dir",), dict(type=Path, help="setup folder (default .llamacpp)")),
    (("--pairs",), dict(default="int4,int8", help=f"mmserve methods of {','.join(PAIRS)}")),
    (("--rounds",), dict(type=int, default=5, help="interleaved rounds")),
    (("--tokens",), dict(type=int, default=32, help="decode steps per measurement")),
    (("--split",), dict(action=argparse.BooleanOptionalAction, default=True,
                        help="mmserve's step with and without its quantized matmuls")),
    (("--bandwidth-gb",), dict(type=float, default=1.0, help="--split: tensor read (GiB)")),
]  # fmt: skip


def ggufs(d: Path) -> tuple[Path, dict[str, Path]]:
    """``llama-bench`` and the OneVision language model's GGUFs by type (``Q4_0``, ...) that
    ``scripts/setup_llamacpp.sh`` left in ``d`` (its ``setup.json``).

    Raises:
        FileNotFoundError: no setup, no ``llama-bench`` or no OneVision GGUF there.
    """
    info_path = d / "setup.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"no llama.cpp setup in {d} (run scripts/setup_llamacpp.sh)")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    bench = d / info.get("bench", "build/bin/llama-bench")
    models = {q: d / p for q, p in info.get("onevision_gguf", {}).items() if (d / p).is_file()}
    if not bench.is_file() or not models:
        raise FileNotFoundError(f"{d}: llama-bench or the OneVision GGUFs missing (rerun setup)")
    return bench, models


def llama_bench(bench: Path, model: Path, threads: int, tokens: int, depth: int) -> dict:
    """One ``llama-bench`` decode test: ``tokens`` generated one at a time after ``depth``
    tokens in the KV cache (``-p 0 -n tokens -d depth -r 1``), ``threads`` threads, its
    warm-up run first (untimed). Returns ``tokens_per_s`` (llama-bench's own figure, wall),
    and ``wall_s`` and ``cpu_s`` (user + system, all its threads) of the whole process
    (load, warm-up and depth prefill included).

    Raises:
        RuntimeError: llama-bench failed or printed no decode result.
    """
    cmd = [str(bench), "-m", str(model), "-p", "0", "-n", str(tokens), "-d", str(depth)]
    cmd += ["-t", str(threads), "-r", "1", "-o", "json"]
    t0, c0 = time.perf_counter(), _children_cpu()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if out.returncode:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    rows = [r for r in json.loads(out.stdout) if r.get("n_gen")]
    if not rows:
        raise RuntimeError(f"llama-bench printed no decode test: {out.stdout[-2000:]}")
    return {"tokens_per_s": float(rows[0]["avg_ts"]), "wall_s": wall, "cpu_s": cpu, "row": rows[0]}


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def llama_cpu_rate(bench: Path, model: Path, threads: int, tokens: int, depth: int) -> dict:
    """:func:`llama_bench` of ``tokens`` and of 1 token (the same load, warm-up and
    prefill): its result, plus ``tokens_per_cpu_s`` = ``(tokens - 1)`` over the CPU seconds
    between the two (llama-bench reports wall time only; on a shared machine a process's
    wall time is mostly other jobs')."""
    long = llama_bench(bench, model, threads, tokens, depth)
    short = llama_bench(bench, model, threads, 1, depth)
    extra = long["cpu_s"] - short["cpu_s"]
    return {**long, "tokens_per_cpu_s": (tokens - 1) / extra if extra > 0 else float("nan")}


def mm_decode(runner: MMServeRunner, tokens: int, tag: str) -> tuple[float, float, int]:
    """mmserve batch-1 decode of a text-only question (no image, as llama-bench has none):
    ``(tokens/s per wall second, per CPU second, prompt tokens)`` from the median step
    over ``tokens`` decode steps (the first token, from prefill, not counted)."""
    msgs = [{"role": "user", "content": f"{workloads.QUESTIONS[0]} ({tag})"}]
    wl = Workload("decode", "", {}, [[Prompt(msgs, [])]], tokens + 1)
    eng = runner.engine()
    prompt_tokens = len(runner.requests(eng, wl)[0].input_ids)
    r = runner.run(wl, "decode", check_leaks=False)
    wall, cpu = zip(*r.decode_times, strict=True)
    return 1.0 / med(wall), 1.0 / max(med(cpu), 1e-9), prompt_tokens


@contextlib.contextmanager
def zero_matmuls() -> Iterator[None]:
    """Within: every int4 and int8 linear returns zeros of its output's shape instead of
    computing (bias still added), so a step's time is all but its quantized matmuls."""
    from mmserve.model.int4 import Int4Linear
    from mmserve.model.quant import QuantizedLinear

    def zeros(self: Any, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)

    saved = {c: c.matmul for c in (Int4Linear, QuantizedLinear)}
    try:
        for c in saved:
            c.matmul = zeros  # type: ignore[method-assign]
        yield
    finally:
        for c, f in saved.items():
            c.matmul = f  # type: ignore[method-assign]


def step_split(runner: MMServeRunner, tokens: int, bandwidth_cpu: float) -> dict:
    """mmserve's batch-1 decode step in CPU ms, whole and with :func:`zero_matmuls`; their
    difference is the quantized matmuls' time, against the decoder's weight bytes (the
    effective read rate) and the bound (bytes over ``bandwidth_cpu``, bytes per CPU s)."""
    whole = 1e3 / mm_decode(runner, tokens, "split")[1]
    with zero_matmuls():
        rest = 1e3 / mm_decode(runner, tokens, "split, no matmuls")[1]
    nbytes = decode_weight_bytes(runner.model.decoder)
    mm_ms = whole - rest
    return {
        "step_cpu_ms": whole,
        "step_cpu_ms_without_matmuls": rest,
        "matmul_cpu_ms": mm_ms,
        "weight_bytes": nbytes,
        "matmul_gb_per_cpu_s": nbytes / max(mm_ms, 1e-9) / 1e6,
        "bound_cpu_ms": nbytes / bandwidth_cpu * 1e3,
    }


def llamacpp_decode(args: argparse.Namespace, model_dir: str) -> int:
    """``--rounds`` interleaved rounds (the order of the two systems alternating per round)
    of batch-1 decode, per ``--pairs`` method: mmserve ``--quantization M`` in process and
    ``llama-bench`` on the same weights at the same bit width (:data:`PAIRS`), both with
    ``--threads`` threads and the same number of tokens already in the cache; medians of
    tokens/s and their ratio. Writes ``llamacpp_decode.json``; returns 0 (1 without a
    setup)."""
    try:
        bench, models = ggufs(Path(args.llamacpp_dir or DEFAULT_DIR))
    except FileNotFoundError as e:
        print(f"llamacpp-decode: {e}")
        return 1
    threads = args.threads or 1
    pairs = [m for m in args.pairs.split(",") if m]
    runners = {m: MMServeRunner.load(model_dir, dtype="bfloat16", quantization=m) for m in pairs}
    res: dict[str, dict[str, list]] = {m: {"mm": [], "mm_cpu": [], "ll": []} for m in pairs}
    load = [os.getloadavg()[0]]
    depth = 0
    for rnd in range(args.rounds):
        for m in pairs:
            gguf = models[PAIRS[m]]
            sides = ("mm", "ll") if rnd % 2 == 0 else ("ll", "mm")
            for side in sides:
                if side == "mm":
                    tps, tps_cpu, depth = mm_decode(runners[m], args.tokens, f"{m} {rnd}")
                    res[m]["mm"].append(tps)
                    res[m]["mm_cpu"].append(tps_cpu)
                else:  # the same number of tokens already in the cache as mmserve's prompt
                    res[m]["ll"].append(
                        llama_cpu_rate(bench, gguf, threads, args.tokens, max(depth, 1))
                    )
        load.append(os.getloadavg()[0])
        print(f"round {rnd}: {json.dumps(res)[:400]}", flush=True)
    out: dict[str, Any] = {"threads": threads, "tokens": args.tokens, "rounds": args.rounds}
    out.update(depth=depth, loadavg=load, models={m: str(models[PAIRS[m]]) for m in pairs})
    rows = []
    for m in pairs:
        mm, ll = med(res[m]["mm"]), med(r["tokens_per_s"] for r in res[m]["ll"])
        mm_cpu = med(res[m]["mm_cpu"])
        ll_cpu = med(r["tokens_per_cpu_s"] for r in res[m]["ll"])
        out[m] = {
            "mmserve_tokens_per_s": mm,
            "mmserve_tokens_per_cpu_s": mm_cpu,
            "llamacpp_type": PAIRS[m],
            "llamacpp_tokens_per_s": ll,
            "llamacpp_tokens_per_cpu_s": ll_cpu,
            "ratio": mm / ll,
            "ratio_cpu": mm_cpu / ll_cpu,
            "mmserve_rounds": res[m]["mm"],
            "llamacpp_rounds": [r["tokens_per_s"] for r in res[m]["ll"]],
            "llamacpp_cpu_rounds": [r["tokens_per_cpu_s"] for r in res[m]["ll"]],
        }
        vals = (mm, ll, mm / ll, mm_cpu, ll_cpu, mm_cpu / ll_cpu)
        rows.append([f"mmserve {m} / llama.cpp {PAIRS[m]}", *(f"{v:.3g}" for v in vals)])
    head = ["batch-1 decode", "mmserve tokens/s", "llama.cpp tokens/s", "mmserve / llama.cpp"]
    head += ["mmserve tokens/CPU s", "llama.cpp tokens/CPU s", "mmserve / llama.cpp (CPU)"]
    out["table"] = report.md_table(head, rows)
    if args.split:
        bw_cpu = read_bandwidth(int(args.bandwidth_gb * (1 << 30)))[1]
        out["read_gb_per_cpu_s"] = bw_cpu / 1e9
        srows = []
        for m in pairs:
            sp = out[m]["split"] = step_split(runners[m], args.tokens, bw_cpu)
            srows.append([m] + [f"{sp[k]:.3g}" for k in SPLIT_COLS])
        head = ["mmserve, CPU ms", "step", "step without matmuls", "matmuls", "GB/s in matmuls"]
        out["table"] += "\n\n" + report.md_table([*head, "bound"], srows)
    md = f"{out['table']}\n\n{threads} thread(s), {args.tokens} tokens after {depth} in the "
    md += f"cache, {args.rounds} interleaved rounds, medians; load average {report.loadavg()}"
    return report.emit(Path(args.out), "llamacpp_decode", out, md)
