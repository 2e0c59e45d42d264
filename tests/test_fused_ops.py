"""The fused ops' torch versions (the specification, :mod:`mmserve.kernels.ops`) against
the unfused arithmetic the decoder ran before them (transformers' Llama arithmetic,
written out below), over shapes and dtypes; and the fused projections against the
checkpoint's separate ones. FlashInfer's versions against these: tests/gpu/test_fused_ops_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.kernels import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


# ---- the unfused arithmetic, as the decoder (and transformers) ran it ----------------------
def old_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def old_rope(q, k, positions, inv_freq, dtype):
    """Per-step tables from fp32 frequencies, then ``x * cos + rotate_half(x) * sin``."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_fused_add_equal_the_unfused_arithmetic_bit_for_bit(dtype) -> None:
    @SETTINGS
    @given(
        st.integers(1, 40),
        st.sampled_from([8, 64, 96, 896]),
        st.sampled_from([1e-6, 1e-5]),
        st.integers(0, 2**31),
    )
    def check(t: int, h: int, eps: float, seed: int) -> None:
        g = _gen(seed)
        x = (torch.randn(t, h, generator=g) * 3).to(dtype)
        res = (torch.randn(t, h, generator=g) * 10).to(dtype)
        w = (1 + torch.randn(h, generator=g) / 4).to(dtype)
        x0, res0 = x.clone(), res.clone()
        assert torch.equal(ops.rms_norm(x, w, eps), old_rms_norm(x, w, eps))
        normed, new_res = ops.fused_add_rms_norm(x, res, w, eps)
        assert torch.equal(new_res, res0 + x0)  # the unfused residual add, same rounding
        assert torch.equal(normed, old_rms_norm(res0 + x0, w, eps))
        assert normed.dtype == new_res.dtype == dtype
        assert torch.equal(x, x0) and torch.equal(res, res0)  # the torch version copies

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_from_the_cache_equals_per_step_tables_bit_for_bit(dtype) -> None:
    @SETTINGS
    @given(
        st.integers(1, 24),
        st.sampled_from([(4, 1), (2, 2), (14, 2)]),
        st.sampled_from([32, 64, 128]),
        st.sampled_from([1e4, 1e6]),
        st.integers(0, 2**31),
    )
    def check(t: int, heads: tuple, d: int, theta: float, seed: int) -> None:
        hq, hkv = heads
        g = _gen(seed)
        max_pos = 4096
        inv = ops.rope_inv_freq(d, theta)
        cache = ops.cos_sin_cache(inv, max_pos)
        assert cache.dtype == torch.float32 and cache.shape == (max_pos, d)
        positions = torch.randint(0, max_pos, (t,), generator=g)
        # q and k as column slices of one qkv row, as the fused projection leaves them
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        want_q, want_k = old_rope(q.view(t, hq, d), k.view(t, hkv, d), positions, inv, dtype)
        v0 = v.clone()
        ops.apply_rope(positions, q, k, d, cache)
        assert torch.equal(q.view(t, hq, d), want_q)
        assert torch.equal(k.view(t, hkv, d), want_k)
        assert torch.equal(v, v0)  # v's columns untouched

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_equals_silu_gate_times_up_bit_for_bit(dtype) -> None:
    @SETTINGS
    @given(st.integers(1, 40), st.sampled_from([1, 8, 256, 4864]), st.integers(0, 2**31))
    def check(t: int, i: int, seed: int) -> None:
        g = _gen(seed)
        gate = (torch.randn(t, i, generator=g) * 4).to(dtype)
        up = torch.randn(t, i, generator=g).to(dtype)
        got = ops.silu_and_mul(torch.cat((gate, up), dim=-1))
        assert got.shape == (t, i) and got.dtype == dtype
        assert torch.equal(got, torch.nn.functional.silu(gate) * up)

    check()


def test_fused_projections_equal_the_separate_ones(families) -> None:
    """qkv_proj / gate_up_proj of the loaded model give q, k, v / gate, up as the
    checkpoint's separate matrices do (fp32: one matmul vs three, within 1e-5)."""
    from safetensors.torch import load_file

    fam = families["llava-onevision"]  # q/k/v biases too
    dec = fam.loaded.decoder
    w = load_file(fam.model_dir / "model.safetensors")
    pre = next(k for k in w if k.endswith("layers.1.self_attn.q_proj.weight")).removesuffix(
        "self_attn.q_proj.weight"
    )
    x = torch.randn(5, dec.shape.hidden_size, generator=_gen(0))
    attn, mlp = dec.layers[1].self_attn, dec.layers[1].mlp
    fused = torch.cat(
        [
            torch.nn.functional.linear(
                x, w[f"{pre}self_attn.{p}_proj.weight"], w.get(f"{pre}self_attn.{p}_proj.bias")
            )
            for p in "qkv"
        ],
        dim=-1,
    )
    torch.testing.assert_close(attn.qkv_proj(x), fused, rtol=1e-5, atol=1e-5)
    gate_up = torch.cat([x @ w[f"{pre}mlp.{p}_proj.weight"].T for p in ("gate", "up")], dim=-1)
    torch.testing.assert_close(mlp.gate_up_proj(x), gate_up, rtol=1e-5, atol=1e-5)


def test_rope_cache_is_built_once_per_model(families) -> None:
    """The table is made when the model is built, not per forward: the same tensor every
    step, covering the model's whole context."""
    dec = families["llava"].loaded.decoder
    cache = dec.rope_cache(torch.device("cpu"))
    assert dec.rope_cache(torch.device("cpu")) is cache
    assert cache.shape == (dec.shape.max_position_embeddings, dec.shape.head_dim)
    assert cache.dtype == torch.float32
