"""The quantized matmul's kernels with device-independent arithmetic (issue 48.3, 48.5):
fp16 activations whose unscaled product with raw int8/fp8 values overflows fp16, the
int8 W8A8 path (``torch._int_mm``) and its CPU twin, and the rules that pick a kernel
(the device check replaced by the CPU, so the CUDA choices run here).
"""

from __future__ import annotations

import pytest
import torch

from mmserve.model import quant


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_fp16_large_activations_stay_finite_and_match_fp32(method: str) -> None:
    """x in [300, 1000) times a 2048-wide weight of raw values up to 127 (448 for fp8):
    the unscaled product is ~1e8 (inf in fp16); the true result (weights ~0.01) is
    ~1e3, which fits."""
    g = _gen(0)
    inp, out = 2048, 96
    w = torch.randn(out, inp, generator=g) * 0.01
    q, s = quant.quantize_per_channel(w, method)
    sign = torch.randint(0, 2, (5, inp), generator=g) * 2 - 1
    x = ((torch.rand(5, inp, generator=g) * 700 + 300) * sign).half()
    raw = x.float() @ q.float().T
    assert raw.abs().max() > 65504  # the unscaled product does not fit fp16
    lin = quant.QuantizedLinear(q, s, None)
    y = lin(x)
    ref = x.float() @ quant.dequantize(q, s).T
    assert ref.abs().max() < 65504 / 4
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    scale = ref.abs().max()
    assert (y.float() - ref).abs().max() <= 2**-9 * scale  # fp16 rounding of w and y


def test_fp16_dequant_in_blocks_equals_one_block(monkeypatch) -> None:
    """The fp16 path's block size changes no value (blocks of 7 output channels)."""
    g = _gen(1)
    q, s = quant.quantize_per_channel(torch.randn(30, 64, generator=g), "int8")
    x = torch.randn(3, 64, generator=g).half()
    whole = quant._dequant_matmul(x, q, s)
    monkeypatch.setattr(quant, "DEQUANT_BLOCK_BYTES", 7 * 4 * 64)
    assert torch.equal(quant._dequant_matmul(x, q, s), whole)


def test_int8_w8a8_twin_equals_the_exact_integer_product() -> None:
    """``int8_w8a8_ref``: the integer product equals an int64 matmul exactly, and the
    result is within the per-token activation rounding of the fp32 reference."""
    g = _gen(2)
    w = torch.randn(40, 64, generator=g)
    q, s = quant.quantize_per_channel(w, "int8")
    x = torch.randn(20, 64, generator=g) * 5
    xq, xs = quant.quantize_per_token_int8(x)
    exact = xq.long() @ q.long().T
    assert torch.equal(torch._int_mm(xq, q.T).long(), exact)  # what CUDA runs
    y = quant.int8_w8a8_ref(x, q, s)
    assert torch.allclose(y, exact.float() * xs * s[None, :], rtol=1e-6, atol=0)
    deq = quant.dequantize(q, s)
    # each activation moves by at most half its row's step xs/2
    bound = (xs / 2) * deq.abs().sum(dim=1)[None, :] * (1 + 1e-5) + 1e-5
    assert ((y - x @ deq.T).abs() <= bound).all()


def _as_cuda(monkeypatch) -> None:
    monkeypatch.setattr(quant, "_on_cuda", lambda x: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_int8_on_cuda_runs_int_mm_not_a_dequantized_copy(monkeypatch, rows, dtype) -> None:
    """On "CUDA" an int8 linear runs ``torch._int_mm`` (rows padded past 16) and equals
    its twin; it never builds a floating copy of the weight."""
    _as_cuda(monkeypatch)
    calls: list[tuple[int, ...]] = []
    real = torch._int_mm

    def int_mm(a, b):
        calls.append(tuple(a.shape))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    monkeypatch.setattr(quant, "_dequant_matmul", lambda *a: pytest.fail("dequantized"))
    g = _gen(3)
    q, s = quant.quantize_per_channel(torch.randn(48, 64, generator=g), "int8")
    lin = quant.QuantizedLinear(q, s, None)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    assert quant.kernel_for(q, x) == "int_mm"
    y = lin(x)
    assert calls == [(max(rows, quant.INT_MM_MIN_ROWS), 64)]
    assert y.shape == (rows, 48) and y.dtype == dtype
    assert torch.equal(y, quant.int8_w8a8_ref(x, q, s))


def test_kernel_choice_rules(monkeypatch) -> None:
    """Shapes the fast paths refuse fall back to the dequantized matmul; the CPU keeps its
    own kernels; fp8 takes ``_scaled_mm`` for fp16 as well as bf16 activations."""
    qi, _ = quant.quantize_per_channel(torch.randn(48, 64), "int8")
    qf, _ = quant.quantize_per_channel(torch.randn(48, 64), "fp8")
    bf, half = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.half)
    assert quant.kernel_for(qi, bf) == "int8pack"  # the CPU
    assert quant.kernel_for(qi, torch.zeros(2, 64)) == "dequant"
    assert quant.kernel_for(qf, half) == "dequant"
    _as_cuda(monkeypatch)
    assert quant.kernel_for(qi, bf) == "int_mm"
    assert quant.kernel_for(qi[:, :60], bf[:, :60]) == "dequant"  # in % 8
    assert quant.kernel_for(qi[:44], bf) == "dequant"  # out % 8
    assert quant.kernel_for(qf, bf) == "scaled_mm"
    assert quant.kernel_for(qf, half) == "scaled_mm"
    assert quant.kernel_for(qf, torch.zeros(2, 64)) == "dequant"  # fp32
    assert quant.kernel_for(qf[:40], half) == "dequant"  # out % 16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert quant.kernel_for(qf, half) == "dequant"


def test_fp8_fp16_activations_call_scaled_mm_with_fp16_output(monkeypatch) -> None:
    """fp16 activations reach ``_scaled_mm`` (emulated by its CPU twin's arithmetic), with
    fp16 output; a build that refuses fp16 output gets bf16 rounded to fp16."""
    _as_cuda(monkeypatch)
    outs: list[torch.dtype] = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        outs.append(out_dtype)
        if out_dtype == torch.float16 and refuse:
            raise RuntimeError("only bf16 output with row-wise scales")
        return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    g = _gen(4)
    q, s = quant.quantize_per_channel(torch.randn(32, 64, generator=g), "fp8")
    x = torch.randn(4, 64, generator=g).half()
    lin = quant.QuantizedLinear(q, s, None)
    for refuse, want in ((False, [torch.float16]), (True, [torch.float16, torch.bfloat16])):
        monkeypatch.setattr(quant, "_FP8_FP16_OUT", None)
        outs.clear()
        y = lin(x)
        assert outs == want and y.dtype == torch.float16
        tol = 2**-7 if refuse else 2**-10
        ref = quant.fp8_w8a8_ref(x.float(), q, s)
        assert ((y.float() - ref).abs() <= tol * ref.abs() + 1e-3).all()
