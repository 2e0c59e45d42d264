"""GPU checks of issue 48.3, 48.5 and 48.6 on CUDA: int8 W8A8 through ``torch._int_mm``
against its torch twin, fp8 ``_scaled_mm`` with fp16 activations, fp16 activations past
fp16's range through the dequantized matmul, and the one-copy step metadata on the
device equal to the CPU build. Their CPU twins: tests/test_quant_kernels.py,
tests/test_step_copies.py.

Needs only torch (no FlashInfer, no conftest fixtures). Skipped without CUDA unless
``MMSERVE_REQUIRE_GPU=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import os

import pytest
import torch

from mmserve.kernels.metadata import build_metadata
from mmserve.model import quant

_CUDA = torch.cuda.is_available()
_REQUIRED = os.environ.get("MMSERVE_REQUIRE_GPU") == "1"
_FP8 = _CUDA and torch.cuda.get_device_capability() >= (8, 9)
needs_cuda = pytest.mark.skipif(not _CUDA and not _REQUIRED, reason="needs a CUDA GPU")
needs_fp8 = pytest.mark.skipif(not _FP8 and not _REQUIRED, reason="needs compute capability 8.9")


def _layer(rows: int, inp: int, out: int, method: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(out, inp, device="cuda", generator=g) / inp**0.5
    q, s = quant.quantize_per_channel(w, method)
    x = torch.randn(rows, inp, device="cuda", generator=g).to(dtype)
    return x, q, s, quant.QuantizedLinear(q, s, None)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("rows", "inp", "out"), [(1, 896, 1152), (17, 896, 9728), (64, 4864, 896)])
def test_int8_int_mm_equals_its_twin(rows: int, inp: int, out: int, dtype) -> None:
    x, q, s, lin = _layer(rows, inp, out, "int8", dtype)
    assert quant.kernel_for(q, x) == "int_mm"
    y = lin(x)
    want = quant.int8_w8a8_ref(x, q, s)  # same integers: only the final rounding differs
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert (y.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    ref = x.float() @ quant.dequantize(q, s).T
    assert (y.float() - ref).abs().max() <= 2**-5 * ref.abs().max()


@needs_fp8
@pytest.mark.parametrize(("rows", "inp", "out"), [(1, 896, 1152), (32, 4864, 896)])
def test_fp8_scaled_mm_takes_fp16_activations(rows: int, inp: int, out: int) -> None:
    x, q, s, lin = _layer(rows, inp, out, "fp8", torch.float16)
    assert quant.kernel_for(q, x) == "scaled_mm"
    y = lin(x)
    print(f"_scaled_mm fp16 output: {quant._FP8_FP16_OUT}")
    want = quant.fp8_w8a8_ref(x.float(), q, s)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    assert (y.float() - want).abs().max() <= 2**-7 * want.abs().max()


@needs_cuda
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_fp16_large_activations_stay_finite(method: str) -> None:
    """Activations of 300-1000 on every path fp16 takes on CUDA (the fast path, and the
    dequantized matmul for a shape it refuses: 2044 input features)."""
    for inp in (2048, 2044):
        x, q, s, lin = _layer(5, inp, 96, method, torch.float16)
        x = (x.sign() * (x.abs() * 100 + 300)).clamp(-1000, 1000)
        y = lin(x)
        ref = x.float() @ quant.dequantize(q, s).T
        assert torch.isfinite(y).all(), (method, inp, quant.kernel_for(q, x))
        assert (y.float() - ref).abs().max() <= 2**-4 * ref.abs().max()


@needs_cuda
def test_step_metadata_on_the_device_equals_the_cpu_build() -> None:
    tables = [list(range(10 * i, 10 * i + 8)) for i in range(16)]
    prefix = [i % 5 * 3 for i in range(16)]
    extend = [1, 9] * 8
    ids = [-(2**62), *range(sum(extend) - 1)]  # a 64-bit image pseudo-token id
    cpu = build_metadata(tables, prefix, extend, 4, "cpu", ids)
    dev = build_metadata(tables, prefix, extend, 4, "cuda", ids)
    assert dev.host_pages is not None and dev.host_pages[0].is_pinned()
    for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "out_cache_loc",
              "positions", "logit_rows", "input_ids"):  # fmt: skip
        a, b = getattr(cpu, f), getattr(dev, f)
        assert b.is_cuda and b.dtype == a.dtype and torch.equal(b.cpu(), a), f
