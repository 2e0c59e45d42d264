"""Attention backend selection, its error messages, dtype/backend config, and the
FlashInfer backend's plumbing checked on CPU against a stand-in ``flashinfer`` module.

The stand-in's wrapper signatures copy FlashInfer's (``flashinfer/prefill.py`` and
``flashinfer/decode.py``: ``plan(...)`` positional order and keywords, ``run(q,
(k_cache, v_cache))``), and its attention follows FlashInfer's documented paged
layout and end-aligned causal mask, written independently of the torch backend.
The real kernels are compared in ``tests/gpu/test_flashinfer.py``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mmserve.cache.kv_pool import KVPool, quantize_kv
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.kernels import (
    BackendUnavailableError,
    make_attention_backend,
    resolve_attention_backend,
)
from mmserve.kernels.flashinfer_backend import FlashInferAttentionBackend
from mmserve.kernels.torch_backend import TorchAttentionBackend
from tests.helpers import BF16_LOGIT_RTOL, greedy, page_layout, random_batch, user


# ---- selection ------------------------------------------------------------------
def test_auto_on_cpu_is_torch() -> None:
    assert resolve_attention_backend("auto", "cpu", torch.float32) == "torch"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "torch"
    backend = make_attention_backend("auto", "cpu", 2, 1, 64, torch.float32)
    assert isinstance(backend, TorchAttentionBackend) and backend.name == "torch"


def test_torch_is_always_torch() -> None:
    assert resolve_attention_backend("torch", "cuda", torch.bfloat16) == "torch"


def test_flashinfer_on_cpu_says_cuda() -> None:
    with pytest.raises(BackendUnavailableError) as ei:
        make_attention_backend("flashinfer", "cpu", 2, 1, 64, torch.bfloat16)
    msg = str(ei.value)
    assert isinstance(ei.value, RuntimeError)
    assert "CUDA" in msg and "--device cuda" in msg and "--attention-backend torch" in msg


@pytest.fixture
def cuda_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend torch sees a GPU, so the checks after the CUDA one are reached."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_flashinfer_import_failure_says_pip_install(monkeypatch, cuda_visible) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(BackendUnavailableError) as ei:
        make_attention_backend("flashinfer", "cuda", 2, 1, 64, torch.bfloat16)
    msg = str(ei.value)
    assert not isinstance(ei.value, ImportError)
    assert "pip install" in msg and ".[gpu]" in msg and "--attention-backend torch" in msg
    assert "CUDA" not in msg.split("cannot be imported")[0]  # CUDA itself is fine here


def test_flashinfer_constructor_import_failure_is_clear(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(BackendUnavailableError, match="pip install"):
        FlashInferAttentionBackend(2, 1, 64, "cpu", torch.bfloat16)


def test_flashinfer_fp32_says_dtype(monkeypatch, cuda_visible) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    with pytest.raises(BackendUnavailableError, match="bfloat16"):
        resolve_attention_backend("flashinfer", "cuda", torch.float32)
    # auto does not fail: it picks the backend that supports fp32
    assert resolve_attention_backend("auto", "cuda", torch.float32) == "torch"


def test_auto_picks_flashinfer_only_when_everything_is_there(monkeypatch, cuda_visible) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16) == "torch"
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    assert resolve_attention_backend("auto", "cuda:0", torch.bfloat16) == "flashinfer"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "torch"


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(ValueError, match="auto, torch, flashinfer"):
        resolve_attention_backend("flash", "cpu")


# ---- config and CLI ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("dtype", "fp32", "float32, bfloat16"), ("attention_backend", "triton", "torch, flashinfer")],
)
def test_config_rejects_unknown_names(field: str, value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value}).validate()


@pytest.mark.parametrize(
    ("device", "dtype", "want"),
    [
        ("cuda", "auto", torch.bfloat16),
        ("cuda:1", "auto", torch.bfloat16),
        ("cuda", "float32", torch.float32),
        ("cpu", "bfloat16", torch.bfloat16),
        ("cuda", "float16", torch.float16),
    ],
)
def test_config_dtype_resolution(device: str, dtype: str, want: torch.dtype) -> None:
    cfg = EngineConfig(device=device, dtype=dtype)
    cfg.validate()
    assert cfg.torch_dtype() == want


def test_engine_rejects_flashinfer_on_cpu(model_dir) -> None:
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        Engine(EngineConfig(model_path=str(model_dir), attention_backend="flashinfer"))


# ---- dtype wiring on CPU --------------------------------------------------------------
def test_engine_loads_configured_dtype_and_stays_close_to_fp32(model_dir, photos) -> None:
    def run(dtype: str):
        eng = Engine(EngineConfig(model_path=str(model_dir), dtype=dtype, max_total_tokens=4096))
        img = eng.processor.prepare_image(photos["cat.png"])
        req = eng.processor.make_request(
            messages=user(None, "What is this?"), images=[img], params=greedy(4)
        )
        return eng, eng.generate([req])[0]

    e32, r32 = run("float32")
    e16, r16 = run("bfloat16")
    assert e16.model.decoder.embed_tokens.weight.dtype == torch.bfloat16
    assert e16.pool.k_buffers[0].dtype == torch.bfloat16
    assert e16.runner.backend.name == "torch"
    # RoPE frequencies stay fp32 whatever the weights' dtype (as in transformers)
    assert e16.model.decoder._inv_freq_fp32.dtype == torch.float32
    for step, (a, b) in enumerate(zip(r16.logits, r32.logits, strict=True)):
        assert a.dtype == torch.float32
        if r16.output_ids[:step] != r32.output_ids[:step]:
            break
        fin = torch.isfinite(b)
        diff = (a[fin] - b[fin]).abs().max().item()
        assert diff <= BF16_LOGIT_RTOL * b[fin].abs().max().item(), (step, diff)


# ---- FlashInfer backend plumbing with a stand-in module ------------------------------
def _paged_attention(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    last_len,
    causal,
    k_scale=None,
    v_scale=None,
):
    """Attention as FlashInfer documents it: NHD pages, end-aligned causal mask, fp32 math;
    fp8 pages are upcast and ``k_scale`` / ``v_scale`` (None: 1) multiply K and V."""
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    P = k_cache.shape[1]
    out = torch.empty_like(q)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for i in range(len(qo) - 1):
        pages = kv_indices[kvp[i] : kvp[i + 1]].long()
        kv_len = (len(pages) - 1) * P + int(last_len[i])
        k = k_cache.float()[pages].reshape(-1, *k_cache.shape[2:])[:kv_len] * k_scale
        v = v_cache.float()[pages].reshape(-1, *v_cache.shape[2:])[:kv_len] * v_scale
        qi = q[qo[i] : qo[i + 1]].float()
        group = qi.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) / qi.shape[-1] ** 0.5
        if causal:
            q_len = qi.shape[0]
            row = torch.arange(q_len)[:, None] + (kv_len - q_len)
            scores = scores.masked_fill(torch.arange(kv_len)[None, :] > row, float("-inf"))
        out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def _fake_flashinfer() -> types.ModuleType:
    """A ``flashinfer`` stand-in whose wrapper signatures match FlashInfer's."""
    calls: list[str] = []

    class _Wrapper:
        def _check_run(self, q, paged_kv_cache, k_scale):
            k_cache, v_cache = paged_kv_cache  # the (k, v) tuple form
            # scales are passed exactly when the pages are fp8
            assert (k_scale is not None) == (k_cache.dtype == torch.float8_e4m3fn)
            assert k_cache.dim() == 4 and k_cache.shape[1] == self.page_size  # NHD
            assert k_cache.shape[2:] == (self.num_kv_heads, self.head_dim)
            assert q.dtype == self.q_dtype and k_cache.dtype == self.kv_dtype
            assert q.shape[1:] == (self.num_qo_heads, self.head_dim) and q.is_contiguous()
            calls.append(f"run:{type(self).__name__}")
            return k_cache, v_cache

    class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
            assert float_workspace_buffer.dtype == torch.uint8 and kv_layout == "NHD"

        def plan(  # FlashInfer's signature, keyword names included
            self,
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            head_dim_vo=None,
            custom_mask=None,
            packed_custom_mask=None,
            causal=False,
            pos_encoding_mode="NONE",
            use_fp16_qk_reduction=False,
            sm_scale=None,
            window_left=-1,
            logits_soft_cap=None,
            rope_scale=None,
            rope_theta=None,
            q_data_type="float16",
            kv_data_type=None,
        ) -> None:
            for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
                assert t.dtype == torch.int32
            assert pos_encoding_mode == "NONE" and sm_scale is None
            self.arrays = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
            self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
            self.head_dim, self.page_size, self.causal = head_dim_qk, page_size, causal
            self.q_dtype, self.kv_dtype = q_data_type, kv_data_type or q_data_type
            calls.append("plan:prefill")

        def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None):
            k_cache, v_cache = self._check_run(q, paged_kv_cache, k_scale)
            return _paged_attention(
                q, k_cache, v_cache, *self.arrays, self.causal, k_scale, v_scale
            )

    class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
        def __init__(
            self,
            float_workspace_buffer,
            kv_layout="NHD",
            use_cuda_graph=False,
            use_tensor_cores=False,
        ):
            assert float_workspace_buffer.dtype == torch.uint8 and kv_layout == "NHD"

        def plan(
            self,
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            *,
            pos_encoding_mode="NONE",
            window_left=-1,
            logits_soft_cap=None,
            q_data_type="float16",
            kv_data_type=None,
            data_type=None,
            sm_scale=None,
        ) -> None:
            for t in (indptr, indices, last_page_len):
                assert t.dtype == torch.int32
            assert pos_encoding_mode == "NONE" and sm_scale is None
            batch = len(last_page_len)
            self.arrays = (
                torch.arange(batch + 1, dtype=torch.int32),
                indptr,
                indices,
                last_page_len,
            )
            self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
            self.head_dim, self.page_size = head_dim, page_size
            self.q_dtype, self.kv_dtype = q_data_type, kv_data_type or q_data_type
            calls.append("plan:decode")

        def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None):
            k_cache, v_cache = self._check_run(q, paged_kv_cache, k_scale)
            assert q.shape[0] == len(self.arrays[3])  # one query per request
            return _paged_attention(q, k_cache, v_cache, *self.arrays, False, k_scale, v_scale)

    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    mod.calls = calls
    return mod


