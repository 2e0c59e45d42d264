"""GPU checks: FlashInfer against the torch backend, and the whole engine on CUDA.

Skipped (with the reason) when torch sees no CUDA device, and the FlashInfer
tests also when ``flashinfer`` cannot be imported -- unless ``MMSERVE_REQUIRE_GPU=1``
(set by ``scripts/gpu_check.sh``), which turns a missing GPU or package into a failure.

* kernels: random paged batches (page sizes 1 and 16; no prefix, a partial
  prefix, decode; GQA; bf16 and fp16) through both backends, against the torch
  backend in fp32 on the same (rounded) inputs;
* engine, bf16: per-step logits with FlashInfer vs with the torch backend, while
  both runs have produced the same tokens so far (the first step always);
* engine, fp32 with the torch backend: greedy output equal to transformers'
  ``LlavaForConditionalGeneration.generate`` on CUDA (the CPU comparator rule).
"""

from __future__ import annotations

import os

import pytest
import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.frontend.frontend import Engine
from mmserve.kernels.flashinfer_backend import FlashInferAttentionBackend
from mmserve.kernels.torch_backend import TorchAttentionBackend
from mmserve.types import SamplingParams
from tests.helpers import (
    BF16_LOGIT_RTOL,
    CUDA_AVAILABLE,
    FLASHINFER_PROBLEM,
    check_against_reference,
    cuda_engine,
    greedy,
    needs_cuda,
    needs_flashinfer,
    random_batch,
    user,
)


def test_gpu_environment_when_required() -> None:
    """With MMSERVE_REQUIRE_GPU=1 (scripts/gpu_check.sh), a missing GPU or flashinfer fails."""
    if os.environ.get("MMSERVE_REQUIRE_GPU") != "1":
        pytest.skip("MMSERVE_REQUIRE_GPU is not 1: GPU tests may skip")
    assert CUDA_AVAILABLE, "MMSERVE_REQUIRE_GPU=1 but torch.cuda.is_available() is False"
    assert FLASHINFER_PROBLEM is None, f"MMSERVE_REQUIRE_GPU=1 but {FLASHINFER_PROBLEM}"


# Output tolerance of one attention call against fp32 on the same rounded inputs:
# a few ulps of the output dtype (values are O(1)); an off-by-one key in sequences
# of <= 40 tokens moves outputs by ~1/40, well above these.
KERNEL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
MAX_NEW = 8


def _copy_pool(src: KVPool, dtype: torch.dtype) -> KVPool:
    k0 = src.k_buffers[0]
    dst = KVPool(
        src.num_pages, src.page_size, src.num_layers, k0.shape[2], k0.shape[3], dtype, k0.device
    )
    for d, s in zip(dst.k_buffers + dst.v_buffers, src.k_buffers + src.v_buffers, strict=True):
        d.copy_(s.to(dtype))
    return dst


