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
#: Query rows x padded keys per pass: bounds the fp32 temporaries (the expanded keys are
#: ``rows x Hkv x keys x D``); rows are independent, so the split changes no result.
QUERY_KEYS = 1 << 15


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
    # [Hkv, blocks, D, BLOCK_KEYS] and [Hkv, blocks, BLOCK_KEYS, D]
    kb = kf.view(blocks, BLOCK_KEYS, hkv, d).permute(2, 0, 3, 1)
    vb = vf.view(blocks, BLOCK_KEYS, hkv, d).permute(2, 0, 1, 3)
    key_pos = torch.arange(padded, device=q.device).view(blocks, BLOCK_KEYS)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    step = max(1, QUERY_KEYS // padded)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        r = hi - lo
        # only the nb up to this pass's last row (a causal prefill's later rows need more)
        nb = -(-(int(q_pos[lo:hi].max()) + 1) // BLOCK_KEYS)
        items = r * hkv * nb
        # one [G, D] x [D, BLOCK_KEYS] product per (row, K/V head, block): every item of
        # the batched matmul has the same shape whatever r and L are, so the same kernel
        qf = q[lo:hi].float().view(r, hkv, 1, g, d).expand(r, hkv, nb, g, d)
        kr = kb[None, :, :nb].expand(r, hkv, nb, d, BLOCK_KEYS)
        s = torch.bmm(qf.reshape(items, g, d), kr.reshape(items, d, BLOCK_KEYS)) * sm
        s = s.view(r, hkv, nb, g, BLOCK_KEYS)
        hidden = key_pos[None, :nb] > q_pos[lo:hi, None, None]  # [r, nb, BLOCK_KEYS]
        s = s.masked_fill(hidden[:, None, :, None, :], float("-inf"))
        m_b = s.amax(-1)  # [r, Hkv, nb, G]; -inf for a block after the row
        p = torch.exp(s - torch.where(m_b == float("-inf"), 0.0, m_b)[..., None])
        l_b = p.sum(-1)  # a fixed-length (BLOCK_KEYS) sum
        vr = vb[None, :, :nb].expand(r, hkv, nb, BLOCK_KEYS, d)
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
        out[lo:hi] = (acc / den[..., None]).reshape(r, hq, d).to(q.dtype)
    return out
