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
"""

from __future__ import annotations

import torch

#: Keys per fixed attention block (absolute positions ``[b * 64, (b + 1) * 64)``).
BLOCK_KEYS = 64
#: Query rows per call of the block loop: bounds the ``[rows, Hq, BLOCK_KEYS, D]`` fp32
#: temporaries (rows are independent, so the split changes no result).
QUERY_ROWS = 32


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
    g = hq // hkv
    sm = d**-0.5 if scale is None else scale
    last = int(q_pos.max()) + 1
    blocks = -(-last // BLOCK_KEYS)
    padded = blocks * BLOCK_KEYS
    kf = k[:last].float()
    vf = v[:last].float()
    if padded > last:
        pad = kf.new_zeros(padded - last, hkv, d)
        kf, vf = torch.cat([kf, pad]), torch.cat([vf, pad])
    # [blocks, Hkv, D, BLOCK_KEYS] and [blocks, Hkv, BLOCK_KEYS, D]
    kb = kf.view(blocks, BLOCK_KEYS, hkv, d).permute(0, 2, 3, 1)
    vb = vf.view(blocks, BLOCK_KEYS, hkv, d).permute(0, 2, 1, 3)
    key_pos = torch.arange(padded, device=q.device).view(blocks, BLOCK_KEYS)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    for lo in range(0, n, QUERY_ROWS):
        hi = min(n, lo + QUERY_ROWS)
        r = hi - lo
        qf = q[lo:hi].float().reshape(r * hkv, g, d)
        pos = q_pos[lo:hi]
        m = torch.full((r, hkv, g), float("-inf"), device=q.device)
        den = torch.zeros(r, hkv, g, device=q.device)
        acc = torch.zeros(r, hkv, g, d, device=q.device)
        for b in range(-(-(int(pos.max()) + 1) // BLOCK_KEYS)):
            # one [G, D] x [D, BLOCK_KEYS] product per (row, K/V head): every item of the
            # batched matmul has the same shape whatever r is, so the same kernel and order
            kr = kb[b][None].expand(r, hkv, d, BLOCK_KEYS).reshape(r * hkv, d, BLOCK_KEYS)
            s = torch.bmm(qf, kr).view(r, hkv, g, BLOCK_KEYS) * sm
            hidden = key_pos[b][None, :] > pos[:, None]  # [r, BLOCK_KEYS]
            s = s.masked_fill(hidden[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            corr = torch.exp(m - m_new)
            den = den * corr + p.sum(-1)
            vr = vb[b][None].expand(r, hkv, BLOCK_KEYS, d).reshape(r * hkv, BLOCK_KEYS, d)
            pv = torch.bmm(p.view(r * hkv, g, BLOCK_KEYS), vr).view(r, hkv, g, d)
            acc = acc * corr[..., None] + pv
            m = m_new
        out[lo:hi] = (acc / den[..., None]).reshape(r, hq, d).to(q.dtype)
    return out
