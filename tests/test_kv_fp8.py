"""fp8 KV cache (``--kv-cache-dtype fp8_e4m3``): quantization bounds, attention over fp8
pages equal to attention over the same pages upcast (both torch paths), the engine
with fp8 KV (cache on = off, stats, checkpoint scales), pool sizing and refusals.
The FlashInfer plumbing is in tests/test_backends.py, its kernels in tests/gpu/."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.cache import kv_pool
from mmserve.cache.kv_pool import (
    FP8_E4M3_MAX,
    KVPool,
    dequantize_kv,
    kv_bytes_per_token,
    plan_pool,
    quantize_kv,
)
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.kernels.metadata import build_metadata
from mmserve.kernels.torch_backend import TorchAttentionBackend
from mmserve.model.kv_scales import read_kv_scales
from mmserve.model.weights import CheckpointError
from tests.helpers import decoder_key_prefix, greedy, page_layout, run_python, user

FP8 = torch.float8_e4m3fn
GIB = 1 << 30


# ---- quantization ----------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    scale=st.floats(2**-8, 2**8),
    magnitude=st.floats(-12, 10),
    seed=st.integers(0, 2**16),
)
def test_quantize_round_trip_is_within_half_an_fp8_step(scale, magnitude, seed) -> None:
    """Round to nearest with 3 mantissa bits: relative error <= 2**-4 in the normal range,
    absolute <= 2**-10 x scale among subnormals; beyond +-448 x scale: clamped, finite."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, generator=gen) * 2.0**magnitude * scale
    q = quantize_kv(x, scale)
    assert q.dtype == FP8
    back = dequantize_kv(q, scale, torch.float32)
    assert torch.isfinite(back).all()
    inside = x.abs() <= FP8_E4M3_MAX * scale
    bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10 * scale))
    err = (back - x).abs()
    assert bool((err[inside] <= bound[inside] * (1 + 1e-6)).all()), err[inside].max()
    clamped = back[~inside].abs()
    torch.testing.assert_close(clamped, torch.full_like(clamped, FP8_E4M3_MAX) * scale)
    # re-quantizing what came back changes nothing (it is on the fp8 grid)
    assert torch.equal(quantize_kv(back, scale).view(torch.uint8), q.view(torch.uint8))


def test_upcast_to_bf16_is_exact() -> None:
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = torch.isfinite(every.float())
    assert torch.equal(every.to(torch.bfloat16).float()[finite], every.float()[finite])


# ---- attention over fp8 pages = attention over the upcast pages ----------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_attention_equals_attention_over_upcast_pages(dtype, page_size: int) -> None:
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data) -> None:
        hq, hkv = data.draw(st.sampled_from([(6, 2), (4, 4), (8, 1)]), label="heads")
        d = data.draw(st.sampled_from([32, 64, 128]), label="head_dim")
        tables, prefix, extend = page_layout(data, page_size)
        n_pages = max(max(t) for t in tables) + 1
        k_scale = data.draw(st.sampled_from([1.0, 0.05, 3.0]), label="k_scale")
        v_scale = data.draw(st.sampled_from([1.0, 0.25, 2.5]), label="v_scale")
        pool = KVPool(
            n_pages, page_size, 1, hkv, d, dtype=FP8, k_scales=[k_scale], v_scales=[v_scale]
        )
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        pool.k_buffers[0].copy_(
            quantize_kv(torch.randn(pool.k_buffers[0].shape, generator=gen), k_scale)
        )
        pool.v_buffers[0].copy_(
            quantize_kv(torch.randn(pool.v_buffers[0].shape, generator=gen), v_scale)
        )
        # the reference pool: the same pages upcast and scaled, in the compute dtype
        ref = KVPool(n_pages, page_size, 1, hkv, d, dtype=dtype)
        meta = build_metadata(tables, prefix, extend, page_size)
        t = sum(extend)
        q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
        # new tokens as fp8 stores them, so both pools hold the same values after writing
        k_up = dequantize_kv(quantize_kv(k, k_scale), k_scale, torch.float32).to(dtype)
        v_up = dequantize_kv(quantize_kv(v, v_scale), v_scale, torch.float32).to(dtype)
        ref.k_buffers[0].copy_(dequantize_kv(pool.k_buffers[0], k_scale, torch.float32))
        ref.v_buffers[0].copy_(dequantize_kv(pool.v_buffers[0], v_scale, torch.float32))
        want = TorchAttentionBackend(views=False)
        want.plan(meta)
        expect = want.forward(q, k_up, v_up, 0, ref)
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        for views in (True, False):
            backend = TorchAttentionBackend(views=views)
            backend.plan(meta)
            if views and any(e <= 64 for e in extend):
                assert backend._view_reqs, "the view path was not taken"
            got = backend.forward(q, k, v, 0, pool)
            assert got.dtype == dtype and torch.isfinite(got).all()
            diff = (got.float() - expect.float()).abs().max().item()
            assert diff <= tol * max(1.0, v_scale), (views, diff)
        # the pool holds exactly the quantized new tokens
        loc = meta.out_cache_loc
        k_flat, v_flat = pool.flat_kv(0)
        assert torch.equal(k_flat[loc].view(torch.uint8), quantize_kv(k, k_scale).view(torch.uint8))
        assert torch.equal(v_flat[loc].view(torch.uint8), quantize_kv(v, v_scale).view(torch.uint8))

    check()


