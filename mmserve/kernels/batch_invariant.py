"""Batch- and chunk-invariant attention: the ``--deterministic`` mode's kernel.

A query row's attention output is computed by the same sequence of floating-point
operations however many other rows share the call, how many keys the batch holds, and
whether the row came from a fresh prefill, a prefill after a cached prefix, one chunk
of a chunked prefill or a decode step. That makes the KV a token writes and the logits a
step returns bit-identical across cache states, batches and chunkings (issue 46).

Algorithm: the flash-attention recurrence (Dao et al., "FlashAttention", arXiv
2205.14135, Section 3.1; the split-KV form of FlashDecoding) over **fixed key blocks of
absolute positions**: keys ``[b * BLOCK_KEYS, (b + 1) * BLOCK_KEYS)``, each block padded
to exactly :data:`BLOCK_KEYS` (padding and keys after the query masked to ``-inf``),
visited in order ``b = 0, 1, ...``. Within a block all arithmetic is fp32 and
elementwise, a reduction over a fixed-length axis (``BLOCK_KEYS`` for the softmax sum),
or a batched matmul whose every item has one fixed shape (``[G, D] x [D, BLOCK_KEYS]``
for scores, ``[G, BLOCK_KEYS] x [BLOCK_KEYS, D]`` for values: one item per query row and
K/V head), so no reduction's order depends on the batch's shape, unlike one GEMM over
all rows, whose blocking (and on CPU, gemv vs gemm path) follows ``M``, or
torch's CPU flash kernel, whose key split follows the key count. A block wholly after a
query's position leaves its running state unchanged exactly (``x * 1 + 0``), so a
decode step, which stops at its own block, equals a prefill row that saw more blocks.

The mode's second kernel, :func:`split_partials` with :func:`tree_sum`, makes the
row-parallel linears (``o_proj``, ``down_proj``) give the same bits on one rank as split
over ``N`` tensor-parallel ranks: the reduction axis is cut into a fixed number
(:func:`reduction_splits`, a power of two fixed by the model) of equal blocks, each
block's product is one linear call of one fixed shape, and the block products are
added in fp32 as a fixed balanced binary tree, then rounded once. A rank holding
``S / N`` consecutive blocks (``N`` a power of two dividing ``S``) computes a whole
subtree, so gathering the ``N`` subtree sums and adding them in the same tree gives the
unsplit result bit for bit, which a plain all-reduce (rank partials rounded to the model
dtype, summed in the collective's own order) does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

#: Keys per fixed attention block (absolute positions ``[b * 64, (b + 1) * 64)``).
BLOCK_KEYS = 64
#: Query rows x padded keys per pass: bounds the fp32 temporaries (the expanded keys are
#: ``rows x Hkv x keys x D``); rows are independent, so the split changes no result.
QUERY_KEYS = 1 << 15
#: Most blocks a row-parallel reduction is cut into under ``--deterministic`` (so the
#: largest tensor-parallel size whose ranks hold whole blocks).
MAX_SPLITS = 8
#: Elements of one pass's fp32 block products (``splits x rows x out``): bounds the
#: temporaries of a long prefill; rows are independent, so the split changes no result.
SPLIT_ELEMS = 1 << 24

_INVARIANT_LINEARS: ContextVar[bool] = ContextVar("mmserve_invariant_linears", default=False)


@contextmanager
def invariant_linears(on: bool) -> Iterator[None]:
    """Within the block, the decoder's linears run batch-invariant when ``on``
    (:func:`linear`; the row-parallel ones in fixed splits, :func:`split_partials`);
    the decoder's forward enters it with its attention backend's ``deterministic``."""
    token = _INVARIANT_LINEARS.set(on)
    try:
        yield
    finally:
        _INVARIANT_LINEARS.reset(token)


def invariant_linears_on() -> bool:
    """Whether the caller runs inside ``invariant_linears(True)``."""
    return _INVARIANT_LINEARS.get()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose rows do not depend on how many rows share the call.

    ``x``: ``[T, in]``, ``weight``: ``[out, in]`` -> ``[T, out]``. A single row is
    computed as the first of two copies: on the CPU a one-row bf16 linear takes another
    kernel path (a matrix-vector product) whose sums can round differently from the
    same row's in a matrix product (measured on avx512_bf16: some values, some shapes),
    while two or more rows all took one path in every shape measured.
    """
    if x.shape[0] == 1:
        return F.linear(x.repeat(2, 1), weight, bias)[:1]
    return F.linear(x, weight, bias)