# ---- kernels -----------------------------------------------------------------------------
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["prefill", "partial", "decode"])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (2, 1)], ids=["gqa4", "gqa2"])
def test_flashinfer_matches_torch_backend(dtype, page_size: int, mode: str, hq, hkv) -> None:
    pool, meta, q, k, v = random_batch(page_size, mode, hq, hkv, dtype, device="cuda", seed=7)
    pool_t = _copy_pool(pool, dtype)
    pool_ref = _copy_pool(pool, torch.float32)
    fi = FlashInferAttentionBackend(hq, hkv, 64, "cuda", dtype)
    tb, ref = TorchAttentionBackend(), TorchAttentionBackend()
    for b in (fi, tb, ref):
        b.plan(meta)
    tol = KERNEL_TOL[dtype]
    for layer in range(pool.num_layers):  # one plan per batch, reused by every layer
        want = ref.forward(q.float(), k.float(), v.float(), layer, pool_ref)
        got_fi = fi.forward(q, k, v, layer, pool)
        got_t = tb.forward(q, k, v, layer, pool_t)
        assert got_fi.dtype == dtype and got_fi.shape == q.shape
        torch.testing.assert_close(got_fi.float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(got_t.float(), want, atol=tol, rtol=tol)
        # both wrote the new tokens' K/V to the same slots
        assert torch.equal(pool.k_buffers[layer], pool_t.k_buffers[layer])
        assert torch.equal(pool.v_buffers[layer], pool_t.v_buffers[layer])


# ---- engine on CUDA ------------------------------------------------------------------------
def workload(engine: Engine, photos: dict[str, bytes]):
    """Two questions on one photo (the second hits the cache), another photo, text only."""
    cat = engine.processor.prepare_image(photos["cat.png"])
    cup = engine.processor.prepare_image(photos["coffee.png"])
    jobs = [
        (user(None, "What animal is this?"), [cat]),
        (user(None, "What colour is its fur? Answer in detail."), [cat]),
        (user("Look at this photo:", None, "What is in the cup?"), [cup]),
        ([{"role": "user", "content": "Name three colours of a sunset."}], []),
    ]
    reqs = [
        engine.processor.make_request(messages=m, images=i, params=greedy(MAX_NEW)) for m, i in jobs
    ]
    return engine.generate(reqs)


@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_flashinfer_matches_torch_bf16(model_dir, photos, page_size: int) -> None:
    runs = {}
    for name in ("flashinfer", "torch"):
        eng = cuda_engine(model_dir, dtype="bfloat16", attention_backend=name, page_size=page_size)
        assert eng.runner.backend.name == name
        assert eng.model.decoder.embed_tokens.weight.device.type == "cuda"
        assert eng.pool.k_buffers[0].dtype == torch.bfloat16
        runs[name] = workload(eng, photos)
    assert runs["flashinfer"][1].cached_tokens >= 576  # the image came from the cache
    compared = 0
    for fi, tb in zip(runs["flashinfer"], runs["torch"], strict=True):
        for step in range(min(len(fi.logits), len(tb.logits))):
            if fi.output_ids[:step] != tb.output_ids[:step]:
                break  # different inputs from here on: nothing left to compare
            a, b = fi.logits[step], tb.logits[step]
            assert a.dtype == torch.float32 and a.device.type == "cpu"
            fin = torch.isfinite(b)
            assert torch.equal(fin, torch.isfinite(a))
            diff = (a[fin] - b[fin]).abs().max().item()
            bound = BF16_LOGIT_RTOL * b[fin].abs().max().item()
            assert diff <= bound, f"{fi.rid} step {step}: logits differ by {diff} > {bound}"
            compared += 1
    assert compared >= len(runs["torch"])  # at least every first step


@needs_flashinfer
def test_auto_on_cuda_picks_flashinfer(model_dir) -> None:
    eng = cuda_engine(model_dir)  # dtype auto -> bf16, backend auto
    assert eng.model.decoder.embed_tokens.weight.dtype == torch.bfloat16
    assert eng.runner.backend.name == "flashinfer"


@needs_cuda
def test_auto_on_cuda_fp32_picks_torch(model_dir) -> None:
    assert cuda_engine(model_dir, dtype="float32").runner.backend.name == "torch"


@needs_cuda
def test_cuda_sampling_is_seeded(model_dir) -> None:
    eng = cuda_engine(model_dir, attention_backend="torch")
    p = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3)
    msgs = user("Tell me a story.")
    a, b = eng.generate([eng.processor.make_request(messages=msgs, params=p) for _ in range(2)])
    assert a.output_ids == b.output_ids and len(a.output_ids) == 6


@pytest.fixture(scope="module")
def ref_model_cuda(model_dir):
    """transformers' LLaVA in fp32 on CUDA, with TF32 off so fp32 means fp32."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    yield model.to("cuda").eval(), AutoProcessor.from_pretrained(model_dir)
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@needs_cuda
@pytest.mark.parametrize("case", ["text", "image", "two_images"])
def test_cuda_fp32_torch_backend_matches_transformers(
    model_dir, photos, ref_model_cuda, case
) -> None:
    eng = cuda_engine(model_dir, dtype="float32", attention_backend="torch")
    imgs = [eng.processor.prepare_image(photos[n]) for n in ("cat.png", "coffee.png")]
    msgs, images = {
        "text": ([{"role": "user", "content": "Name three colours of a sunset."}], []),
        "image": (user("Look at this photo:", None, "What animal is this?"), imgs[:1]),
        "two_images": (user(None, "and", None, "Which photo is brighter?"), imgs),
    }[case]
    check_against_reference(eng, ref_model_cuda, msgs, images, f"cuda fp32 {case}", MAX_NEW)
