"""GPU checks of the fp8 KV cache (``--kv-cache-dtype fp8_e4m3``): FlashInfer's fp8
decode and prefill kernels, and the torch backend on CUDA, against attention in fp32
over the same pages upcast and scaled; then both engines with fp8 KV on CUDA.

Skipped without CUDA or flashinfer unless ``MMSERVE_REQUIRE_GPU=1`` (scripts/gpu_check.sh):
then a missing GPU or flashinfer fails every test here (this file runs in its own phase,
without tests/gpu/test_flashinfer.py's environment check).
"""

from __future__ import annotations

import os

import pytest
import torch

from mmserve.cache.kv_pool import KVPool, dequantize_kv, quantize_kv
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.kernels.flashinfer_backend import (
    FlashInferAttentionBackend,
    flashinfer_import_problem,
)
from mmserve.kernels.torch_backend import TorchAttentionBackend
from tests.helpers import BF16_LOGIT_RTOL, greedy, random_batch, user

_CUDA = torch.cuda.is_available()
_FI_PROBLEM = flashinfer_import_problem() if _CUDA else "no CUDA GPU"
_REQUIRED = os.environ.get("MMSERVE_REQUIRE_GPU") == "1"
# MMSERVE_REQUIRE_GPU=1: no skip, so a GPU machine without flashinfer fails here
needs_cuda = pytest.mark.skipif(not _CUDA and not _REQUIRED, reason="needs a CUDA GPU")
needs_flashinfer = pytest.mark.skipif(
    _FI_PROBLEM is not None and not _REQUIRED, reason=f"flashinfer unavailable: {_FI_PROBLEM}"
)
FP8 = torch.float8_e4m3fn
# Output tolerance against fp32 on the same upcast pages: a few bf16/fp16 ulps of O(1)
# outputs, times the V scale (outputs scale with it).
KERNEL_TOL = {torch.bfloat16: 2e-2}
SCALES = ([0.5, 2.0], [2.0, 0.25])  # per layer (k, v): a scale left out shows


def test_gpu_environment_when_required() -> None:
    """With MMSERVE_REQUIRE_GPU=1 a missing GPU or flashinfer fails, naming which."""
    if not _REQUIRED:
        pytest.skip("MMSERVE_REQUIRE_GPU is not 1: GPU tests may skip")
    assert _CUDA, "MMSERVE_REQUIRE_GPU=1 but torch.cuda.is_available() is False"
    assert _FI_PROBLEM is None, f"MMSERVE_REQUIRE_GPU=1 but {_FI_PROBLEM}"


def _fp8_pools(pool: KVPool) -> tuple[KVPool, KVPool, KVPool]:
    """``pool``'s pages quantized (twice: one pool per backend) and the same pages upcast
    to fp32 with the scales applied (the reference)."""
    k0 = pool.k_buffers[0]
    dims = (pool.num_pages, pool.page_size, pool.num_layers, k0.shape[2], k0.shape[3])
    fp8 = [
        KVPool(*dims, dtype=FP8, device=k0.device, k_scales=SCALES[0], v_scales=SCALES[1])
        for _ in range(2)
    ]
    ref = KVPool(*dims, dtype=torch.float32, device=k0.device)
    for layer in range(pool.num_layers):
        ks, vs = SCALES[0][layer], SCALES[1][layer]
        kq, vq = quantize_kv(pool.k_buffers[layer], ks), quantize_kv(pool.v_buffers[layer], vs)
        for p in fp8:
            p.k_buffers[layer].copy_(kq)
            p.v_buffers[layer].copy_(vq)
        ref.k_buffers[layer].copy_(dequantize_kv(kq, ks, torch.float32))
        ref.v_buffers[layer].copy_(dequantize_kv(vq, vs, torch.float32))
    return fp8[0], fp8[1], ref