def test_write_pages_refuses_another_dtype() -> None:
    pool = KVPool(4, 2, 1, 1, 8, dtype=FP8)
    pages = pool.read_pages([1, 2])
    assert pages.dtype == FP8 and pages.shape == (2, 2, 1, 2, 1, 8)
    pool.write_pages([0, 3], pages)  # fp8 pages copied as bytes
    with pytest.raises(ValueError, match="float32"):
        pool.write_pages([0], torch.zeros(1, 2, 1, 2, 1, 8))


# ---- pool sizing ------------------------------------------------------------------------
def test_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_memory() -> None:
    mem = (64 * GIB, 64 * GIB)
    for layers, heads, dim in ((24, 2, 64), (32, 32, 128), (2, 1, 32)):
        bf16 = kv_bytes_per_token(layers, heads, dim, torch.bfloat16)
        fp8 = kv_bytes_per_token(layers, heads, dim, FP8)
        assert fp8 * 2 == bf16 == 2 * 2 * layers * heads * dim
        cfg = EngineConfig(kv_cache_memory=GIB, page_size=16)
        a = plan_pool(cfg, bf16, 1024, memory=mem).tokens
        b = plan_pool(cfg, fp8, 1024, memory=mem).tokens
        assert b in (2 * a, 2 * a + 16)  # whole pages: at most one more
        assert b * fp8 <= GIB and a * bf16 <= GIB


def test_engine_pool_and_stats_report_fp8(make_engine) -> None:
    auto = make_engine(page_size=16, kv_cache_memory=8 << 20)
    fp8 = make_engine(page_size=16, kv_cache_memory=8 << 20, kv_cache_dtype="fp8_e4m3")
    assert fp8.pool.k_buffers[0].dtype == FP8 and fp8.pool.quantized
    ratio = auto.pool.bytes_per_token() / fp8.pool.bytes_per_token()
    assert ratio == auto.pool.k_buffers[0].element_size()  # 4 (fp32 here) or 2 (bf16)
    assert fp8.pool.size_tokens // 16 == auto.pool.size_tokens * int(ratio) // 16
    stats = fp8.stats_snapshot()
    assert stats["kv_cache_dtype"] == "fp8_e4m3"
    assert stats["kv_bytes_per_token"] == fp8.pool.bytes_per_token()
    want = str(auto.pool.dtype).removeprefix("torch.")
    assert auto.stats_snapshot()["kv_cache_dtype"] == want
    assert make_engine(kv_cache_dtype="fp8").pool.dtype == FP8  # vLLM's alias


def test_cache_stats_route_reports_the_kv_dtype(make_engine) -> None:
    from fastapi.testclient import TestClient

    from api.app import ServerSettings, create_app

    app = create_app(make_engine(kv_cache_dtype="fp8_e4m3"), ServerSettings())
    with TestClient(app) as c:
        stats = c.get("/v1/cache/stats").json()
    assert stats["kv_cache_dtype"] == "fp8_e4m3" and stats["accounting"]["ok"]
    assert stats["kv_bytes_per_token"] == 2 * 2 * 1 * 64  # tiny: 2 layers, 1 K/V head of 64


# ---- the engine -------------------------------------------------------------------------
def _questions(eng: Engine, imgs: list) -> list:
    reqs = [
        eng.processor.make_request(messages=user(None, q), images=[img], params=greedy(6))
        for img in imgs
        for q in ("What is this?", "What colour is it?")
    ]
    reqs.append(eng.processor.make_request(messages=user("Only text here."), params=greedy(6)))
    return reqs


@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_engine_cache_on_equals_off(make_engine, photos, page_size: int) -> None:
    kw = {"page_size": page_size, "kv_cache_dtype": "fp8_e4m3"}
    on = make_engine(**kw)
    imgs = [on.processor.prepare_image(b) for b in list(photos.values())[:2]]
    off = make_engine(disable_radix_cache=True, **kw)
    res_off = off.generate(_questions(off, imgs))
    res_on = []
    for req in _questions(on, imgs):  # one at a time: later questions hit the image
        res_on += on.generate([req])
    assert [r.output_ids for r in res_on] == [r.output_ids for r in res_off]
    assert sum(r.cached_tokens for r in res_on) >= 2 * 500
    assert all(r.cached_tokens == 0 for r in res_off)
    on.scheduler.check_accounting()
    assert on.stats_snapshot()["accounting"]["ok"]


