"""GPU check of the int4 linear (:class:`~mmserve.model.int4.Int4Linear`) on CUDA: torch's
tinygemm kernel (``_weight_int4pack_mm``) against the reference dequantization, the
weight read back through the kernel, and a CUDA-graph replay equal to eager. Its CPU twin
(``_weight_int4pack_mm_for_cpu``, the same ``(q - 8) * scale + offset`` arithmetic) is
tests/test_int4.py's.

Skipped without CUDA, unless ``MMSERVE_REQUIRE_GPU=1`` (scripts/gpu_check.sh), which turns
the skip into a failure. Tolerance: bf16 activations, scales and output, as on the CPU:
``2**-6`` of the output's scale.
"""

from __future__ import annotations

import os

import pytest
import torch

from mmserve.model import int4

_CUDA = torch.cuda.is_available()
_REQUIRED = os.environ.get("MMSERVE_REQUIRE_GPU") == "1"
needs_cuda = pytest.mark.skipif(not _CUDA and not _REQUIRED, reason="needs a CUDA GPU")
SHAPES = [(1, 896, 1152, 128), (8, 896, 9728, 128), (32, 4864, 896, 64), (100, 4096, 4096, 32)]


@needs_cuda
@pytest.mark.parametrize(("rows", "inp", "out", "group"), SHAPES)
def test_int4_on_cuda_equals_the_dequantized_weight(rows, inp, out, group) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(out, inp, device="cuda", generator=g) / inp**0.5
    q, s, z = int4.quantize_int4(w, group, symmetric=False)
    lin = int4.Int4Linear.from_int(q, s, z, group, None, "cuda").to(dtype=torch.bfloat16)
    assert lin.layout == "cuda"
    x = torch.randn(rows, inp, device="cuda", generator=g).to(torch.bfloat16)
    wd = int4.dequantize_int4(q, s, z, group)
    want = x.float() @ wd.T
    y = lin(x)
    assert y.dtype == torch.bfloat16
    scale = float((x.float().abs() @ wd.abs().T).max())
    assert float((y.float() - want).abs().max()) <= 2**-6 * scale
    # read back through the kernel (a row of the identity per input feature)
    assert float((lin.dequantized() - wd).abs().max()) <= 2**-7 * float(wd.abs().max())
    # replayed from a CUDA graph: the same numbers
    static_x = x.clone()
    lin(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = lin(static_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, y)
