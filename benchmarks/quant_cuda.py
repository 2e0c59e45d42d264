"""int8 / fp8 weight matmuls on CUDA against bf16, eager and inside a CUDA graph.

``python -m benchmarks.quant_cuda [--out FILE]`` (CUDA only): for each shape ``[M, K] x
[N, K]^T`` (decode and prefill rows at LLaVA-7B's MLP and OneVision-0.5B's MLP), the
median time of: bf16 ``F.linear``; mmserve's int8 layer (:class:`~mmserve.model.quant.
QuantizedLinear`: per-token int8 activations, ``torch._int_mm``, both scales); the int8
path that rebuilt a bf16 weight per call (what it did before issue 48); ``torch._int_mm``
alone on ready int8 operands; mmserve's fp8 layer; the bf16 and int8 layers replayed
from a CUDA graph, as decode runs them; and the int4 layer
(:class:`~mmserve.model.int4.Int4Linear`, group 128, ``torch._weight_int4pack_mm``),
eager and replayed, with its largest error relative to the dequantized matmul. Times in
microseconds (CUDA events, median of 50 after 5 warm-up calls). Writes a JSON list of
rows when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mmserve.model import int4, quant

SHAPES = [  # (M, K, N)
    (1, 4096, 14336),
    (16, 4096, 14336),
    (64, 4096, 14336),
    (256, 4096, 14336),
    (16, 896, 4864),
    (256, 896, 4864),
]


def _time_us(fn: Callable[[], object], reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def measure(m: int, k: int, n: int) -> dict:
    """One shape's row: microseconds per call of each path (see the module docstring)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    wb = w.to(torch.bfloat16)
    q8, s8 = quant.quantize_per_channel(w, "int8")
    lin8 = quant.QuantizedLinear(q8, s8, None)
    row: dict = {"M": m, "K": k, "N": n, "kernel_int8": quant.kernel_for(q8, x)}
    row["bf16_us"] = _time_us(lambda: F.linear(x, wb))
    row["int8_us"] = _time_us(lambda: lin8(x))
    row["int8_rebuild_us"] = _time_us(lambda: F.linear(x, q8.to(torch.bfloat16)) * s8)
    xq, _ = quant.quantize_per_token_int8(x)
    if m <= quant.INT_MM_MIN_ROWS:
        xq = F.pad(xq, (0, 0, 0, quant.INT_MM_MIN_ROWS + 1 - m))
    row["int_mm_only_us"] = _time_us(lambda: torch._int_mm(xq, q8.T))
    if torch.cuda.get_device_capability() >= (8, 9):
        q, s = quant.quantize_per_channel(w, "fp8")
        lin = quant.QuantizedLinear(q, s, None)
        row["kernel_fp8"] = quant.kernel_for(q, x)
        row["fp8_us"] = _time_us(lambda: lin(x))
    row["bf16_graph_us"] = _time_us(_graphed(lambda: F.linear(x, wb)))
    row["int8_graph_us"] = _time_us(_graphed(lambda: lin8(x)))
    try:  # int4 (tinygemm, group 128): eager and replayed
        q4 = int4.quantize_int4(w, 128, symmetric=False)
        lin4 = int4.Int4Linear.from_int(*q4, 128, None, "cuda").to(torch.bfloat16)
        row["int4_us"] = _time_us(lambda: lin4(x))
        row["int4_graph_us"] = _time_us(_graphed(lambda: lin4(x)))
        wd = int4.dequantize_int4(*q4, 128)
        err = (lin4(x).float() - x.float() @ wd.T).abs().max() / (x.float() @ wd.T).abs().max()
        row["int4_rel_err"] = float(err)
    except RuntimeError as e:  # a build without tinygemm: say so in the row
        row["int4_error"] = str(e).splitlines()[0][:200]
    return row


def main(argv: list[str] | None = None) -> int:
    """Print one line per shape; exit 2 without CUDA."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    rows = []
    for m, k, n in SHAPES:
        row = measure(m, k, n)
        rows.append(row)
        print(
            " ".join(
                f"{key}={v:.1f}" if isinstance(v, float) else f"{key}={v}" for key, v in row.items()
            ),
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
