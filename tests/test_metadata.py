"""Paged metadata against hand-computed layouts; torch backend against dense attention."""

from __future__ import annotations

import pytest
import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.kernels.metadata import build_metadata
from mmserve.kernels.torch_backend import TorchAttentionBackend


def test_hand_computed_layout() -> None:
    # request 0: 5 cached + 3 new tokens over pages [7, 2, 9] with P=4 -> 8 tokens, 2 pages used
    # request 1: decode: 4 cached + 1 new over pages [0, 5] -> 5 tokens, last page holds 1
    m = build_metadata([[7, 2, 9], [0, 5]], [5, 4], [3, 1], page_size=4)
    assert m.qo_indptr.tolist() == [0, 3, 4]
    assert m.kv_indptr.tolist() == [0, 2, 4]
    assert m.kv_indices.tolist() == [7, 2, 0, 5]
    assert m.kv_last_page_len.tolist() == [4, 1]
    assert m.positions.tolist() == [5, 6, 7, 4]
    # pos 5 -> page 2 slot 1 = 9; pos 6 -> 10; pos 7 -> 11; pos 4 -> page 5 slot 0 = 20
    assert m.out_cache_loc.tolist() == [9, 10, 11, 20]
    assert m.seq_lens == [8, 5] and not m.is_decode
    assert m.qo_indptr.dtype == torch.int32 and m.out_cache_loc.dtype == torch.int64


def test_page_size_one_and_decode_flag() -> None:
    m = build_metadata([[3, 1, 4], [2]], [2, 0], [1, 1], page_size=1)
    assert m.kv_indices.tolist() == [3, 1, 4, 2]
    assert m.kv_last_page_len.tolist() == [1, 1]
    assert m.out_cache_loc.tolist() == [4, 2]
    assert m.is_decode


@pytest.mark.parametrize(
    "tables, prefix, extend",
    [([[1, 2]], [0], [0]), ([[1]], [3], [2]), ([[1], [2]], [0], [1])],
)
def test_bad_inputs_raise(tables, prefix, extend) -> None:
    with pytest.raises(ValueError):
        build_metadata(tables, prefix, extend, page_size=2)


def dense_attention(q, k, v, prefix: int) -> torch.Tensor:
    """Brute force: q [t, Hq, D] attends causally to k, v [prefix + t, Hkv, D]."""
    t, hq, _ = q.shape
    rep = hq // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    for i in range(t):
        scores[:, i, prefix + i + 1 :] = float("-inf")
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("decode", [False, True])
def test_torch_backend_matches_dense(page_size: int, decode: bool) -> None:
    torch.manual_seed(page_size)
    hq, hkv, d = 4, 2, 8
    pool = KVPool(64, page_size, 1, hkv, d)
    prefixes = [0, 5, 19] if not decode else [3, 17, 30]
    extends = [7, 4, 9] if not decode else [1, 1, 1]
    perm = torch.randperm(64).tolist()
    tables, full_k, full_v = [], [], []
    for p, e in zip(prefixes, extends, strict=True):
        n = -(-(p + e) // page_size)
        pages, perm = perm[:n], perm[n:]
        tables.append(pages)
        k = torch.randn(p + e, hkv, d)
        v = torch.randn(p + e, hkv, d)
        full_k.append(k)
        full_v.append(v)
        kf, vf = pool.flat_kv(0)
        for pos in range(p):  # the cached prefix is already in the pool
            slot = pages[pos // page_size] * page_size + pos % page_size
            kf[slot], vf[slot] = k[pos], v[pos]
    meta = build_metadata(tables, prefixes, extends, page_size)
    backend = TorchAttentionBackend()
    backend.plan(meta)
    q = torch.randn(sum(extends), hq, d)
    k_new = torch.cat([k[p:] for k, p in zip(full_k, prefixes, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(full_v, prefixes, strict=True)])
    out = backend.forward(q, k_new, v_new, 0, pool)
    qo = meta.qo_indptr.tolist()
    for i, p in enumerate(prefixes):
        want = dense_attention(q[qo[i] : qo[i + 1]], full_k[i], full_v[i], p)
        torch.testing.assert_close(out[qo[i] : qo[i + 1]], want, atol=1e-5, rtol=1e-5)
