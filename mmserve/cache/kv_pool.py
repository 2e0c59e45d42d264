"""Paged K/V buffers shared by the radix cache and running requests.

Each layer has one K and one V buffer in FlashInfer's paged layout
``[num_pages, page_size, num_kv_heads, head_dim]`` (the "NHD" layout). Which
pages are free is tracked by a :class:`~mmserve.cache.page_allocator.PageAllocator`;
pages not free are owned either by the radix tree or by a running request.
"""

from __future__ import annotations

import torch

from mmserve.cache.page_allocator import PageAllocator


class KVPool:
    """K/V page buffers for every decoder layer plus their page allocator.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page ``P``.
        num_layers: decoder layers.
        num_kv_heads: K/V heads per layer.
        head_dim: dimension per head.
        dtype: buffer dtype (fp32 on CPU; bf16/fp16 on GPU).
        device: buffer device.

    Raises:
        ValueError: if ``num_pages`` or ``page_size`` is < 1.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1 ({num_pages}, {page_size})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = PageAllocator(num_pages)

    @property
    def size_tokens(self) -> int:
        """Capacity in tokens (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    def flat_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of layer ``layer_id``'s K and V as ``[num_pages * P, Hkv, D]`` slots."""
        k = self.k_buffers[layer_id]
        v = self.v_buffers[layer_id]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write_kv(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new tokens' K/V: the one place any backend writes the pool.

        Args:
            layer_id: decoder layer.
            loc: ``[T]`` int64 flat slots (``page * page_size + offset``).
            k, v: ``[T, Hkv, D]``; cast to the pool's dtype.

        Returns:
            The layer's flat ``(K, V)`` views ``[num_pages * P, Hkv, D]``.
        """
        k_flat, v_flat = self.flat_kv(layer_id)
        k_flat[loc] = k.to(k_flat.dtype)
        v_flat[loc] = v.to(v_flat.dtype)
        return k_flat, v_flat

    def bytes_per_token(self) -> int:
        """K+V bytes one token occupies across all layers."""
        k = self.k_buffers[0]
        return 2 * self.num_layers * k.shape[2] * k.shape[3] * k.element_size()

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """Copy whole pages out of the pool (for the host and disk tiers).

        Args:
            pages: page ids.

        Returns:
            ``[len(pages), 2, num_layers, P, Hkv, D]`` (K then V), a new tensor on the pool's
            device and dtype.
        """
        idx = torch.tensor(pages, dtype=torch.long, device=self.k_buffers[0].device)
        k = torch.stack([b.index_select(0, idx) for b in self.k_buffers], dim=1)
        v = torch.stack([b.index_select(0, idx) for b in self.v_buffers], dim=1)
        return torch.stack([k, v], dim=1)

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """Load whole pages into the pool: the tiers' counterpart of :meth:`write_kv`
        (which writes new tokens' K/V during a forward).

        Args:
            pages: page ids (owned by the caller, not yet in the tree).
            kv: ``[len(pages), 2, num_layers, P, Hkv, D]`` on any device; cast to the pool's
                dtype.
        """
        dev = self.k_buffers[0].device
        idx = torch.tensor(pages, dtype=torch.long, device=dev)
        kv = kv.to(dev, non_blocking=True)
        kv = kv.to(self.k_buffers[0].dtype)
        for layer in range(self.num_layers):
            self.k_buffers[layer].index_copy_(0, idx, kv[:, 0, layer])
            self.v_buffers[layer].index_copy_(0, idx, kv[:, 1, layer])