def _fp8_copy(pool: KVPool, k_scales: list[float], v_scales: list[float]) -> KVPool:
    """An fp8 pool holding ``pool``'s pages quantized with the given per-layer scales."""
    out = KVPool(
        pool.num_pages, pool.page_size, pool.num_layers, *pool.k_buffers[0].shape[2:],
        dtype=torch.float8_e4m3fn, k_scales=k_scales, v_scales=v_scales,
    )  # fmt: skip
    for layer in range(pool.num_layers):
        out.k_buffers[layer].copy_(quantize_kv(pool.k_buffers[layer], k_scales[layer]))
        out.v_buffers[layer].copy_(quantize_kv(pool.v_buffers[layer], v_scales[layer]))
    return out


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("mode", ["prefill", "partial", "decode"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_flashinfer_backend_plumbing_matches_torch(
    monkeypatch, page_size: int, mode: str, kv
) -> None:
    fake = _fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    dtype = torch.bfloat16
    pool_fi, meta, q, k, v = random_batch(page_size, mode, 8, 2, dtype)
    if kv == "fp8":  # scales other than 1 so that a scale left out shows
        pool_fi = _fp8_copy(pool_fi, [0.5, 2.0], [2.0, 0.25])
    pool_ref = KVPool(
        pool_fi.num_pages, page_size, 2, 2, 64, dtype=pool_fi.dtype,
        k_scales=pool_fi.k_scales, v_scales=pool_fi.v_scales,
    )  # fmt: skip
    for dst, src in zip(
        pool_ref.k_buffers + pool_ref.v_buffers, pool_fi.k_buffers + pool_fi.v_buffers, strict=True
    ):
        dst.copy_(src)
    fi = FlashInferAttentionBackend(
        8, 2, 64, "cpu", dtype, workspace_bytes=1024, kv_dtype=pool_fi.dtype
    )
    ref = TorchAttentionBackend()
    fi.plan(meta)
    ref.plan(meta)
    for layer in range(2):  # one plan, reused by every layer
        out_fi = fi.forward(q, k, v, layer, pool_fi)
        out_ref = ref.forward(q, k, v, layer, pool_ref)
        assert out_fi.dtype == dtype and out_fi.shape == q.shape
        torch.testing.assert_close(out_fi.float(), out_ref.float(), atol=2e-2, rtol=2e-2)
        for a, b in (
            (pool_fi.k_buffers, pool_ref.k_buffers),
            (pool_fi.v_buffers, pool_ref.v_buffers),
        ):
            assert torch.equal(a[layer].view(torch.uint8), b[layer].view(torch.uint8))
    kind = "Decode" if mode == "decode" else "Prefill"
    run = f"run:Batch{kind}WithPagedKVCacheWrapper"
    assert fake.calls == [f"plan:{kind.lower()}", run, run]


def test_flashinfer_backend_rejects_fp32(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        FlashInferAttentionBackend(2, 1, 64, "cpu", torch.float32)


# ---- the torch backend's view path (CPU: runs of the pool read in place) ----------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_view_path_equals_the_literal_path_and_documented_attention(dtype, page_size) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from mmserve.kernels.metadata import build_metadata

    hq, hkv, d = 6, 2, 64

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data) -> None:
        tables, prefix, extend = page_layout(data, page_size)
        n_pages = max(max(t) for t in tables) + 1
        pool = KVPool(n_pages, page_size, 1, hkv, d, dtype=dtype)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        for buf in pool.k_buffers + pool.v_buffers:
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
        meta = build_metadata(tables, prefix, extend, page_size)
        t = sum(extend)
        q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
        fast = TorchAttentionBackend()
        fast.plan(meta)
        literal = TorchAttentionBackend(views=False)
        literal.plan(meta)
        if any(e <= 64 for e in extend):
            assert fast._view_reqs, "the view path was not taken"
        got = fast.forward(q, k, v, 0, pool)
        want = literal.forward(q, k, v, 0, pool)
        spec = _paged_attention(
            q, pool.k_buffers[0], pool.v_buffers[0], meta.qo_indptr, meta.kv_indptr,
            meta.kv_indices, meta.kv_last_page_len, causal=True,
        )  # fmt: skip
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.isfinite(got).all()
        assert (got.float() - spec.float()).abs().max().item() <= tol
        assert (got.float() - want.float()).abs().max().item() <= 2 * tol

    check()


def test_view_path_reads_long_runs_in_place_and_shares_them() -> None:
    """Two decode requests over one 100-token prefix: one kernel call reads the prefix
    as a view of the pool (no copy); only each request's own 5 scattered tokens are
    gathered."""
    from mmserve.kernels.metadata import build_metadata

    tables = [
        list(range(100)) + [150, 152, 154, 156, 158],
        list(range(100)) + [151, 153, 155, 157, 159],
    ]
    meta = build_metadata(tables, [104, 104], [1, 1], 1)
    backend = TorchAttentionBackend()
    backend.plan(meta)
    assert [(c.start, c.length, c.rows) for c in backend._chunks] == [(0, 100, [0, 1])]
    # the leftovers of both decode rows: one padded gather of 5 slots each
    assert backend._rest_rows == [0, 1]
    assert backend._rest_valid.sum(1).tolist() == [5, 5]
    assert backend._rest_index[0].tolist() == [150, 152, 154, 156, 158]
