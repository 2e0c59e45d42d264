"""Per-batch attention metadata in FlashInfer's paged-KV layout.

Both attention backends consume the same :class:`AttentionMetadata`; the torch
backend is the executable specification of the layout, the FlashInfer backend
hands the same arrays to its wrappers. The layout (FlashInfer docs, "Page
Table Layout"): request ``i`` owns the pages
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, every page but the last is full,
and the last holds ``kv_last_page_len[i]`` tokens. Its new (query) tokens are
rows ``qo_indptr[i]:qo_indptr[i+1]`` of the packed query tensor and are the
*last* tokens of its KV sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Paged-attention description of one forward batch.

    Attributes:
        qo_indptr: int32 ``[B + 1]``; query rows of request ``i`` (tokens).
        kv_indptr: int32 ``[B + 1]``; offsets into ``kv_indices`` (pages).
        kv_indices: int32 ``[total_pages]``; page ids of every request, in order.
        kv_last_page_len: int32 ``[B]``; tokens in each request's last page, in 1..P.
        page_size: tokens per page ``P``.
        out_cache_loc: int64 ``[T]``; flat slot ``page * P + offset`` where each new
            token's K/V is written (``T = qo_indptr[-1]``).
        positions: int64 ``[T]``; absolute position of each new token (for RoPE).
        seq_lens: Python list of each request's KV length after this step (tokens).
        extend_lens: Python list of each request's new tokens (tokens).
        is_decode: True when every request has exactly one new token.
        host_pages: None, or CPU copies ``(kv_indptr, kv_last_page_len)`` (of a padded
            decode batch's fixed-address buffers, :class:`PaddedDecodeBuffers`, or of
            :func:`build_metadata`'s host buffer), which a planner reads instead of
            copying the device tensors back (a sync).
        host_qo_indptr: None, or a CPU copy of ``qo_indptr`` (:func:`build_metadata`).
        logit_rows: None, or int64 ``[B]``: each request's last new token's row
            (``qo_indptr[1:] - 1``), on the device (:func:`build_metadata`).
        input_ids: None, or int64 ``[T]``: the new tokens' ids, on the device, when
            :func:`build_metadata` was given them.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    seq_lens: list[int]
    extend_lens: list[int]
    is_decode: bool
    host_pages: tuple[torch.Tensor, torch.Tensor] | None = None
    host_qo_indptr: torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Number of requests in the batch."""
        return len(self.seq_lens)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: the one host-to-device copy of a step's index arrays
    (asynchronous: ``host`` is page-locked on CUDA); ``host`` itself on the CPU. Every
    eager step's copies go through here (tests count them)."""
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)


