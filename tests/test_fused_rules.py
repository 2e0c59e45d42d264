"""The input rules of FlashInfer's fused kernels (issue 48), as
:mod:`mmserve.kernels.fused_rules` states them; device-independent, so checked here on
CPU tensors (``tests/gpu/test_fused_ops_gpu.py`` checks that the ops obey them on CUDA)."""

from __future__ import annotations

import pytest
import torch

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
