"""GPU check of the fused ops: FlashInfer's kernels (what :mod:`mmserve.kernels.ops` runs
on CUDA fp16/bf16) against the torch versions (the specification, held equal to the
unfused arithmetic by tests/test_fused_ops.py) on the same CUDA inputs.

Skipped without CUDA or flashinfer, unless ``MMSERVE_REQUIRE_GPU=1`` (scripts/gpu_check.sh),
which turns the skip into a failure.

Tolerances: FlashInfer keeps intermediates in fp32 and rounds once; the torch versions
round where transformers does (the normed rows before the weight, cos/sin before the
products), so the two differ by a few ulps of the output dtype.
"""

from __future__ import annotations

import os

import pytest
import torch

from mmserve.kernels import ops
from mmserve.kernels.fused_rules import fused_add_rms_norm_fits, silu_and_mul_fits

_CUDA = torch.cuda.is_available()
_FI = _CUDA and ops._flashinfer() is not None
_REQUIRED = os.environ.get("MMSERVE_REQUIRE_GPU") == "1"
needs_flashinfer = pytest.mark.skipif(
    not _FI and not _REQUIRED, reason="needs a CUDA GPU and an importable flashinfer"
)
TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=4e-3, atol=4e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
SHAPES = [(1, 896), (8, 896), (37, 4096), (300, 64)]


def test_flashinfer_is_what_runs_on_cuda() -> None:
    if not _REQUIRED:
        pytest.skip("MMSERVE_REQUIRE_GPU is not 1: GPU tests may skip")
    assert _CUDA and _FI, "MMSERVE_REQUIRE_GPU=1 but CUDA or flashinfer is unavailable"
    assert ops._use_flashinfer(torch.ones(1, device="cuda", dtype=torch.bfloat16))


@needs_flashinfer
@DTYPES
@pytest.mark.parametrize(("t", "h"), SHAPES)
def test_rms_norm_and_fused_add(dtype, t, h) -> None:
    g = torch.Generator(device="cuda").manual_seed(t * h)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype) * 3
    res = torch.randn(t, h, device="cuda", generator=g).to(dtype) * 10
    w = (1 + torch.randn(h, device="cuda", generator=g) / 4).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6), **TOL[dtype])
    want_normed, want_res = ops.fused_add_rms_norm_ref(x, res, w, 1e-6)
    normed, new_res = ops.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    torch.testing.assert_close(new_res, want_res, **TOL[dtype])
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])


@needs_flashinfer
@DTYPES
@pytest.mark.parametrize(("hq", "hkv", "d"), [(14, 2, 64), (32, 32, 128), (8, 1, 128)])
def test_rope_in_place_from_the_cache(dtype, hq, hkv, d) -> None:
    t = 45
    g = torch.Generator(device="cuda").manual_seed(hq * d)
    cache = ops.cos_sin_cache(ops.rope_inv_freq(d, 1e6), 32768).cuda()
    positions = torch.randint(0, 32768, (t,), device="cuda", generator=g)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
    want = qkv.clone()
    wq, wk, _ = want.split((hq * d, hkv * d, hkv * d), dim=-1)
    ops.apply_rope_ref(positions, wq, wk, d, cache)
    q, k, _ = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)  # strided column slices
    ops.apply_rope(positions, q, k, d, cache)
    torch.testing.assert_close(qkv, want, **TOL[dtype])


@needs_flashinfer
@DTYPES
@pytest.mark.parametrize(("t", "i"), [(1, 4864), (8, 4864), (33, 11008)])
def test_silu_and_mul(dtype, t, i) -> None:
    g = torch.Generator(device="cuda").manual_seed(t * i)
    x = (torch.randn(t, 2 * i, device="cuda", generator=g) * 4).to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(x), ops.silu_and_mul_ref(x), **TOL[dtype])


# ---- inputs FlashInfer's kernels do not take: the torch versions must run ----------------
@needs_flashinfer
@pytest.mark.parametrize("i", [4861, 3, 1])
def test_silu_and_mul_row_off_the_16_byte_rule(i: int) -> None:
    """A gate-and-up row of ``2I`` bf16 values is ``4I`` bytes: FlashInfer's kernel raises
    for ``4I % 16 != 0``; ``ops.silu_and_mul`` must answer like the torch version."""
    x = (torch.randn(5, 2 * i, device="cuda") * 4).to(torch.bfloat16)
    assert not silu_and_mul_fits(x)
    torch.testing.assert_close(ops.silu_and_mul(x), ops.silu_and_mul_ref(x), **TOL[torch.bfloat16])


@needs_flashinfer
def test_fused_add_rms_norm_weight_in_another_dtype() -> None:
    """FlashInfer's ``fused_add_rmsnorm`` reads the weight as the input's dtype with no
    check: an fp32 weight beside bf16 rows must take the torch version."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(7, 896, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(7, 896, device="cuda", generator=g).to(torch.bfloat16)
    w = 1 + torch.randn(896, device="cuda", generator=g) / 4  # fp32
    assert not fused_add_rms_norm_fits(x, res, w)
    want_normed, want_res = ops.fused_add_rms_norm_ref(x, res, w, 1e-6)
    normed, new_res = ops.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    assert normed.dtype == want_normed.dtype
    torch.testing.assert_close(new_res, want_res, **TOL[torch.bfloat16])
    torch.testing.assert_close(normed, want_normed, **TOL[torch.bfloat16])