def reduction_splits(num_heads: int, intermediate_size: int) -> int:
    """Blocks a row-parallel reduction is cut into: the largest power of two, at most
    :data:`MAX_SPLITS`, dividing both the query heads (``o_proj``'s inputs come in whole
    heads) and the MLP width, so every tensor-parallel size that is a power of two
    dividing it gives each rank whole blocks. 1 for a model with an odd head count."""
    both = num_heads | intermediate_size  # lowest set bit: the largest common power of 2
    return min(MAX_SPLITS, both & -both)


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` added pairwise as a balanced binary tree in a fixed order:
    ``((p0 + p1) + (p2 + p3)) + ...``; ``len(parts)`` a power of two.

    So the sum of ``S`` parts equals the tree sum of the ``N`` sums of consecutive
    ``S / N`` parts, bit for bit (``N`` a power of two dividing ``S``)."""
    n = len(parts)
    if n & (n - 1) or n == 0:
        raise ValueError(f"tree_sum needs a power-of-two count of parts, got {n}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def split_partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """``x @ weight.T`` over ``splits`` fixed blocks of the reduction axis, summed in fp32.

    Args:
        x: ``[T, K]`` activations.
        weight: ``[out, K]`` (``x``'s dtype), ``K`` a multiple of ``splits``;
            ``splits`` a power of two.
        splits: blocks of ``K // splits`` input features each.

    Returns:
        fp32 ``[T, out]``: :func:`tree_sum` of the block products, each one
        ``[T, K / S] x [K / S, out]`` linear in ``x``'s dtype over views of ``x`` and
        ``weight`` (no copy), so a row's result depends on neither how many rows share
        the call nor on how many blocks the layer holds (one rank's, or all of them).
        A batched matmul over the blocks would do the same arithmetic, but on the CPU
        its transposed-weight path runs tens of times slower than ``linear``.
    """
    t, k = x.shape
    kb = k // splits
    y = torch.empty(t, weight.shape[0], dtype=torch.float32, device=x.device)
    step = max(1, SPLIT_ELEMS // max(1, splits * weight.shape[0]))
    for lo in range(0, t, step):
        rows = x[lo : lo + step]
        rows = rows.repeat(2, 1) if rows.shape[0] == 1 else rows  # see linear()
        parts = [
            F.linear(rows[:, b * kb : (b + 1) * kb], weight[:, b * kb : (b + 1) * kb]).float()
            for b in range(splits)
        ]
        y[lo : lo + step] = tree_sum(parts)[: min(step, t - lo)]
    return y


def attend_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of one request's query rows over its keys, batch-invariant.

    Args:
        q: ``[n, Hq, D]`` queries (any float dtype).
        k, v: ``[L, Hkv, D]`` the request's keys/values at positions ``0 .. L - 1``
            (``Hq`` a multiple of ``Hkv``: grouped-query attention), ``q``'s dtype.
        q_pos: int64 ``[n]`` absolute position of each query (``< L``); query ``i``
            sees keys ``0 .. q_pos[i]``.
        scale: softmax scale (None: ``1 / sqrt(D)``).

    Returns:
        ``[n, Hq, D]`` in ``q``'s dtype; row ``i`` depends only on ``q[i]``,
        ``q_pos[i]`` and keys ``0 .. q_pos[i]`` (bit for bit).
    """
    n, hq, d = q.shape
    if n == 0:
        return q.new_empty(q.shape)
    hkv = k.shape[1]
    sm = d**-0.5 if scale is None else scale
    last = int(q_pos.max()) + 1
    blocks = -(-last // BLOCK_KEYS)
    padded = blocks * BLOCK_KEYS
    kf = k[:last].float()
    vf = v[:last].float()
    if padded > last:
        pad = kf.new_zeros(padded - last, hkv, d)
        kf, vf = torch.cat([kf, pad]), torch.cat([vf, pad])
    # [Hkv, blocks, D, BLOCK_KEYS] and [Hkv, blocks, BLOCK_KEYS, D]
    kb = kf.view(blocks, BLOCK_KEYS, hkv, d).permute(2, 0, 3, 1)
    vb = vf.view(blocks, BLOCK_KEYS, hkv, d).permute(2, 0, 1, 3)
    key_pos = torch.arange(padded, device=q.device).view(blocks, BLOCK_KEYS)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    step = max(1, QUERY_KEYS // padded)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        # only the nb up to this pass's last row (a causal prefill's later rows need more)
        nb = -(-(int(q_pos[lo:hi].max()) + 1) // BLOCK_KEYS)
        keys = (kb[None, :, :nb].expand(hi - lo, -1, -1, -1, -1), vb[None, :, :nb])
        out[lo:hi] = _rows(q[lo:hi], *keys, q_pos[lo:hi], key_pos[:nb], sm).to(q.dtype)
    return out


def _rows(
    q: torch.Tensor,
    kr: torch.Tensor,
    vr: torch.Tensor,
    q_pos: torch.Tensor,
    key_pos: torch.Tensor,
    sm: float,
) -> torch.Tensor:
    """fp32 ``[r, Hq, D]`` attention of ``r`` query rows over their fixed key blocks.

    ``kr``: ``[r | 1, Hkv, nb, D, BLOCK_KEYS]`` and ``vr``: ``[r | 1, Hkv, nb,
    BLOCK_KEYS, D]`` fp32 (a row's own blocks, or one request's blocks shared by its
    rows), ``key_pos``: ``[nb, BLOCK_KEYS]`` absolute positions, ``q_pos``: ``[r]``.
    """
    r, hq, d = q.shape
    hkv, nb = kr.shape[1], kr.shape[2]
    g = hq // hkv
    items = r * hkv * nb
    # one [G, D] x [D, BLOCK_KEYS] product per (row, K/V head, block): every item of
    # the batched matmul has the same shape whatever r and L are, so the same kernel
    qf = q.float().view(r, hkv, 1, g, d).expand(r, hkv, nb, g, d)
    kr = kr.expand(r, hkv, nb, d, BLOCK_KEYS)
    s = torch.bmm(qf.reshape(items, g, d), kr.reshape(items, d, BLOCK_KEYS)) * sm
    s = s.view(r, hkv, nb, g, BLOCK_KEYS)
    hidden = key_pos[None] > q_pos[:, None, None]  # [r, nb, BLOCK_KEYS]
    s = s.masked_fill(hidden[:, None, :, None, :], float("-inf"))
    m_b = s.amax(-1)  # [r, Hkv, nb, G]; -inf for a block after the row
    p = torch.exp(s - torch.where(m_b == float("-inf"), 0.0, m_b)[..., None])
    l_b = p.sum(-1)  # a fixed-length (BLOCK_KEYS) sum
    vr = vr.expand(r, hkv, nb, BLOCK_KEYS, d)
    o_b = torch.bmm(p.view(items, g, BLOCK_KEYS), vr.reshape(items, BLOCK_KEYS, d))
    o_b = o_b.view(r, hkv, nb, g, d)
    # merge the nb in order b = 0, 1, ...: a block after the row has l_b = 0,
    # o_b = 0 and weight exp(-inf) = 0, so it leaves m, den and acc exactly as they are
    m, den, acc = m_b[:, :, 0], l_b[:, :, 0], o_b[:, :, 0]
    for b in range(1, nb):
        m_new = torch.maximum(m, m_b[:, :, b])
        c_old, c_b = torch.exp(m - m_new), torch.exp(m_b[:, :, b] - m_new)
        den = den * c_old + l_b[:, :, b] * c_b
        acc = acc * c_old[..., None] + o_b[:, :, b] * c_b[..., None]
        m = m_new
    return (acc / den[..., None]).reshape(r, hq, d)


def attend_invariant_decode(
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`attend_invariant` of one decode row per request, all requests in one pass.

    Args:
        q: ``[R, Hq, D]``, row ``i`` the newest token of request ``i``.
        ks, vs: request ``i``'s keys/values ``[L_i, Hkv, D]`` (``q``'s dtype), its row at
            position ``L_i - 1``.
        scale: softmax scale (None: ``1 / sqrt(D)``).

    Returns:
        ``[R, Hq, D]`` in ``q``'s dtype, each row bit-identical to
        ``attend_invariant(q[i:i+1], ks[i], vs[i], [L_i - 1])``: the same fixed-shape
        items and the same merge order; a request with fewer blocks than the longest
        gets zero blocks after its row, which leave its state exactly as it was.
    """
    n, hq, d = q.shape
    if n == 0:
        return q.new_empty(q.shape)
    hkv = ks[0].shape[1]
    sm = d**-0.5 if scale is None else scale
    lens = [k.shape[0] for k in ks]
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    order = sorted(range(n), key=lambda i: lens[i])  # similar lengths share a pass
    i = 0
    while i < n:
        nb = -(-lens[order[i]] // BLOCK_KEYS)
        step = max(1, QUERY_KEYS // (nb * BLOCK_KEYS))
        group = order[i : i + step]
        nb = -(-max(lens[j] for j in group) // BLOCK_KEYS)
        while len(group) > 1 and len(group) * nb * BLOCK_KEYS > QUERY_KEYS:
            group = group[:-1]
            nb = -(-max(lens[j] for j in group) // BLOCK_KEYS)
        padded = nb * BLOCK_KEYS
        kf = q.new_zeros(len(group), padded, hkv, d, dtype=torch.float32)
        vf = torch.zeros_like(kf)
        for row, j in enumerate(group):
            kf[row, : lens[j]] = ks[j].float()
            vf[row, : lens[j]] = vs[j].float()
        kb = kf.view(len(group), nb, BLOCK_KEYS, hkv, d).permute(0, 3, 1, 4, 2)
        vb = vf.view(len(group), nb, BLOCK_KEYS, hkv, d).permute(0, 3, 1, 2, 4)
        key_pos = torch.arange(padded, device=q.device).view(nb, BLOCK_KEYS)
        idx = torch.tensor(group, device=q.device)
        pos = torch.tensor([lens[j] - 1 for j in group], device=q.device)
        out[idx] = _rows(q[idx], kb, vb, pos, key_pos, sm).to(q.dtype)
        i += len(group)
    return out
