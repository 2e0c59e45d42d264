"""Paged K/V buffers shared by the radix cache and running requests.

Each layer has one K and one V buffer in FlashInfer's paged layout
``[num_pages, page_size, num_kv_heads, head_dim]`` (the "NHD" layout). Which
pages are free is tracked by a :class:`~mmserve.cache.page_allocator.PageAllocator`;
pages not free are owned either by the radix tree or by a running request. One more
page, :attr:`KVPool.scratch_page`, lies past the allocator's range: no request or tree
node ever owns it, and the padding rows of a padded decode batch (the CUDA-graph
runner's, :mod:`mmserve.engine.cuda_graph`) write their K/V there.

pages not free are owned either by the radix tree or by a running request.

**fp8 KV** (``--kv-cache-dtype fp8_e4m3``). Pages may be stored in ``float8_e4m3fn``
(one byte per element) with one K scale and one V scale per layer, in vLLM's sense:
the stored value times the scale is the real one. :meth:`KVPool.write_kv` quantizes
(``clamp(x / scale, -448, 448)`` then a round-to-nearest cast; the clamp keeps an
outlier finite, since e4m3fn has no infinity and an overflowing cast gives NaN);
readers dequantize (``fp8 * scale``): FlashInfer in its kernels (``k_scale`` and
``v_scale`` of ``run``), the torch backend by folding ``k_scale`` into the softmax
scale and ``v_scale`` into the output. Scales are 1.0 unless the checkpoint has them
(:func:`mmserve.model.kv_scales.kv_scale_plan`, which also makes ``--kv-cache-dtype auto``
fp8 for a checkpoint whose ``kv_cache_scheme`` asks for it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmserve.cache.page_allocator import PageAllocator

if TYPE_CHECKING:
    from mmserve.config import EngineConfig
    from mmserve.model.llama import LlamaShape

log = logging.getLogger(__name__)

#: Storage dtype of ``--kv-cache-dtype fp8_e4m3`` (None on a torch without float8).
FP8_KV_DTYPE: torch.dtype | None = getattr(torch, "float8_e4m3fn", None)
#: Largest finite float8 e4m3fn value: quantized K/V are clamped to +-this.
FP8_E4M3_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is the fp8 KV storage dtype."""
    return FP8_KV_DTYPE is not None and dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` (any float dtype, any shape) as float8 e4m3fn: ``clamp(x / scale, +-448)``,
    rounded to nearest. Relative error per element at most 2**-4 (3 mantissa bits) in the
    normal range; absolute error at most 2**-10 x scale below it (subnormals)."""
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """float8 ``x`` back to ``dtype``: ``x * scale`` (exact upcast, then one multiply)."""
    y = x.to(dtype)
    return y if scale == 1.0 else y * scale


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A byte view of an fp8 tensor (indexing kernels lack float8 on some devices: CPU
    ``index_copy_``, CUDA ``index_put_`` on older torch); any other tensor as is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


class KVPool:
    """K/V page buffers for every decoder layer plus their page allocator.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page ``P``.
        num_layers: decoder layers.
        num_kv_heads: K/V heads per layer.
        head_dim: dimension per head.
        dtype: buffer dtype (fp32 on CPU; bf16/fp16 on GPU; ``torch.float8_e4m3fn`` for
            fp8 KV).
        device: buffer device.
        k_scales, v_scales: per-layer dequantization scales of an fp8 pool (None: 1.0
            each); ignored (all 1.0) for any other dtype.

    Raises:
        ValueError: if ``num_pages`` or ``page_size`` is < 1, or a scale list has not
            ``num_layers`` positive finite entries.
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
        k_scales: list[float] | None = None,
        v_scales: list[float] | None = None,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1 ({num_pages}, {page_size})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.dtype = dtype
        #: whether pages are fp8 (written quantized, read with the scales)
        self.quantized = is_fp8(dtype)
        ones = [1.0] * num_layers
        self.k_scales = list(k_scales or ones) if self.quantized else ones
        self.v_scales = list(v_scales or ones) if self.quantized else ones
        for name, scales in (("k_scales", self.k_scales), ("v_scales", self.v_scales)):
            if len(scales) != num_layers or not all(0 < s < float("inf") for s in scales):
                raise ValueError(f"{name} needs {num_layers} positive finite values: {scales}")
        #: how :meth:`for_model` sized the pool (None when built directly)
        self.plan: PoolPlan | None = None
        #: page id past the allocator's range, owned by no request (padding rows write it)
        self.scratch_page = num_pages
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = PageAllocator(num_pages)

    @classmethod
    def for_model(
        cls,
        config: EngineConfig,
        shape: LlamaShape,
        dtype: torch.dtype,
        scales: tuple[list[float], list[float]] | None = None,
        fp8: bool | None = None,
    ) -> KVPool:
        """The pool of an engine: sized by :func:`plan_pool` for the decoder ``shape``
        (a :class:`~mmserve.model.llama.LlamaShape`) in :func:`kv_storage_dtype` of
        ``config`` and the model ``dtype``, after the weights are loaded; logs the dtypes
        (and why, for ``--dtype auto``), tokens and bytes, and keeps the :class:`PoolPlan`
        as ``pool.plan`` (for ``mmserve serve``'s start-up summary).

        Args:
            scales: the checkpoint's per-layer ``(k_scales, v_scales)`` for fp8 KV (None:
                1.0).
            fp8: whether the pool is fp8 (None: as ``config.kv_cache_dtype`` says; the
                engine passes :class:`~mmserve.model.kv_scales.KVScalePlan`'s choice).

        Raises:
            ValueError: as :func:`plan_pool` and :func:`kv_storage_dtype`.
        """
        from mmserve.config import auto_dtype

        kv_dtype = kv_storage_dtype(config, dtype, fp8)
        bpt = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_dtype)
        plan = plan_pool(config, bpt, shape.max_position_embeddings)
        why = f"auto: {auto_dtype(config.device)[1]}" if config.dtype == "auto" else "--dtype"
        kv = "" if kv_dtype == dtype else f", KV {kv_dtype_name(kv_dtype)}"
        if is_fp8(kv_dtype):
            kv += " (scales from the checkpoint)" if scales else " (scales 1.0)"
        log.info(
            "dtype %s (%s)%s; KV pool %d tokens, %.1f MiB (%d bytes per token), sized by %s",
            str(dtype).removeprefix("torch."), why, kv, plan.tokens, plan.bytes / 2**20, bpt,
            plan.reason,
        )  # fmt: skip
        k_scales, v_scales = scales if scales else (None, None)
        pool = cls(
            plan.tokens // config.page_size,
            config.page_size,
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_dim,
            dtype=kv_dtype,
            device=config.device,
            k_scales=k_scales,
            v_scales=v_scales,
        )
        pool.plan = plan  # for the start-up summary: where the size came from
        return pool

    def scales(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of layer ``layer_id`` (1.0, 1.0 unless fp8)."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

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
            k, v: ``[T, Hkv, D]``; cast to the pool's dtype (fp8: quantized with the
                layer's scales, :func:`quantize_kv`).

        Returns:
            The layer's flat ``(K, V)`` views ``[(num_pages + 1) * P, Hkv, D]``.
        """
        k_flat, v_flat = self.flat_kv(layer_id)
        if self.quantized:
            k_scale, v_scale = self.scales(layer_id)
            # through byte views: index_put has no float8 kernel on some devices
            raw_bytes(k_flat)[loc] = raw_bytes(quantize_kv(k, k_scale))
            raw_bytes(v_flat)[loc] = raw_bytes(quantize_kv(v, v_scale))
        else:
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
        k = torch.stack([raw_bytes(b).index_select(0, idx) for b in self.k_buffers], dim=1)
        v = torch.stack([raw_bytes(b).index_select(0, idx) for b in self.v_buffers], dim=1)
        return torch.stack([k, v], dim=1).view(self.dtype)

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """Load whole pages into the pool: the tiers' counterpart of :meth:`write_kv`
        (which writes new tokens' K/V during a forward).

        Args:
            pages: page ids (owned by the caller, not yet in the tree).
            kv: ``[len(pages), 2, num_layers, P, Hkv, D]`` on any device, in the pool's
                dtype (as :meth:`read_pages` gave them; fp8 pages are copied as bytes).

        Raises:
            ValueError: ``kv`` in another dtype than the pool's (a cast would rescale
                nothing for fp8, so pages of another KV dtype are refused).
        """
        if kv.dtype != self.dtype:
            raise ValueError(f"pages of dtype {kv.dtype} for a {self.dtype} KV pool")
        dev = self.k_buffers[0].device
        idx = torch.tensor(pages, dtype=torch.long, device=dev)
        kv = raw_bytes(kv.to(dev, non_blocking=True))
        for layer in range(self.num_layers):
            raw_bytes(self.k_buffers[layer]).index_copy_(0, idx, kv[:, 0, layer])
            raw_bytes(self.v_buffers[layer]).index_copy_(0, idx, kv[:, 1, layer])


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
            assert frac is not None  # the branch above: one of the two is set
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


def fp8_kv_unavailable(config: EngineConfig) -> str | None:
    """Why ``config`` cannot have an fp8 KV pool (tensor parallelism, a torch without
    float8), in words; None when it can."""
    if config.tp > 1:
        return "fp8 KV is not supported with --tp > 1 yet"
    if FP8_KV_DTYPE is None:
        return f"torch {torch.__version__} lacks float8_e4m3fn"
    return None


def kv_storage_dtype(
    config: EngineConfig, model_dtype: torch.dtype, fp8: bool | None = None
) -> torch.dtype:
    """The KV pool's dtype: float8 e4m3fn for ``--kv-cache-dtype fp8_e4m3`` (or ``fp8``
    True: ``auto`` on a checkpoint whose ``kv_cache_scheme`` is fp8), else ``model_dtype``.

    Raises:
        ValueError: fp8 asked for on a torch without ``float8_e4m3fn`` (names the flag
            and ``auto``).
    """
    if not (config.kv_fp8() if fp8 is None else fp8):
        return model_dtype
    if FP8_KV_DTYPE is None:
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype} needs torch.float8_e4m3fn, which "
            f"torch {torch.__version__} lacks; use --kv-cache-dtype auto or torch >= 2.1"
        )
    return FP8_KV_DTYPE


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The ``--kv-cache-dtype``-style name of a pool dtype: "fp8_e4m3" for fp8, else the
    torch name ("bfloat16", "float32", ...)."""
    return "fp8_e4m3" if is_fp8(dtype) else str(dtype).removeprefix("torch.")


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K+V bytes one token takes over ``num_layers`` layers in ``dtype``."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