# ---- scales from the checkpoint ---------------------------------------------------------
def _with_scales(model_dir: Path, tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of ``model_dir`` (links) plus a safetensors file holding ``tensors``."""
    from safetensors.torch import save_file

    out = tmp_path / "ckpt"
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        (out / f.name).symlink_to(f)
    save_file(tensors, str(out / "kv-scales.safetensors"))
    return out


def test_checkpoint_scales_are_read_and_used(model_dir, loaded, tmp_path: Path) -> None:
    pre = decoder_key_prefix(model_dir)
    n = loaded.decoder.shape.num_layers
    tensors = {f"{pre}layers.{i}.self_attn.k_scale": torch.tensor(0.5 + i) for i in range(n)}
    tensors |= {f"{pre}layers.{i}.self_attn.v_scale": torch.tensor([0.25]) for i in range(n)}
    ckpt = _with_scales(model_dir, tmp_path, tensors)
    assert read_kv_scales(model_dir, n) is None  # the plain checkpoint has none
    assert read_kv_scales(ckpt, n) == ([0.5 + i for i in range(n)], [0.25] * n)
    cfg = EngineConfig(model_path=str(ckpt), kv_cache_dtype="fp8_e4m3", page_size=16)
    eng = Engine(cfg, model=loaded)
    assert eng.pool.k_scales == [0.5 + i for i in range(n)] and eng.pool.v_scales == [0.25] * n
    req = eng.processor.make_request(messages=user("Say something."), params=greedy(4))
    assert len(eng.generate([req])[0].output_ids) == 4
    # the auto KV dtype ignores them
    auto = Engine(EngineConfig(model_path=str(ckpt)), model=loaded)
    assert auto.pool.k_scales == [1.0] * n


def test_one_kv_scale_serves_k_and_v_and_bad_scales_are_refused(
    model_dir, loaded, tmp_path: Path
) -> None:
    pre = decoder_key_prefix(model_dir)
    n = loaded.decoder.shape.num_layers
    one = {f"{pre}layers.{i}.self_attn.kv_scale": torch.tensor(2.0) for i in range(n)}
    assert read_kv_scales(_with_scales(model_dir, tmp_path / "a", one), n) == ([2.0] * n, [2.0] * n)
    some = {f"{pre}layers.0.self_attn.k_scale": torch.tensor(1.5)}
    with pytest.raises(CheckpointError, match="some layers only.*v_scale of layer 0"):
        read_kv_scales(_with_scales(model_dir, tmp_path / "b", some), n)
    bad = {f"{pre}layers.0.self_attn.k_scale": torch.tensor([1.0, 2.0])}
    with pytest.raises(CheckpointError, match="one positive finite number"):
        read_kv_scales(_with_scales(model_dir, tmp_path / "c", bad), n)
    neg = {f"{pre}layers.0.self_attn.kv_scale": torch.tensor(-1.0)}
    with pytest.raises(CheckpointError, match="kv_scale"):
        read_kv_scales(_with_scales(model_dir, tmp_path / "d", neg), n)


# ---- refusals name the flag and what works ---------------------------------------------
def test_refusals_name_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--kv-cache-dtype 'fp8_e5m2'.*auto, fp8_e4m3, fp8"):
        EngineConfig(kv_cache_dtype="fp8_e5m2").validate()
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8_e4m3.*--tp.*--kv-cache-dtype auto"):
        EngineConfig(kv_cache_dtype="fp8_e4m3", tp=2).validate()
    with pytest.raises(ValueError, match="k_scales needs 2 positive"):
        KVPool(2, 1, 2, 1, 8, dtype=FP8, k_scales=[1.0, math.inf])


def test_torch_without_fp8_is_refused_at_start(make_engine, monkeypatch) -> None:
    monkeypatch.setattr(kv_pool, "FP8_KV_DTYPE", None)
    with pytest.raises(
        ValueError, match=r"--kv-cache-dtype fp8_e4m3 needs .*--kv-cache-dtype auto"
    ):
        make_engine(kv_cache_dtype="fp8_e4m3")


def test_cli_lists_the_choices() -> None:
    proc = run_python(
        "from api.cli import main; main(['serve', '--kv-cache-dtype', 'int4'])", timeout=120
    )
    assert proc.returncode == 2
    assert "--kv-cache-dtype" in proc.stderr and "fp8_e4m3" in proc.stderr


# ---- the benchmark's tool ---------------------------------------------------------------
def test_kv_fp8_benchmark_tiny(model_dir, tmp_path: Path) -> None:
    import json

    from benchmarks.__main__ import main

    argv = ["kv-fp8", "--model", str(model_dir), "--scale", "ci", "--over", "1"]
    assert main([*argv, "--positions", "60", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "kv_fp8.json").read_text())
    cap = out["capacity"]
    assert cap["fp8"]["kv_bytes_per_token"] * 2 == cap["bf16"]["kv_bytes_per_token"]
    assert cap["ratio"] >= 1.9 and cap["bf16"]["images_resident"] >= 10
    hr = out["hit_rate"]
    assert hr["images"] == cap["bf16"]["images_resident"]
    assert hr["fp8"]["cache_hit_rate"] >= hr["bf16"]["cache_hit_rate"] > 0
    for q in out["quality"].values():
        assert q["positions"] >= 60 and 0.0 <= q["top1_agreement"] <= 1.0 and q["mean_kl"] >= 0
