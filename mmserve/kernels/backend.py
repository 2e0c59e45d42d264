"""The interface every attention backend implements, and the step they all share.

A backend is planned once per batch (:meth:`AttentionBackend.plan`, which keeps the
batch's :class:`~mmserve.kernels.metadata.AttentionMetadata`) and then called once per
decoder layer (:meth:`AttentionBackend.forward`). ``forward`` is written once, here:
check the pool, write the new tokens' K/V through :meth:`KVPool.write_kv` (the only place
the pool is written), then let the backend attend (:meth:`AttentionBackend._attend`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.kernels.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over the KV pool: :meth:`plan` once per batch, then :meth:`forward`
    once per layer.

    Subclasses implement :meth:`plan` (setting ``_meta``) and :meth:`_attend`, and may
    refuse a pool in :meth:`_check_pool`.

    Attributes:
        name: the backend's ``--attention-backend`` name.
        captures_graphs: whether a padded decode batch planned by :meth:`plan_padded`
            can be captured in a CUDA graph (its kernels read only fixed-address buffers).
        deterministic: batch-invariant attention (``--deterministic``); the decoder then
            also runs its row-parallel linears in fixed splits.
    """

    name: ClassVar[str]
    captures_graphs: ClassVar[bool] = False
    deterministic: bool = False
    _meta: AttentionMetadata | None = None

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare for one batch (index tensors on this backend's device); every layer
        reuses the plan."""

    def plan_padded(self, meta: AttentionMetadata) -> None:
        """Plan a padded decode batch whose tensors are views of the fixed-address buffers
        of :class:`~mmserve.kernels.metadata.PaddedDecodeBuffers` (one batch size per
        bucket). Default: :meth:`plan`, which an eager forward needs (the CPU twin)."""
        self.plan(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        pool: KVPool,
    ) -> torch.Tensor:
        """Write the new K/V into the pool, then attend over each request's pages.

        Args:
            q: ``[T, Hq, D]`` queries of the batch's new tokens (packed by ``qo_indptr``).
            k, v: ``[T, Hkv, D]`` keys/values of the same tokens.
            layer_id: decoder layer index into the pool.
            pool: the KV pool (pages ``[num_pages, P, Hkv, D]`` per layer).

        Returns:
            ``[T, Hq, D]`` attention output, same dtype as ``q``.

        Raises:
            ValueError: a pool this backend cannot read (see :meth:`_check_pool`); nothing
                is written then.
        """
        meta = self._meta
        assert meta is not None, "plan() must be called before forward()"
        self._check_pool(layer_id, pool)
        k_flat, v_flat = pool.write_kv(layer_id, meta.out_cache_loc, k, v)
        return self._attend(q, k_flat, v_flat, layer_id, pool)

    def _check_pool(self, layer_id: int, pool: KVPool) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` for a pool this backend cannot read (default: any pool)."""

    @abstractmethod
    def _attend(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, layer_id: int, pool: KVPool
    ) -> torch.Tensor:
        """Attention of ``q`` ``[T, Hq, D]`` over the planned pages, the new K/V written;
        ``k_all``, ``v_all``: the layer's whole pool as slots ``[num_pages * P, Hkv, D]``
        (:meth:`KVPool.flat_kv`). Returns ``[T, Hq, D]`` in ``q``'s dtype."""