@needs_flashinfer
# bf16 queries only (what --dtype auto serves on CUDA): each query dtype costs FlashInfer
# one more JIT build of its fp8 prefill and decode modules
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["prefill", "partial", "decode"])
# 14/2 at head_dim 64 is OneVision-0.5B: 7 query heads per KV head, past FlashInfer's
# tensor-core decode threshold (5), the grouping its source warns about for fp8 KV
@pytest.mark.parametrize(
    ("hq", "hkv"), [(8, 2), (2, 1), (14, 2)], ids=["gqa4", "gqa2", "gqa7-onevision-0.5b"]
)
def test_flashinfer_fp8_matches_attention_over_upcast_pages(
    dtype, page_size, mode, hq, hkv
) -> None:
    pool, meta, q, k, v = random_batch(page_size, mode, hq, hkv, dtype, device="cuda", seed=11)
    pool_fi, pool_t, pool_ref = _fp8_pools(pool)
    fi = FlashInferAttentionBackend(hq, hkv, 64, "cuda", dtype, kv_dtype=FP8)
    assert fi._tensor_cores == (hq // hkv >= 5)
    tb, ref = TorchAttentionBackend(), TorchAttentionBackend()
    for b in (fi, tb, ref):
        b.plan(meta)
    for layer in range(pool.num_layers):
        ks, vs = SCALES[0][layer], SCALES[1][layer]
        k_up = dequantize_kv(quantize_kv(k, ks), ks, torch.float32)
        v_up = dequantize_kv(quantize_kv(v, vs), vs, torch.float32)
        want = ref.forward(q.float(), k_up, v_up, layer, pool_ref)
        got_fi = fi.forward(q, k, v, layer, pool_fi)
        got_t = tb.forward(q, k, v, layer, pool_t)
        tol = KERNEL_TOL[dtype] * max(1.0, vs)
        assert got_fi.dtype == dtype and got_fi.shape == q.shape
        torch.testing.assert_close(got_fi.float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(got_t.float(), want, atol=tol, rtol=tol)
        for a, b in ((pool_fi.k_buffers, pool_t.k_buffers), (pool_fi.v_buffers, pool_t.v_buffers)):
            assert torch.equal(a[layer].view(torch.uint8), b[layer].view(torch.uint8))


@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_fp8_kv_flashinfer_matches_torch(model_dir, photos, page_size: int) -> None:
    """Both backends over fp8 KV on CUDA: per-step logits close while the tokens agree, and
    the radix cache on equals off (same tokens) with FlashInfer."""
    runs = {}
    for name, cache_off in (("flashinfer", False), ("torch", False), ("flashinfer", True)):
        eng = Engine(
            EngineConfig(
                model_path=str(model_dir), device="cuda", dtype="bfloat16", page_size=page_size,
                attention_backend=name, kv_cache_dtype="fp8_e4m3", max_total_tokens=8192,
                disable_radix_cache=cache_off,
            )
        )  # fmt: skip
        assert eng.pool.k_buffers[0].dtype == FP8 and eng.runner.backend.name == name
        cat = eng.processor.prepare_image(photos["cat.png"])
        reqs = [
            eng.processor.make_request(messages=user(None, q), images=[cat], params=greedy(8))
            for q in ("What animal is this?", "What colour is its fur?")
        ]
        runs[(name, cache_off)] = [eng.generate([r])[0] for r in reqs]
    fi, tb = runs[("flashinfer", False)], runs[("torch", False)]
    assert fi[1].cached_tokens >= 576
    assert [r.output_ids for r in fi] == [r.output_ids for r in runs[("flashinfer", True)]]
    for a_res, b_res in zip(fi, tb, strict=True):
        for step in range(min(len(a_res.logits), len(b_res.logits))):
            if a_res.output_ids[:step] != b_res.output_ids[:step]:
                break
            a, b = a_res.logits[step], b_res.logits[step]
            fin = torch.isfinite(b)
            diff = (a[fin] - b[fin]).abs().max().item()
            assert diff <= BF16_LOGIT_RTOL * b[fin].abs().max().item(), (step, diff)


@needs_cuda
def test_fp8_pool_on_cuda_writes_and_reads_pages() -> None:
    pool = KVPool(8, 4, 2, 2, 16, dtype=FP8, device="cuda", k_scales=[0.5, 1.0])
    loc = torch.arange(4, 12, device="cuda")
    k = torch.randn(8, 2, 16, device="cuda")
    pool.write_kv(0, loc, k, k)
    got = dequantize_kv(pool.flat_kv(0)[0][loc], 0.5, torch.float32)
    torch.testing.assert_close(got, k, atol=2**-10, rtol=2**-4)
    pages = pool.read_pages([1, 2])
    pool.write_pages([5, 6], pages)
    assert torch.equal(pool.read_pages([5, 6]).view(torch.uint8), pages.view(torch.uint8))
