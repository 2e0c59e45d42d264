"""GPU check of the quantized linears (:mod:`mmserve.model.quant`) on CUDA: the fp8 path
(``torch._scaled_mm`` on per-token e4m3 activations, compute capability >= 8.9) against
its torch twin :func:`~mmserve.model.quant.fp8_w8a8_ref`, and int8 (W8A8 through
``torch._int_mm`` on CUDA; its twin: tests/gpu/test_gpu_step_paths.py) against the
dequantized weight.

Skipped without CUDA (fp8 also below compute capability 8.9), unless
``MMSERVE_REQUIRE_GPU=1`` (scripts/gpu_check.sh), which turns the skip into a failure.
"""

from __future__ import annotations

import os

import pytest
import torch

from mmserve.model import quant

_CUDA = torch.cuda.is_available()
_REQUIRED = os.environ.get("MMSERVE_REQUIRE_GPU") == "1"
_FP8 = _CUDA and torch.cuda.get_device_capability() >= (8, 9)
needs_cuda = pytest.mark.skipif(not _CUDA and not _REQUIRED, reason="needs a CUDA GPU")
needs_fp8 = pytest.mark.skipif(
    not _FP8 and not _REQUIRED, reason="needs CUDA compute capability >= 8.9"
)
SHAPES = [(1, 896, 1152), (8, 896, 9728), (32, 4864, 896), (100, 4096, 4096)]


def _case(rows: int, inp: int, out: int, method: str) -> tuple:
    """``(x, q, s, y)``: random bf16 activations, a quantized weight and the layer's output."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(out, inp, device="cuda", generator=g) / inp**0.5
    q, s = quant.quantize_per_channel(w, method)
    x = torch.randn(rows, inp, device="cuda", generator=g).to(torch.bfloat16)
    return x, q, s, quant.QuantizedLinear(q, s, None)(x)


@needs_fp8
@pytest.mark.parametrize(("rows", "inp", "out"), SHAPES)
def test_fp8_scaled_mm_equals_its_torch_twin(rows: int, inp: int, out: int) -> None:
    x, q, s, y = _case(rows, inp, out, "fp8")
    want = quant.fp8_w8a8_ref(x, q, s)
    assert y.dtype == torch.bfloat16
    # the same e4m3 operands; fp32 accumulation in another order, one bf16 rounding
    scale = want.float().abs().max()
    assert (y.float() - want.float()).abs().max() <= 2**-7 * scale


@needs_cuda
@pytest.mark.parametrize(("rows", "inp", "out"), SHAPES)
def test_int8_on_cuda_equals_the_dequantized_weight(rows: int, inp: int, out: int) -> None:
    x, q, s, y = _case(rows, inp, out, "int8")
    ref = x.float() @ quant.dequantize(q, s).T
    # W8A8: per-token int8 activations add up to half a step (max|x_row| / 254) each
    assert (y.float() - ref).abs().max() <= 2**-5 * ref.abs().max()
