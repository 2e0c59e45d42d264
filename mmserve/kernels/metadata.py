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

    @property
    def batch_size(self) -> int:
        """Number of requests in the batch."""
        return len(self.seq_lens)


def build_metadata(
    page_tables: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    page_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build the metadata for a batch of requests.

    Args:
        page_tables: per request, its page ids covering at least
            ``prefix_len + extend_len`` tokens (extra trailing pages are ignored): a
            :class:`~mmserve.cache.page_table.PageTable` (its tensor is used as is, no
            Python loop over pages) or a sequence of ints.
        prefix_lens: per request, tokens whose K/V is already in the pool.
        extend_lens: per request, new tokens computed this step (>= 1).
        page_size: tokens per page ``P`` (>= 1).
        device: where the index tensors live.

    Returns:
        An :class:`AttentionMetadata`.

    Raises:
        ValueError: on mismatched lengths, an empty extend, or a page table too
            short for ``prefix_len + extend_len`` tokens.
    """
    if not (len(page_tables) == len(prefix_lens) == len(extend_lens)):
        raise ValueError("page_tables, prefix_lens and extend_lens differ in length")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    qo_indptr, kv_indptr, last_len = [0], [0], []
    chunks: list[torch.Tensor] = []  # each request's used page ids, int32
    locs: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    seq_lens = []
    for pages, prefix, extend in zip(page_tables, prefix_lens, extend_lens, strict=True):
        if extend < 1 or prefix < 0:
            raise ValueError(f"bad lengths: prefix {prefix}, extend {extend}")
        seq = prefix + extend
        n_pages = -(-seq // page_size)
        if len(pages) < n_pages:
            raise ValueError(f"{seq} tokens need {n_pages} pages, page table has {len(pages)}")
        # a PageTable hands over a view; a list is converted (tests, other callers)
        used = (
            pages.tensor(n_pages)
            if hasattr(pages, "tensor")
            else torch.tensor(list(pages[:n_pages]), dtype=torch.int32)
        ).to(device=device, dtype=torch.int32)
        chunks.append(used)
        kv_indptr.append(kv_indptr[-1] + n_pages)
        qo_indptr.append(qo_indptr[-1] + extend)
        last_len.append(seq - (n_pages - 1) * page_size)
        pos = torch.arange(prefix, seq, dtype=torch.int64, device=device)
        locs.append(used[pos // page_size].to(torch.int64) * page_size + pos % page_size)
        positions.append(pos)
        seq_lens.append(seq)

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    return AttentionMetadata(
        qo_indptr=i32(qo_indptr),
        kv_indptr=i32(kv_indptr),
        kv_indices=torch.cat(chunks),
        kv_last_page_len=i32(last_len),
        page_size=page_size,
        out_cache_loc=torch.cat(locs),
        positions=torch.cat(positions),
        seq_lens=seq_lens,
        extend_lens=list(extend_lens),
        is_decode=all(e == 1 for e in extend_lens),
    )
