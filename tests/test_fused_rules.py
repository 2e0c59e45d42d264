"""The input rules of FlashInfer's fused kernels (issue 48), as
:mod:`mmserve.kernels.fused_rules` states them; device-independent, so checked here on
CPU tensors (``tests/gpu/test_fused_ops_gpu.py`` checks that the ops obey them on CUDA)."""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels import ops
from mmserve.kernels.fused_rules import fused_add_rms_norm_fits, silu_and_mul_fits


@pytest.mark.parametrize(
    ("width", "dtype", "fits"),
    [
        (2 * 4864, torch.bfloat16, True),  # Qwen2-0.5B's intermediate 4864: 19456 bytes
        (2 * 11008, torch.float16, True),
        (8, torch.bfloat16, True),  # 16 bytes exactly
        (2 * 4861, torch.bfloat16, False),  # 19444 bytes = 16 * 1215 + 4
        (6, torch.bfloat16, False),  # 12 bytes
        (2 * 3, torch.float32, False),  # 24 bytes
        (2 * 2, torch.float32, True),  # 16 bytes
    ],
)
def test_silu_and_mul_rows_are_whole_16_byte_vectors(width: int, dtype, fits: bool) -> None:
    x = torch.zeros(3, width, dtype=dtype)
    assert silu_and_mul_fits(x) is fits
    assert (width * x.element_size() % 16 == 0) is fits


def test_silu_and_mul_needs_contiguous_rows() -> None:
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    assert silu_and_mul_fits(x)
    assert not silu_and_mul_fits(torch.zeros(32, 3, dtype=torch.bfloat16).t())


def test_fused_add_rms_norm_weight_must_be_the_input_dtype() -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    res = torch.zeros_like(x)
    assert fused_add_rms_norm_fits(x, res, torch.ones(64, dtype=torch.bfloat16))
    for dtype in (torch.float32, torch.float16):
        assert not fused_add_rms_norm_fits(x, res, torch.ones(64, dtype=dtype))
    assert not fused_add_rms_norm_fits(x, res.float(), torch.ones(64, dtype=torch.bfloat16))
    assert not fused_add_rms_norm_fits(x, res, torch.ones(32, dtype=torch.bfloat16))
    strided = torch.zeros(4, 128, dtype=torch.bfloat16)[:, :64]
    assert not fused_add_rms_norm_fits(strided, res, torch.ones(64, dtype=torch.bfloat16))


class _FakeFlashInfer:
    """Stands in for ``flashinfer`` with its input rules: ``silu_and_mul`` raises as the
    real one does for rows off 16 bytes; ``fused_add_rmsnorm`` records its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.activation = self.norm = self

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] * x.element_size() % 16:
            raise ValueError("The pointers must be multiple of 16 bytes.")
        self.calls.append("silu_and_mul")
        return ops.silu_and_mul_ref(x)

    def fused_add_rmsnorm(self, x, residual, weight, eps) -> None:
        self.calls.append("fused_add_rmsnorm")
        residual += x
        x.copy_(ops.rms_norm_ref(residual, weight.to(x.dtype), eps))


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> _FakeFlashInfer:
    fake = _FakeFlashInfer()
    monkeypatch.setattr(ops, "_use_flashinfer", lambda x: True)  # as on CUDA bf16
    monkeypatch.setattr(ops, "_flashinfer", lambda: fake)
    return fake


def test_ops_route_inputs_off_the_rules_to_torch(fake_flashinfer: _FakeFlashInfer) -> None:
    """The ops call FlashInfer only for inputs its kernels take; others get the torch
    versions (not a ValueError, not numbers from a misread weight)."""
    g = torch.Generator().manual_seed(0)
    ok = torch.randn(3, 2 * 64, generator=g).to(torch.bfloat16)
    off = torch.randn(3, 2 * 3, generator=g).to(torch.bfloat16)  # 12-byte rows
    torch.testing.assert_close(ops.silu_and_mul(off), ops.silu_and_mul_ref(off))
    assert fake_flashinfer.calls == []
    ops.silu_and_mul(ok)
    assert fake_flashinfer.calls == ["silu_and_mul"]
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    res = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    w32 = 1 + torch.randn(64, generator=g) / 4
    want = ops.fused_add_rms_norm_ref(x, res, w32, 1e-6)
    got = ops.fused_add_rms_norm(x.clone(), res.clone(), w32, 1e-6)
    assert fake_flashinfer.calls == ["silu_and_mul"]  # fp32 weight: not FlashInfer
    assert got[0].dtype == want[0].dtype == torch.float32
    torch.testing.assert_close(got, want)
    ops.fused_add_rms_norm(x.clone(), res.clone(), w32.to(torch.bfloat16), 1e-6)
    assert fake_flashinfer.calls == ["silu_and_mul", "fused_add_rmsnorm"]
