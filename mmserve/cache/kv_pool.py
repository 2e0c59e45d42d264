"""Paged K/V buffers shared by the radix cache and running requests.

Each layer has one K and one V buffer in FlashInfer's paged layout
``[num_pages, page_size, num_kv_heads, head_dim]`` (the "NHD" layout). Which
pages are free is tracked by a :class:`~mmserve.cache.page_allocator.PageAllocator`;
pages not free are owned either by the radix tree or by a running request. One more
page, :attr:`KVPool.scratch_page`, lies past the allocator's range: no request or tree
node ever owns it, and the padding rows of a padded decode batch (the CUDA-graph
runner's, :mod:`mmserve.engine.cuda_graph`) write their K/V there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmserve.cache.page_allocator import PageAllocator

if TYPE_CHECKING:
    from mmserve.config import EngineConfig

log = logging.getLogger(__name__)


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
        #: how :meth:`for_model` sized the pool (None when built directly)
        self.plan: PoolPlan | None = None
        #: page id past the allocator's range, owned by no request (padding rows write it)
        self.scratch_page = num_pages
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = PageAllocator(num_pages)

    @classmethod
    def for_model(cls, config: EngineConfig, shape: object, dtype: torch.dtype) -> KVPool:
        """The pool of an engine: sized by :func:`plan_pool` for the decoder ``shape``
        (a :class:`~mmserve.model.llama.LlamaShape`) in ``dtype``, after the weights are
        loaded; logs the dtype (and why, for ``--dtype auto``), tokens and bytes, and keeps
        the :class:`PoolPlan` as ``pool.plan`` (for ``mmserve serve``'s start-up summary).

        Raises:
            ValueError: as :func:`plan_pool`.
        """
        from mmserve.config import auto_dtype

        bpt = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype)
        plan = plan_pool(config, bpt, shape.max_position_embeddings)
        why = f"auto: {auto_dtype(config.device)[1]}" if config.dtype == "auto" else "--dtype"
        log.info(
            "dtype %s (%s); KV pool %d tokens, %.1f MiB (%d bytes per token), sized by %s",
            str(dtype).removeprefix("torch."), why, plan.tokens, plan.bytes / 2**20, bpt,
            plan.reason,
        )  # fmt: skip
        pool = cls(
            plan.tokens // config.page_size,
            config.page_size,
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_dim,
            dtype=dtype,
            device=config.device,
        )
        pool.plan = plan  # for the start-up summary: where the size came from
        return pool

    @property
    def size_tokens(self) -> int:
        """Capacity in tokens (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    def flat_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of layer ``layer_id``'s K and V as ``[(num_pages + 1) * P, Hkv, D]`` slots
        (the last page is :attr:`scratch_page`)."""
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
            The layer's flat ``(K, V)`` views ``[(num_pages + 1) * P, Hkv, D]``.
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


@dataclass
class PoolPlan:
    """How many tokens the KV pool holds, and why.

    Attributes:
        tokens: capacity in tokens (whole pages).
        bytes_per_token: K+V bytes of one token over all layers.
        reason: what decided it, for the start-up log.
    """

    tokens: int
    bytes_per_token: int
    reason: str

    @property
    def bytes(self) -> int:
        """Pool size in bytes."""
        return self.tokens * self.bytes_per_token


def device_memory(device: str) -> tuple[int, int]:
    """``(available, total)`` bytes of ``device``'s memory now: on CUDA
    ``torch.cuda.mem_get_info``; on CPU ``MemAvailable`` and ``MemTotal`` of
    ``/proc/meminfo``.

    Raises:
        RuntimeError: when the CPU figures cannot be read (not Linux).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return int(free), int(total)
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    info[name] = int(rest.split()[0]) * 1024  # kB
    except OSError as e:
        raise RuntimeError(f"cannot read /proc/meminfo to size the KV pool: {e}") from None
    if len(info) < 2:
        raise RuntimeError("/proc/meminfo has no MemAvailable/MemTotal to size the KV pool")
    return info["MemAvailable"], info["MemTotal"]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_pool(
    config: EngineConfig,
    bytes_per_token: int,
    max_context: int,
    memory: tuple[int, int] | None = None,
) -> PoolPlan:
    """Size the KV pool, after the weights are loaded.

    In order: an explicit ``config.max_total_tokens``; ``config.kv_cache_memory`` bytes;
    ``config.mem_fraction_static`` of the device's total memory minus what is already
    used (SGLang's rule: ``available - total x (1 - fraction)``, measured after loading
    the weights, so the weights count against the fraction); else
    :data:`~mmserve.config.DEFAULT_MAX_TOTAL_TOKENS`. Rounded down to whole pages.

    Args:
        config: the engine settings.
        bytes_per_token: K+V bytes per token over all layers (``2 x layers x kv_heads x
            head_dim x dtype size``).
        max_context: the model's context (tokens): a memory-sized pool must hold one
            request of this length.
        memory: ``(available, total)`` bytes; None reads :func:`device_memory`.

    Returns:
        A :class:`PoolPlan`.

    Raises:
        ValueError: when a memory budget gives less than one max-length request, or
            ``kv_cache_memory`` is more than the memory available; the message gives the
            numbers.
    """
    from mmserve.config import DEFAULT_MAX_TOTAL_TOKENS

    page = config.page_size
    if config.max_total_tokens is not None:
        tokens, reason = config.max_total_tokens, "--max-total-tokens"
    elif config.kv_cache_memory is None and config.mem_fraction_static is None:
        tokens, reason = DEFAULT_MAX_TOTAL_TOKENS, "the default (no --kv-cache-memory)"
    else:
        available, total = memory if memory is not None else device_memory(config.device)
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory
            reason = f"--kv-cache-memory {budget}"
            if budget > available:
                raise ValueError(
                    f"--kv-cache-memory asks for {_gib(budget)} but only {_gib(available)} "
                    f"of {config.device} memory is available after loading the weights"
                )
        else:
            frac = config.mem_fraction_static
            budget = int(available - total * (1.0 - frac))
            reason = (
                f"--mem-fraction-static {frac}: {_gib(available)} available of "
                f"{_gib(total)} after the weights, minus {_gib(total * (1.0 - frac))} kept free"
            )
        tokens = max(budget, 0) // bytes_per_token
        need = -(-max_context // page) * page
        if tokens < need:
            raise ValueError(
                f"the KV pool would hold {max(tokens, 0)} tokens ({_gib(max(budget, 0))} at "
                f"{bytes_per_token} bytes per token; {reason}), fewer than one request of "
                f"the model's context, {max_context} tokens ({_gib(need * bytes_per_token)}); "
                "raise the budget, free memory, or give --max-total-tokens explicitly"
            )
    tokens = tokens // page * page
    return PoolPlan(tokens=tokens, bytes_per_token=bytes_per_token, reason=reason)


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K+V bytes one token takes over ``num_layers`` layers in ``dtype``."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
