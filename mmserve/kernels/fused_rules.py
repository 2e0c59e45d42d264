"""What FlashInfer's fused norm and activation kernels accept, as predicates.

The kernels do not all check their inputs: ``fused_add_rmsnorm`` (``csrc/norm.cu``,
FlashInfer 0.6.18.post1) reads the weight as the input's dtype whatever its dtype, so
an fp32 weight beside bf16 activations gives wrong numbers with no error; and
``silu_and_mul`` raises ``ValueError`` ("The pointers must be multiple of 16 bytes")
for a row whose bytes are not a multiple of 16. :mod:`mmserve.kernels.ops` runs the
torch version when a predicate here is False (tests/test_fused_rules.py with a stand-in
FlashInfer; ``tests/gpu/test_fused_ops_gpu.py`` on a GPU).
"""

from __future__ import annotations

import torch

#: FlashInfer's activation kernels load rows in 16-byte vectors.
ROW_ALIGN_BYTES = 16


def silu_and_mul_fits(x: torch.Tensor) -> bool:
    """True when FlashInfer's ``silu_and_mul`` takes ``x`` ``[..., 2I]``: contiguous, and
    its last dimension (the whole gate-and-up row) a multiple of 16 bytes
    (``2I * itemsize % 16 == 0``: ``2I`` a multiple of 8 in fp16/bf16)."""
    return x.is_contiguous() and (x.shape[-1] * x.element_size()) % ROW_ALIGN_BYTES == 0


def fused_add_rms_norm_fits(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when FlashInfer's ``fused_add_rmsnorm`` computes the right thing for ``x`` and
    ``residual`` ``[T, H]`` and ``weight`` ``[H]``: all three in one dtype (the kernel
    reads the weight as ``x``'s dtype) and ``x`` and ``residual`` contiguous (it writes
    both in place)."""
    return (
        weight.dtype == x.dtype == residual.dtype
        and x.is_contiguous()
        and residual.is_contiguous()
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
    )
