"""``quant-rows``: quantized matmuls on the CPU against the row count, to place the
thresholds in mmserve/model/quant.py and mmserve/model/int4.py.

For OneVision-0.5B's decoder matrices ``[N, K]`` and each row count ``M``, the median
milliseconds (interleaved rounds: every kernel once per round) of: the bf16 matmul; the
int8 weight-only kernel (``_weight_int8pack_mm``, whole and in chunks of 4 rows); the
int8 weight dequantized into a reusable bf16 buffer then the bf16 matmul (the "dequantize
once per step" option); int8 W8A8 (per-token int8 activations, ``torch._int_mm``, both
scales: :func:`mmserve.model.quant.int8_w8a8_ref`'s arithmetic) through ``torch._int_mm``
and, where :func:`mmserve.model.quant_onednn.available`, through oneDNN's prepacked
``qlinear_pointwise``; the int8 layer (:class:`mmserve.model.quant.QuantizedLinear`: the
weight-only kernel up to 4 rows, W8A8 above); and the int4 kernel
alone, the int4 weight dequantized into the reusable buffer then the bf16 matmul, and
the int4 layer (:class:`mmserve.model.int4.Int4Linear`, group 128: the kernel up to
:data:`~mmserve.model.int4.CPU_KERNEL_MAX_ROWS` rows, the buffer above), and
``torch.ops.quantized.int4mm_packed_weight_cpu`` (inductor's int4 op) on the same packed
weight where the build has it. Also each
kernel's time at ``M`` over its time at one row (what a batch of ``M`` decodes costs
against one).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks import report
from mmserve.model import int4, quant, quant_onednn

SHAPES = {  # name: (N, K) at OneVision-0.5B (Qwen2-0.5B decoder)
    "gate_up 9728x896": (9728, 896),
    "down 896x4864": (896, 4864),
    "qkv 1152x896": (1152, 896),
}


def _kernels(n: int, k: int) -> dict[str, Callable[[torch.Tensor], object]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    wb = w.bfloat16()
    q8, s8 = quant.quantize_per_channel(w, "int8")
    s8b = s8.bfloat16()
    buf = torch.empty(n, k, dtype=torch.bfloat16)
    i8 = quant.QuantizedLinear(q8, s8, None)
    i4 = int4.Int4Linear.from_int(*int4.quantize_int4(w, 128, False), 128).to(torch.bfloat16)

    def chunked(x: torch.Tensor) -> object:
        return torch.cat([torch.ops.aten._weight_int8pack_mm(c, q8, s8b) for c in x.split(4)])

    def dequant_buffer(x: torch.Tensor) -> object:
        torch.mul(q8, s8b[:, None], out=buf)
        return F.linear(x, buf)

    def w8a8(x: torch.Tensor) -> object:
        xq, xs = quant.quantize_per_token_int8(x)
        return (torch._int_mm(xq, q8.T).float() * xs * s8[None, :]).to(x.dtype)

    extra: dict[str, Callable[[torch.Tensor], object]] = {}
    if quant_onednn.available():  # oneDNN's prepacked u8 x s8 W8A8 (AVX-512 VNNI)
        packed = quant_onednn.prepack(q8)
        extra["int8 w8a8 onednn"] = lambda x: quant_onednn.w8a8(x, packed, s8)
    sz = i4.scales_zeros.to(torch.bfloat16)
    if hasattr(torch.ops.quantized, "int4mm_packed_weight_cpu"):  # inductor's int4 op
        g = torch.tensor(128)
        extra["int4 quantized op"] = lambda x: torch.ops.quantized.int4mm_packed_weight_cpu(
            x, i4.weight, g, sz
        )

    return {
        "bf16": lambda x: F.linear(x, wb),
        "int8pack": lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8b),
        "int8pack/4": chunked,
        "int8 buffer": dequant_buffer,
        "int8 w8a8": w8a8,
        "int8 layer": i8,
        "int4 kernel": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, i4.weight, 128, i4.scales_zeros
        ),
        "int4 buffer": lambda x: torch.mm(x, int4.dequant_buffer(i4, x.dtype)),
        "int4 layer": i4,
        **extra,
    }


def measure(rows: list[int], rounds: int) -> dict:
    """``{shape: {M: {kernel: median ms}}}``, rounds interleaved."""
    out: dict = {}
    for name, (n, k) in SHAPES.items():
        ks = _kernels(n, k)
        xs = {m: torch.randn(m, k).bfloat16() for m in rows}
        times: dict = {m: {kn: [] for kn in ks} for m in rows}
        with torch.inference_mode():
            for f in ks.values():  # warm-up
                f(xs[rows[0]])
            for _ in range(rounds):
                for m in rows:
                    for kn, f in ks.items():
                        t0 = time.perf_counter()
                        f(xs[m])
                        times[m][kn].append(time.perf_counter() - t0)
        out[name] = {
            m: {kn: statistics.median(v) * 1e3 for kn, v in d.items()} for m, d in times.items()
        }
    return out


def table(res: dict) -> str:
    """One row per shape and row count: ms of each kernel, and M-row / 1-row ratios."""
    rows = {}
    for name, by_m in res.items():
        first = min(by_m)
        for m, d in by_m.items():
            r = {kn: f"{v:.3f}" for kn, v in d.items()}
            r["int8 layer xM/x1"] = f"{d['int8 layer'] / by_m[first]['int8 layer']:.2f}"
            r["int4 layer xM/x1"] = f"{d['int4 layer'] / by_m[first]['int4 layer']:.2f}"
            rows[f"{name}, M={m}"] = r
    kernels = list(next(iter(next(iter(res.values())).values())))
    cols = "shape, rows|" + "|".join(f"{k} ms={k}" for k in kernels)
    cols += "|int8 layer M / 1 row=int8 layer xM/x1|int4 layer M / 1 row=int4 layer xM/x1"
    return report.table(rows, cols)


def quant_rows(args: argparse.Namespace, model_dir: str | None = None) -> int:
    """``python -m benchmarks quant-rows``."""
    rows = [int(r) for r in args.rows.split(",")]
    res = measure(rows, args.rounds)
    load = open("/proc/loadavg").read().split()[:3]
    out = {"threads": torch.get_num_threads(), "loadavg": load, "results": res}
    text = table(res) + f"\nthreads {torch.get_num_threads()}, load average {' '.join(load)}"
    return report.emit(args.out, "quant_rows", out, text)
