"""The fused norm/RoPE/SiLU ops follow the attention backend (issue 48.4): with a stand-in
``flashinfer`` importable, a decoder forward under the torch backend calls none of its
functions, even where the tensors would qualify for them (the CUDA check answered yes);
under a backend named "flashinfer" it calls them all; an "auto" engine on the CPU none.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.kernels import ops
from mmserve.kernels.metadata import build_metadata
from mmserve.kernels.torch_backend import TorchAttentionBackend
from tests.helpers import greedy, user


@pytest.fixture
def fake_flashinfer(monkeypatch) -> list[str]:
    """A ``flashinfer`` whose norm, RoPE and activation functions record their names and
    compute what the torch versions do; returns the list of calls."""
    calls: list[str] = []

    def rec(name, fn):
        def f(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)

        return f

    def fused_add(x, residual, weight, eps):
        normed, new = ops.fused_add_rms_norm_ref(x, residual, weight, eps)
        residual.copy_(new)
        x.copy_(normed)

    def rope(positions, q, k, head_dim, cache, is_neox=True):
        ops.apply_rope_ref(positions, q, k, head_dim, cache)

    root = types.ModuleType("flashinfer")
    subs = {
        "norm": {"rmsnorm": ops.rms_norm_ref, "fused_add_rmsnorm": fused_add},
        "rope": {"apply_rope_with_cos_sin_cache_inplace": rope},
        "activation": {"silu_and_mul": ops.silu_and_mul_ref},
    }
    for sub, fns in subs.items():
        mod = types.ModuleType(f"flashinfer.{sub}")
        for name, fn in fns.items():
            setattr(mod, name, rec(name, fn))
        setattr(root, sub, mod)
        monkeypatch.setitem(sys.modules, f"flashinfer.{sub}", mod)
    monkeypatch.setitem(sys.modules, "flashinfer", root)
    ops._flashinfer.cache_clear()
    yield calls
    ops._flashinfer.cache_clear()


class _NamedFlashInfer(TorchAttentionBackend):
    """The torch backend's attention under FlashInfer's name (what the ops look at)."""

    name = "flashinfer"


def _forward(loaded, backend) -> torch.Tensor:
    dec = loaded.decoder
    s = dec.shape
    dtype = dec.embed_tokens.weight.dtype
    pool = KVPool(4, 4, s.num_layers, s.num_kv_heads, s.head_dim, dtype=dtype)
    meta = build_metadata([[1, 2]], [0], [6], 4)
    backend.plan(meta)
    embeds = torch.randn(6, s.hidden_size, generator=torch.Generator().manual_seed(0))
    return dec(embeds.to(dtype), meta.positions, backend, pool, torch.tensor([5]))


def test_torch_backend_runs_no_flashinfer_op_where_they_could_run(
    loaded, fake_flashinfer, monkeypatch
) -> None:
    # the tensors qualify: "on CUDA" and of a FlashInfer dtype (the tiny model's too)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(ops, "_FLASHINFER_DTYPES", (torch.float32, torch.bfloat16))
    ref = _forward(loaded, TorchAttentionBackend())
    assert fake_flashinfer == []
    named = _forward(loaded, _NamedFlashInfer())  # the control: the fake is reachable
    assert {"rmsnorm", "fused_add_rmsnorm", "silu_and_mul"} <= set(fake_flashinfer)
    assert "apply_rope_with_cos_sin_cache_inplace" in fake_flashinfer
    monkeypatch.undo()
    torch.testing.assert_close(named, ref)
    # outside a decoder forward the ops keep their own rule (the GPU tests call them)
    assert ops._FUSED_FLASHINFER.get() is None


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_engine_on_cpu_calls_no_flashinfer_op(make_engine, fake_flashinfer, backend) -> None:
    eng = make_engine(attention_backend=backend)
    req = eng.processor.make_request(messages=user("hello there"), images=[], params=greedy(4))
    (res,) = eng.generate([req])
    assert len(res.output_ids) == 4 and fake_flashinfer == []