def build_metadata(
    page_tables: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    page_size: int,
    device: torch.device | str = "cpu",
    token_ids: Sequence[int] | None = None,
) -> AttentionMetadata:
    """Build the metadata for a batch of requests.

    Every array is built on the host in one buffer (page-locked on CUDA; the int32
    arrays packed two to an int64 word) and copied to ``device`` once
    (:func:`to_device`, asynchronous): no per-request copy, no dtype conversion and no
    synchronization. The host views stay in the metadata
    (:attr:`~AttentionMetadata.host_pages`, :attr:`~AttentionMetadata.host_qo_indptr`)
    for planners that read the page table on the host.

    Args:
        page_tables: per request, its page ids covering at least
            ``prefix_len + extend_len`` tokens (extra trailing pages are ignored): a
            :class:`~mmserve.cache.page_table.PageTable` (its tensor is used as is, no
            Python loop over pages) or a sequence of ints.
        prefix_lens: per request, tokens whose K/V is already in the pool.
        extend_lens: per request, new tokens computed this step (>= 1).
        page_size: tokens per page ``P`` (>= 1).
        device: where the index tensors live.
        token_ids: the batch's new token ids (``sum(extend_lens)``), carried in the same
            copy as :attr:`~AttentionMetadata.input_ids`; None: not carried.

    Returns:
        An :class:`AttentionMetadata`.

    Raises:
        ValueError: on mismatched lengths, an empty extend, a page table too short for
            ``prefix_len + extend_len`` tokens, or ``token_ids`` of another length.
    """
    if not (len(page_tables) == len(prefix_lens) == len(extend_lens)):
        raise ValueError("page_tables, prefix_lens and extend_lens differ in length")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    device = torch.device(device)
    B = len(extend_lens)
    n_pages_of, seq_lens = [], []
    for pages, prefix, extend in zip(page_tables, prefix_lens, extend_lens, strict=True):
        if extend < 1 or prefix < 0:
            raise ValueError(f"bad lengths: prefix {prefix}, extend {extend}")
        seq = prefix + extend
        n_pages = -(-seq // page_size)
        if len(pages) < n_pages:
            raise ValueError(f"{seq} tokens need {n_pages} pages, page table has {len(pages)}")
        n_pages_of.append(n_pages)
        seq_lens.append(seq)
    T, N = sum(extend_lens), sum(n_pages_of)
    if token_ids is not None and len(token_ids) != T:
        raise ValueError(f"{len(token_ids)} token ids for {T} new tokens")
    # one host buffer, int64; its first words hold the int32 arrays two to a word:
    # qo_indptr | kv_indptr | last_page_len | kv_indices, then (int64) logit rows |
    # out_cache_loc | positions | token ids (64-bit: image pseudo-token ids are hashes)
    n32 = [B + 1, B + 1, B, N]
    n64 = [B, T, T, T if token_ids is not None else 0]
    words32 = -(-sum(n32) // 2)
    host = torch.empty(words32 + sum(n64), dtype=torch.int64, pin_memory=device.type == "cuda")

    def split(buf: torch.Tensor) -> list[torch.Tensor]:
        flat32 = buf[:words32].view(torch.int32)
        out, at = [], 0
        for n in n32:
            out.append(flat32[at : at + n])
            at += n
        at = words32
        for n in n64:
            out.append(buf[at : at + n])
            at += n
        return out

    qo, kv_ptr, last, indices, rows, loc, pos, ids = split(host)
    n_pages_t = torch.tensor(n_pages_of, dtype=torch.int32)
    qo[0], kv_ptr[0] = 0, 0
    torch.cumsum(torch.tensor(list(extend_lens), dtype=torch.int32), 0, out=qo[1:])
    torch.cumsum(n_pages_t, 0, out=kv_ptr[1:])
    last.copy_(torch.tensor(seq_lens, dtype=torch.int32) - (n_pages_t - 1) * page_size)
    rows.copy_(qo[1:] - 1)  # each request's last new token
    off = 0
    for i, (pages, n_pages) in enumerate(zip(page_tables, n_pages_of, strict=True)):
        # a PageTable hands over a view; a list is converted (tests, other callers)
        indices[off : off + n_pages] = (
            pages.tensor(n_pages)
            if hasattr(pages, "tensor")
            else torch.tensor(list(pages[:n_pages]), dtype=torch.int32)
        )
        q0, q1 = int(qo[i]), int(qo[i + 1])
        p = pos[q0:q1]
        torch.arange(seq_lens[i] - (q1 - q0), seq_lens[i], dtype=torch.int64, out=p)
        # slot of each new token: its page (among this request's) * P + offset in it
        page_of = indices[off + torch.div(p, page_size, rounding_mode="floor")]
        loc[q0:q1] = page_of.to(torch.int64) * page_size + p % page_size
        off += n_pages
    if token_ids is not None:
        ids.copy_(torch.tensor(list(token_ids), dtype=torch.int64))
    d = split(to_device(host, device))
    return AttentionMetadata(
        qo_indptr=d[0],
        kv_indptr=d[1],
        kv_indices=d[3],
        kv_last_page_len=d[2],
        page_size=page_size,
        out_cache_loc=d[5],
        positions=d[6],
        seq_lens=seq_lens,
        extend_lens=list(extend_lens),
        is_decode=all(e == 1 for e in extend_lens),
        host_pages=(kv_ptr, last),
        host_qo_indptr=qo,
        logit_rows=d[4],
        input_ids=d[7] if token_ids is not None else None,
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PaddedDecodeBuffers:
    """Fixed-address inputs of a decode batch padded to ``bucket`` rows: what a captured
    CUDA graph reads (token ids, positions, K/V slots, page table), refilled before each
    replay; on the CPU the same buffers feed an eager forward (the CPU twin).

    Row ``i < B`` is request ``i``'s one new token; padding rows ``B..bucket-1`` are
    one-token sequences on ``scratch_page`` (token id 0, position 0), so the K/V they
    write lands on a page no request or tree node owns. Filling is done in host buffers
    (pinned on CUDA) and copied to the device without a sync: the caller must not refill
    before the previous batch's copies ran (the engine syncs once per step, at sampling).

    Args:
        max_bs: largest bucket (rows).
        max_pages: most pages one request may hold (``ceil(max context / P)``).
        page_size: tokens per page ``P``.
        scratch_page: the pool's page that padding rows write
            (:attr:`~mmserve.cache.kv_pool.KVPool.scratch_page`).
        device: where the static buffers live.

    Attributes:
        input_ids, positions, out_cache_loc: int64 ``[max_bs]`` (device).
        kv_indptr: int32 ``[max_bs + 1]``; kv_indices: int32 ``[max_bs * max_pages]``;
            kv_last_page_len: int32 ``[max_bs]``; qo_indptr: int32 ``[max_bs + 1]``
            (``0..max_bs``); logit_rows: int64 ``[max_bs]`` (``0..max_bs-1``): device.
    """

    def __init__(
        self,
        max_bs: int,
        max_pages: int,
        page_size: int,
        scratch_page: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.max_bs, self.max_pages, self.page_size = max_bs, max_pages, page_size
        self.scratch_page = scratch_page
        dev = self.device
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=i64, device=dev)
        self.out_cache_loc = torch.zeros(max_bs, dtype=i64, device=dev)
        self.kv_indptr = torch.arange(max_bs + 1, dtype=i32, device=dev)
        self.kv_indices = torch.full((max_bs * max_pages,), scratch_page, dtype=i32, device=dev)
        self.kv_last_page_len = torch.ones(max_bs, dtype=i32, device=dev)
        self.qo_indptr = torch.arange(max_bs + 1, dtype=i32, device=dev)
        self.logit_rows = torch.arange(max_bs, dtype=i64, device=dev)
        self._host: tuple[torch.Tensor, ...]
        if dev.type == "cpu":  # no staging: the host buffers are the static ones
            self._host = (self.input_ids, self.positions, self.out_cache_loc, self.kv_indptr,
                          self.kv_indices, self.kv_last_page_len)  # fmt: skip
        else:
            pin = dev.type == "cuda"
            # zeros, not empty: fill() never writes kv_indptr[0], which must stay 0
            self._host = tuple(
                torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin)
                for t in (self.input_ids, self.positions, self.out_cache_loc, self.kv_indptr,
                          self.kv_indices, self.kv_last_page_len)
            )  # fmt: skip

    def fill(
        self,
        page_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        token_ids: Sequence[int],
        bucket: int,
    ) -> AttentionMetadata:
        """Write one decode batch, padded to ``bucket`` rows, into the static buffers.

        Args:
            page_tables: per request, its pages (a
                :class:`~mmserve.cache.page_table.PageTable` or ints), covering ``seq_len``.
            seq_lens: per request, its KV length after this step (the new token included).
            token_ids: per request, the token whose K/V this step computes.
            bucket: rows of the padded batch (``len(seq_lens) <= bucket <= max_bs``).

        Returns:
            The padded batch's :class:`AttentionMetadata`: views of the static buffers
            (``bucket`` rows; ``seq_lens`` holds 1 for each padding row) with
            :attr:`~AttentionMetadata.host_pages` set.

        Raises:
            ValueError: more requests than ``bucket``, a bucket over ``max_bs``, a request
                over ``max_pages`` pages or a page table too short.
        """
        n = len(seq_lens)
        if not (len(page_tables) == n == len(token_ids)) or not n <= bucket <= self.max_bs:
            raise ValueError(f"{n} requests do not fit a bucket of {bucket} (max {self.max_bs})")
        P = self.page_size
        ids, pos, loc, indptr, indices, last = self._host
        indptr[0] = 0
        off = 0
        for i, (pages, seq) in enumerate(zip(page_tables, seq_lens, strict=True)):
            k = _ceil_div(seq, P)
            if k > self.max_pages or len(pages) < k:
                raise ValueError(
                    f"{seq} tokens need {k} pages; have {len(pages)}, max {self.max_pages}"
                )
            used = pages.tensor(k) if hasattr(pages, "tensor") else torch.tensor(list(pages[:k]))
            indices[off : off + k] = used
            off += k
            indptr[i + 1] = off
        pad = bucket - n
        indices[off : off + pad] = self.scratch_page
        indptr[n + 1 : bucket + 1] = torch.arange(off + 1, off + pad + 1, dtype=torch.int32)
        total = off + pad
        seqs = torch.tensor(list(seq_lens), dtype=torch.int64)
        last[:n] = (seqs - (seqs - 1) // P * P).to(torch.int32)
        last[n:bucket] = 1
        pos[:n] = seqs - 1
        pos[n:bucket] = 0
        tail = indices[indptr[1 : n + 1].to(torch.int64) - 1].to(torch.int64)  # last pages
        loc[:n] = tail * P + (seqs - 1) % P
        loc[n:bucket] = self.scratch_page * P
        ids[:n] = torch.tensor(list(token_ids), dtype=torch.int64)
        ids[n:bucket] = 0
        if self._host[0] is not self.input_ids:  # staged: one async copy per buffer
            for dst, src, m in zip(
                (self.input_ids, self.positions, self.out_cache_loc, self.kv_indptr,
                 self.kv_indices, self.kv_last_page_len),
                self._host,
                (bucket, bucket, bucket, bucket + 1, total, bucket),
                strict=True,
            ):  # fmt: skip
                dst[:m].copy_(src[:m], non_blocking=True)
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[: bucket + 1],
            kv_indptr=self.kv_indptr[: bucket + 1],
            kv_indices=self.kv_indices[:total],
            kv_last_page_len=self.kv_last_page_len[:bucket],
            page_size=P,
            out_cache_loc=self.out_cache_loc[:bucket],
            positions=self.positions[:bucket],
            seq_lens=[*seq_lens, *([1] * pad)],
            extend_lens=[1] * bucket,
            is_decode=True,
            host_pages=(indptr[: bucket + 1], last[:bucket]),
        )
