"""Reference attention backend in plain torch, for any device.

Its literal path executes :class:`~mmserve.kernels.metadata.AttentionMetadata` as
written: gather each request's pages by ``kv_indices``, keep ``seq_len`` tokens, and
run causal attention in which query row ``j`` of a request with ``q_len`` new tokens
sees keys ``0 .. seq_len - q_len + j`` (the new tokens are the tail of the
sequence). Grouped-query attention maps ``Hq / Hkv`` query heads to each K/V head.

On CPU, decode tokens and short extends (a new question after a cached prefix) take
the *view* path instead, which reads the pool in place: a request's slots are split
into contiguous runs; each long run is attended as a strided view of the pool (no
copy) and only the short leftovers (for example decode tokens interleaved with other
requests') are gathered. Grouped-query heads are never expanded: the ``G = Hq / Hkv``
query heads of one K/V head are attended as ``G`` query rows of that head. The
partial results are merged with their log-sum-exp (the split-softmax merge of
FlashDecoding / FlashInfer's ``merge_state``: ``o = sum_i o_i exp(lse_i - m) /
sum_i exp(lse_i - m)``, ``m = max_i lse_i``). Requests whose longest run is the same
pool range (many questions about one image) attend to it in one call, their query
rows stacked (cascade attention in spirit).

An fp8 pool (``--kv-cache-dtype fp8_e4m3``) is read by both paths alike: the gathered
or viewed K/V are upcast to the queries' dtype (exact), the layer's ``k_scale`` is
folded into the softmax scale (``k_scale / sqrt(D)``) and ``v_scale`` multiplies the
output (attention is linear in V), so no scaled copy of the pages is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmserve.cache.kv_pool import KVPool, raw_bytes
from mmserve.kernels.backend import AttentionBackend
from mmserve.kernels.batch_invariant import attend_invariant, attend_invariant_decode
from mmserve.kernels.metadata import AttentionMetadata

#: CPU flash-attention kernel that also returns the log-sum-exp of each query row
#: (``[B, H, L_q]`` fp32, natural log): what merging partial attentions needs.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
#: Extends longer than this (prompt prefills) take the literal path: their compute
#: dwarfs any copy, and ``is_causal`` beats an explicit mask.
MAX_VIEW_EXTEND = 64
#: Contiguous runs shorter than this (tokens) are gathered instead of viewed: a view
#: costs one kernel call, a gathered token a 256-byte copy.
MIN_RUN = 32
#: At most this many runs per request are viewed (the longest ones); the rest is
#: gathered, so a fragmented pool costs one copy, not hundreds of kernel calls.
MAX_RUNS = 4


@dataclass
class _Chunk:
    """Part of one view-path request's K/V: slots ``[start, start + length)`` of the
    flat pool (a view), or gathered ``slots`` when ``start`` is None.

    ``rows``: the requests (indices into the view-path list) attending to it, several
    only for decode runs shared by several requests. ``mask``: bool ``[q_len, length]``,
    True where a key lies after the query's position; None when all keys are visible.
    """

    rows: list[int]
    start: int | None
    length: int
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    dead: bool = False  # some query row sees none of these keys


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Call :meth:`plan` once per batch, then :meth:`forward` once per layer.

    Args:
        views: take the view path (see the module docstring) for decode tokens and
            extends of at most :data:`MAX_VIEW_EXTEND` tokens when the pool is on CPU;
            False runs everything literally (the executable specification).
        deterministic: every request's rows attend through
            :func:`~mmserve.kernels.batch_invariant.attend_invariant` (fixed key blocks,
            no view path): a row's output is bit-identical however it was batched or
            chunked (``--deterministic``).
    """

    name = "torch"

    def __init__(self, views: bool = True, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        self.views = views and _FLASH is not None and not deterministic
        self._view_reqs: list[int] = []
        self._chunks: list[_Chunk] = []
        self._meta: AttentionMetadata | None = None
        self._slots: list[torch.Tensor] = []
        self._masks: list[torch.Tensor | None] = []
        self._decode_index: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._decode_rows: torch.Tensor | None = None
        self._loop: list[int] = []
        self._qo: list[int] = []
        self._scale: float | None = None  # softmax scale of this layer (None: 1/sqrt(D))

    def plan(self, meta: AttentionMetadata) -> None:
        """Precompute per-request slot indices and masks shared by every layer."""
        self._meta = meta
        host_qo, host_pages = meta.host_qo_indptr, meta.host_pages
        self._qo = (host_qo if host_qo is not None else meta.qo_indptr).tolist()
        P = meta.page_size
        kv_indptr = (host_pages[0] if host_pages is not None else meta.kv_indptr).tolist()
        offsets = torch.arange(P, device=meta.kv_indices.device, dtype=torch.int64)
        self._slots, self._masks = [], []
        for i, seq in enumerate(meta.seq_lens):
            pages = meta.kv_indices[kv_indptr[i] : kv_indptr[i + 1]].to(torch.int64)
            slots = (pages[:, None] * P + offsets[None, :]).reshape(-1)[:seq]
            self._slots.append(slots)
            q_len = meta.extend_lens[i]
            if q_len == 1 or q_len == seq:
                # one query sees everything; no prefix means plain causal (is_causal)
                self._masks.append(None)
            else:
                rows = torch.arange(q_len, device=slots.device)[:, None] + (seq - q_len)
                cols = torch.arange(seq, device=slots.device)[None, :]
                self._masks.append(cols <= rows)
        viewable = self.views and meta.kv_indices.device.type == "cpu"
        self._view_reqs = [
            i for i, q_len in enumerate(meta.extend_lens) if viewable and q_len <= MAX_VIEW_EXTEND
        ]
        self._chunks = self._plan_views(meta) if self._view_reqs else []
        # Requests with one new token (decode, also inside a mixed step) attend in one
        # padded batch instead of one SDPA call each.
        single = [i for i, q_len in enumerate(meta.extend_lens) if q_len == 1 and not viewable]
        if len(single) > 1:
            # Built where the slots live: on CUDA, filling a host tensor from device
            # slots would cost one synchronising copy per request.
            dev = meta.kv_indices.device
            lens_list = [meta.seq_lens[i] for i in single]
            max_len = max(lens_list)
            index = torch.zeros(len(single), max_len, dtype=torch.int64, device=dev)
            for row, i in enumerate(single):
                index[row, : meta.seq_lens[i]] = self._slots[i]
            lens = torch.tensor(lens_list, dtype=torch.int64, device=dev)
            mask = torch.arange(max_len, device=dev)[None, :] < lens[:, None]
            self._decode_index = index
            self._decode_mask = mask[:, None, None, :]  # [B1, 1, 1, L]
            self._decode_rows = torch.tensor([self._qo[i] for i in single], device=dev)
            self._loop = [i for i, q_len in enumerate(meta.extend_lens) if q_len != 1]
        else:
            self._decode_index = self._decode_mask = self._decode_rows = None
            self._loop = list(range(meta.batch_size))
        viewed = set(self._view_reqs)
        self._loop = [i for i in self._loop if i not in viewed]

    def _plan_views(self, meta: AttentionMetadata) -> list[_Chunk]:
        """Split each view-path request's slots into viewed runs and one gathered rest,
        with causal masks where a chunk holds keys after some query's position."""
        chunks: list[_Chunk] = []
        shared: dict[tuple[int, int], _Chunk] = {}  # decode runs by pool range
        decode_rest: list[tuple[int, torch.Tensor]] = []  # (row, slots) of decode rows
        self._masks_by_dtype: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        for row, i in enumerate(self._view_reqs):
            slots, seq, q_len = self._slots[i], meta.seq_lens[i], meta.extend_lens[i]
            # run boundaries as tensors: a scattered pool may give one run per slot, and
            # only the few longest ever become Python values
            breaks = torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1
            bounds = torch.cat([breaks.new_zeros(1), breaks, breaks.new_full((1,), seq)])
            lengths = bounds[1:] - bounds[:-1]
            top = torch.topk(lengths, min(MAX_RUNS, len(lengths))).indices
            top = top[lengths[top] >= MIN_RUN]
            long = sorted(zip(bounds[top].tolist(), bounds[top + 1].tolist(), strict=True))
            viewed = sum(hi - lo for lo, hi in long)
            rest = viewed < seq
            for lo, hi in long:
                start = int(slots[lo])
                mask = self._causal(lo, hi, seq, q_len, None)
                if q_len == 1:  # a decode query sees every key: share the call
                    chunk = shared.get((start, hi - lo))
                    if chunk is not None:
                        chunk.rows.append(row)
                        continue
                chunk = _Chunk([row], start, hi - lo, mask=mask)
                if q_len == 1:
                    shared[(start, hi - lo)] = chunk
                chunks.append(chunk)
            if rest:
                keep = torch.ones(seq, dtype=torch.bool)
                for lo, hi in long:
                    keep[lo:hi] = False
                pos = torch.nonzero(keep).flatten()
                idx = slots[pos]
                if q_len == 1:  # gathered for all decode rows together (forward)
                    decode_rest.append((row, idx))
                    continue
                mask = self._causal(0, 0, seq, q_len, pos)
                chunks.append(_Chunk([row], None, len(idx), slots=idx, mask=mask))
        for c in chunks:
            c.dead = c.mask is not None and bool(c.mask.all(1).any())
        self._rest_rows = [row for row, _ in decode_rest]
        is_decode = [meta.extend_lens[i] == 1 for i in self._view_reqs]
        # the order in which forward collects decode parts: chunks, then leftovers
        dec_rows = [r for c in chunks if is_decode[c.rows[0]] for r in c.rows] + self._rest_rows
        self._merge_plan = _MergePlan.build(dec_rows, len(self._view_reqs)) if dec_rows else None
        dec_view = [r for r, d in enumerate(is_decode) if d]
        self._dec_view_rows = torch.tensor(dec_view, dtype=torch.int64)
        self._dec_out_rows = torch.tensor(
            [self._qo[self._view_reqs[r]] for r in dec_view], dtype=torch.int64
        )
        # every request a view-path decode row, in order: the merge result is the output
        self._all_decode = len(dec_view) == meta.batch_size and len(dec_view) == len(
            self._view_reqs
        )
        # decode rows' leftover slots, padded to [R, width]: int64 index, bool valid
        self._rest_index: torch.Tensor | None = None
        self._rest_valid: torch.Tensor | None = None
        if decode_rest:
            width = max(len(idx) for _, idx in decode_rest)
            index = torch.zeros(len(decode_rest), width, dtype=torch.int64)
            valid = torch.zeros(len(decode_rest), width, dtype=torch.bool)
            for j, (_, idx) in enumerate(decode_rest):
                index[j, : len(idx)] = idx
                valid[j, : len(idx)] = True
            self._rest_index, self._rest_valid = index, valid
        return chunks

    def _causal(
        self, lo: int, hi: int, seq: int, q_len: int, pos: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Additive mask ``[q_len * G, keys]`` for keys at positions ``lo..hi`` (or
        ``pos``): query row ``r`` (position ``seq - q_len + r // G``) sees keys at or
        before it. None when every key is visible to every query."""
        last = (hi - 1) if pos is None else int(pos.max())
        if last <= seq - q_len:
            return None
        keys = torch.arange(lo, hi) if pos is None else pos
        queries = torch.arange(seq - q_len, seq)
        hidden = keys[None, :] > queries[:, None]  # [q_len, keys]
        return hidden  # expanded to G rows and the dtype in forward (G known there)

    def _attend(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, layer_id: int, pool: KVPool
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend._attend`; an fp8 pool's scales are applied as the
        module docstring says."""
        k_scale, v_scale = pool.scales(layer_id)
        self._scale = None if k_scale == 1.0 else k_scale / math.sqrt(q.shape[-1])
        out = self._attend_upcast(q, k_all, v_all)
        return out if v_scale == 1.0 else out * v_scale

    def _attend_upcast(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor
    ) -> torch.Tensor:
        """Attention over the pool's slots, K/V upcast to ``q``'s dtype, unscaled V."""
        if self.deterministic:
            return self._attend_invariant(q, k_all, v_all)
        if self._decode_index is not None and not self._loop and not self._view_reqs:
            return self._decode_batched(q, k_all, v_all, self._decode_index)
        out = torch.empty_like(q)
        if self._view_reqs:
            whole = self._attend_views(q, k_all, v_all, out)
            if whole is not None:  # a pure decode batch: nothing else to fill
                return whole
        if self._decode_index is not None:
            rows = self._decode_rows
            out[rows] = self._decode_batched(q[rows], k_all, v_all, self._decode_index)
        qo = self._qo
        for i in self._loop:
            slots = self._slots[i]
            # 4-D inputs: with 3-D ones CPU SDPA falls back to a ~3x slower generic path
            qi = q[qo[i] : qo[i + 1]].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            ki = _gather(k_all, slots).transpose(0, 1).to(q.dtype)[None]  # [1, Hkv, seq, D]
            vi = _gather(v_all, slots).transpose(0, 1).to(q.dtype)[None]
            mask = self._masks[i]
            causal = mask is None and qi.shape[2] > 1
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=causal, enable_gqa=True, scale=self._scale
            )
            out[qo[i] : qo[i + 1]] = oi[0].transpose(0, 1)
        return out

    def _attend_invariant(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor
    ) -> torch.Tensor:
        """Each request's rows through :func:`attend_invariant` (``--deterministic``); the
        decode rows of all requests through one :func:`attend_invariant_decode`."""
        meta, qo = self._meta, self._qo
        assert meta is not None  # planned
        out = torch.empty_like(q)
        decode: list[int] = []  # one new token: attended together, the same bits
        for i, slots in enumerate(self._slots):
            seq, q_len = meta.seq_lens[i], meta.extend_lens[i]
            if q_len == 1:
                decode.append(i)
                continue
            pos = torch.arange(seq - q_len, seq, device=q.device)
            ki = _gather(k_all, slots).to(q.dtype)
            vi = _gather(v_all, slots).to(q.dtype)
            rows = slice(qo[i], qo[i + 1])
            out[rows] = attend_invariant(q[rows], ki, vi, pos, self._scale)
        if decode:
            ks = [_gather(k_all, self._slots[i]).to(q.dtype) for i in decode]
            vs = [_gather(v_all, self._slots[i]).to(q.dtype) for i in decode]
            rows_t = torch.tensor([qo[i] for i in decode], device=q.device)
            out[rows_t] = attend_invariant_decode(q[rows_t], ks, vs, self._scale)
        return out

    def _float_mask(self, key: int, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``-inf`` mask in ``dtype`` from a bool ``hidden``, built once per batch
        (every layer reuses it; the CPU kernel takes no bool mask)."""
        mask = self._masks_by_dtype.get((key, dtype))
        if mask is None:
            mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
            self._masks_by_dtype[(key, dtype)] = mask
        return mask

    def _attend_views(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor | None:
        """The view path: fill ``out``'s rows of the view-path requests; for a batch of
        decode rows only, return the whole ``[T, Hq, D]`` output instead."""
        meta, qo, flash = self._meta, self._qo, _FLASH
        assert meta is not None and flash is not None  # planned, on the view path
        hq, hkv, d = q.shape[1], k_flat.shape[1], q.shape[2]
        g = hq // hkv
        # each request's queries as [Hkv, q_len * G, D]: G heads become G query rows
        queries = [
            q[qo[i] : qo[i + 1]].view(-1, hkv, g, d).transpose(0, 1).reshape(hkv, -1, d)
            for i in self._view_reqs
        ]
        decode = [meta.extend_lens[i] == 1 for i in self._view_reqs]
        # decode rows' parts, merged in one vectorised pass: [P, Hkv, G, D], [P, Hkv, G]
        dec_o: list[torch.Tensor] = []
        dec_lse: list[torch.Tensor] = []
        ext_o: list[torch.Tensor] = []  # extend rows' parts, merged per request
        ext_lse: list[torch.Tensor] = []
        ext_rows: list[int] = []
        for n_chunk, c in enumerate(self._chunks):
            if c.start is not None:
                kc = k_flat[c.start : c.start + c.length].transpose(0, 1)  # [Hkv, L, D] view
                vc = v_flat[c.start : c.start + c.length].transpose(0, 1)
            else:
                assert c.slots is not None  # a chunk without a start is gathered
                kc = _gather(k_flat, c.slots).transpose(0, 1)
                vc = _gather(v_flat, c.slots).transpose(0, 1)
            qc = (
                queries[c.rows[0]]
                if len(c.rows) == 1
                else torch.cat([queries[r] for r in c.rows], 1)
            )
            mask = None
            if c.mask is not None:  # [q_len, L] -> [q_len * G, L]
                mask = self._float_mask(n_chunk, c.mask.repeat_interleave(g, dim=0), q.dtype)
            kc, vc = kc[None].to(q.dtype), vc[None].to(q.dtype)
            o, lse = flash(qc[None], kc, vc, attn_mask=mask, scale=self._scale)
            if c.dead:
                # rows that see no key of this chunk: it must weigh nothing in the merge
                assert c.mask is not None  # a dead row is a masked one
                dead = c.mask.all(1).repeat_interleave(g)  # [q_len * G]
                lse = lse.masked_fill(dead, float("-inf"))
                o = o.masked_fill(dead[:, None], 0.0)
            if decode[c.rows[0]]:  # every row of a decode chunk is a decode row
                dec_o.append(o[0].view(hkv, len(c.rows), g, d).transpose(0, 1))
                dec_lse.append(lse[0].view(hkv, len(c.rows), g).transpose(0, 1))
            else:
                ext_o.append(o[0])
                ext_lse.append(lse[0])
                ext_rows.append(c.rows[0])
        rest_index, rest_valid = self._rest_index, self._rest_valid  # set together
        if rest_index is not None and rest_valid is not None:  # decode rows' leftovers
            kb = _gather(k_flat, rest_index).permute(0, 2, 1, 3).to(q.dtype)
            vb = _gather(v_flat, rest_index).permute(0, 2, 1, 3).to(q.dtype)
            qb = torch.stack([queries[r] for r in self._rest_rows])  # [B, Hkv, G, D]
            mask = self._masks_by_dtype.get((-1, q.dtype))
            if mask is None:
                mask = self._float_mask(-1, ~rest_valid[:, None, None, :], q.dtype)
            o, lse = flash(qb, kb, vb, attn_mask=mask, scale=self._scale)
            dec_o.append(o)
            dec_lse.append(lse)
        if self._merge_plan is not None:
            merged = _merge_rows(dec_o, dec_lse, self._merge_plan)  # [n, Hkv, G, D]
            if self._all_decode:
                return merged.reshape(-1, hq, d)
            rows = merged[self._dec_view_rows].reshape(-1, hq, d)
            out.index_copy_(0, self._dec_out_rows, rows)
        if ext_rows:
            by_row = _merge(ext_o, ext_lse, ext_rows, len(self._view_reqs))
            for r, i in enumerate(self._view_reqs):
                if not decode[r]:
                    part = by_row[r]
                    assert part is not None  # an extend row has parts (only decode rows: None)
                    q_len = meta.extend_lens[i]
                    o = part.view(hkv, q_len, g, d).transpose(0, 1)
                    out[qo[i] : qo[i + 1]] = o.reshape(q_len, hq, d)
        return None

    def _decode_batched(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        # One padded gather for the whole decode batch instead of B small calls
        # (idx: the planned _decode_index).
        kb = _gather(k_flat, idx).permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, L, D]
        vb = _gather(v_flat, idx).permute(0, 2, 1, 3).to(q.dtype)
        qb = q[:, :, None, :]  # [B, Hq, 1, D]
        ob = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=self._decode_mask, enable_gqa=True, scale=self._scale
        )
        return ob[:, :, 0, :]


@dataclass
class _MergePlan:
    """Where each decode part goes in :func:`_merge_rows`, computed once per batch.

    ``rows``/``slots``: int64 ``[P]`` request row and slot (its rank among its row's
    parts) of each part; ``k``: most parts of one row; ``n``: rows; ``identity``: part
    ``j`` is row ``j``'s only part (no merge at all).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    k: int
    n: int
    identity: bool

    @classmethod
    def build(cls, rows: list[int], n: int) -> _MergePlan:
        count = [0] * n
        slots = []
        for r in rows:
            slots.append(count[r])
            count[r] += 1
        identity = rows == list(range(n))
        return cls(torch.tensor(rows), torch.tensor(slots), max(count), n, identity)


def _merge_rows(
    outs: list[torch.Tensor], lses: list[torch.Tensor], plan: _MergePlan
) -> torch.Tensor:
    """Merge decode rows' partial attentions by log-sum-exp in one vectorised pass.

    Args:
        outs: partial outputs, each ``[P_i, Hkv, G, D]``, in ``plan``'s part order.
        lses: their fp32 log-sum-exps ``[P_i, Hkv, G]``.
        plan: the parts' rows and slots (:class:`_MergePlan`).

    Returns:
        ``[n, Hkv, G, D]`` in the outputs' dtype; a row with a single part gets it exactly
        (a row without parts holds no meaningful value).
    """
    o = torch.cat(outs) if len(outs) > 1 else outs[0]
    if plan.identity:  # one part per row, in row order: nothing to merge
        return o
    lse = torch.cat(lses) if len(lses) > 1 else lses[0]
    # Dense [K, n, ...] with part k of each row in slot k (index_put, not index_add:
    # CPU scatter-add stalls badly with several threads), then softmax over K.
    where = (plan.slots, plan.rows)
    dense_lse = torch.full((plan.k, plan.n, *lse.shape[1:]), float("-inf"))
    dense_lse[where] = lse
    dense_o = torch.zeros((plan.k, plan.n, *o.shape[1:]))
    dense_o[where] = o.float()
    w = torch.softmax(dense_lse, dim=0)  # exp(lse_i - logsumexp_i lse_i); NaN for empty rows
    return (dense_o * w[..., None]).sum(0).to(o.dtype)


def _merge(
    outs: list[torch.Tensor], lses: list[torch.Tensor], rows: list[int], n: int
) -> list[torch.Tensor | None]:
    """Merge partial attentions of ``n`` requests by log-sum-exp.

    Args:
        outs: partial outputs ``[Hkv, M, D]`` (each over a disjoint part of its request's keys).
        lses: their fp32 log-sum-exps ``[Hkv, M]``.
        rows: the request of each part.
        n: number of requests.

    Returns:
        Per request ``[Hkv, M, D]`` in the outputs' dtype (None for a request without
        parts); a request with one part gets it unchanged.
    """
    by_row: list[list[int]] = [[] for _ in range(n)]
    for j, r in enumerate(rows):
        by_row[r].append(j)
    merged: list[torch.Tensor | None] = []
    for parts in by_row:
        if not parts:  # a row merged elsewhere (decode)
            merged.append(None)
            continue
        if len(parts) == 1:
            merged.append(outs[parts[0]])
            continue
        lse = torch.stack([lses[j] for j in parts])  # [P, Hkv, M]
        w = torch.softmax(lse, dim=0)  # exp(lse_i - logsumexp_i lse_i)
        o = torch.stack([outs[j] for j in parts]).float()  # [P, Hkv, M, D]
        merged.append((o * w[..., None]).sum(0).to(outs[parts[0]].dtype))
    return merged


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` (any shape) of a ``[S, Hkv, D]`` slot view -> ``[*slots.shape, Hkv, D]``.

    ``index_select`` over 2-D rows is 5-10x faster on CPU than advanced indexing
    of the 3-D view, and gathering K/V is most of the decode step's attention time.
    """
    rows = raw_bytes(flat.view(flat.shape[0], -1))  # fp8 pages are gathered as bytes
    out = torch.index_select(rows, 0, slots.reshape(-1)).view(flat.dtype)
    return out.view(*slots.shape, *flat.shape[1:])
