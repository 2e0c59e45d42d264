"""FlashInfer paged attention for CUDA, over the same metadata as the torch backend.

The KV pool already stores each layer's K and V as ``[num_pages, P, Hkv, D]``
("NHD" paged layout), and :class:`~mmserve.kernels.metadata.AttentionMetadata`
holds FlashInfer's page-table arrays verbatim, so this backend only plans the
wrappers once per batch and runs them once per layer:

* a batch in which every request has exactly one new token goes through
  ``BatchDecodeWithPagedKVCacheWrapper``;
* a padded decode batch of the CUDA-graph runner (:meth:`plan_padded`) goes through
  one ``BatchDecodeWithPagedKVCacheWrapper`` per bucket built with ``use_cuda_graph=True``
  over the runner's fixed page-table buffers: its ``plan`` copies the batch's page table
  into them and its ``run`` is what the graph captures;
* any other batch (prefill with or without a cached prefix) goes through
  ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``, whose mask is
  aligned to the *end* of each KV sequence, as the torch backend's is.

API used (FlashInfer docs, "flashinfer.prefill" and "flashinfer.decode";
``flashinfer/prefill.py`` and ``flashinfer/decode.py`` in flashinfer-ai/flashinfer):
``Wrapper(float_workspace_buffer, kv_layout)``, ``plan(indptr..., num_qo_heads,
num_kv_heads, head_dim, page_size, ..., q_data_type=, kv_data_type=)`` and
``run(q, (k_cache, v_cache))``. An fp8 pool is planned with ``kv_data_type=
torch.float8_e4m3fn`` and run with the layer's ``k_scale=`` and ``v_scale=`` (the
kernels fold them into the softmax scale and the output).

``flashinfer`` is imported lazily (in :func:`import_flashinfer`) so that
importing :mod:`mmserve` never requires it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from mmserve.cache.kv_pool import KVPool, is_fp8
from mmserve.kernels.backend import AttentionBackend
from mmserve.kernels.metadata import AttentionMetadata

#: Bytes of the float workspace shared by both wrappers (FlashInfer's recommended size).
WORKSPACE_BYTES = 128 * 1024 * 1024

#: Data types FlashInfer's attention kernels accept for Q and K/V (no fp32 kernels).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Grouped-query ratios above this use the tensor-core decode kernel: the CUDA-core
# decode kernel is specialised for small groups only (SGLang uses the same cut-off).
_TENSOR_CORE_DECODE_MIN_GROUP = 5


class BackendUnavailableError(RuntimeError):
    """An attention backend cannot run here; the message says what is missing and the fix."""


#: The fix for a missing or broken flashinfer install.
INSTALL_HINT = (
    'install it with `pip install -e ".[gpu]"` (or `pip install flashinfer-python` '
    "built for your torch and CUDA versions)"
)
#: The way out that always works.
FALLBACK_HINT = "Or run with `--attention-backend torch` (works on any device)."


def flashinfer_import_problem() -> str | None:
    """Why ``import flashinfer`` fails (with the fix), or None when it works."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install raises OSError/RuntimeError too
        return (
            f"the flashinfer-python package cannot be imported ({type(e).__name__}: {e}); "
            + INSTALL_HINT
        )
    return None


def import_flashinfer() -> ModuleType:
    """Import and return the ``flashinfer`` module.

    Raises:
        BackendUnavailableError: when the import fails for any reason (package
            not installed, or built against another CUDA/torch); the message
            names the install command and the torch fallback.
    """
    problem = flashinfer_import_problem()
    if problem is not None:
        raise BackendUnavailableError(
            f"attention backend 'flashinfer' cannot run here: {problem}. {FALLBACK_HINT}"
        )
    import flashinfer

    return flashinfer


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention with FlashInfer's batch prefill/decode wrappers (CUDA only).

    Same interface as :class:`~mmserve.kernels.torch_backend.TorchAttentionBackend`:
    call :meth:`plan` once per batch, then :meth:`forward` once per layer.

    Args:
        num_qo_heads: query heads ``Hq`` (a multiple of ``num_kv_heads``).
        num_kv_heads: K/V heads ``Hkv``.
        head_dim: dimension per head ``D``.
        device: CUDA device of the model and the KV pool.
        dtype: dtype of queries (fp16 or bf16).
        workspace_bytes: size of the float workspace buffer (bytes).
        kv_dtype: dtype of the KV pool: ``dtype`` (None) or ``torch.float8_e4m3fn``.

    Raises:
        BackendUnavailableError: if ``flashinfer`` cannot be imported.
        ValueError: for an unsupported dtype or a head count that is not a
            multiple of ``num_kv_heads``.
    """

    name = "flashinfer"
    captures_graphs = True

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
        workspace_bytes: int = WORKSPACE_BYTES,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype != dtype and not is_fp8(kv_dtype):
            raise ValueError(f"FlashInfer reads a KV pool in {dtype} or fp8 e4m3, not {kv_dtype}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"FlashInfer attention needs float16 or bfloat16, got {dtype}; "
                "use --dtype bfloat16 or --attention-backend torch"
            )
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        flashinfer = import_flashinfer()
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        # FlashInfer requires the workspace zeroed before its first use; one buffer
        # serves both wrappers because only one of them runs per batch.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD"
        )
        self._tensor_cores = num_qo_heads // num_kv_heads >= _TENSOR_CORE_DECODE_MIN_GROUP
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_tensor_cores=self._tensor_cores
        )
        # flashinfer has no type information: its wrappers are Any
        self._graph_decode: dict[int, Any] = {}  # bucket -> use_cuda_graph wrapper
        self._meta: AttentionMetadata | None = None
        self._wrapper: Any = None  # the wrapper planned for this batch

    def _plan_args(self, meta: AttentionMetadata) -> tuple[tuple, dict]:
        """The heads and types both wrappers' ``plan`` take after the page arrays."""
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim, meta.page_size)
        types = {
            "pos_encoding_mode": "NONE",  # RoPE is applied by the model before attention
            "q_data_type": self.dtype,
            "kv_data_type": self.kv_dtype,
        }
        return heads, types

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan the decode or prefill wrapper for this batch; every layer reuses the plan.

        Args:
            meta: the batch's metadata, with index tensors on this backend's device
                (and host copies of indptr / last-page lengths where it has them, which
                are passed instead: no copy back).
        """
        self._meta = meta
        # the host copies where the metadata has them: FlashInfer reads indptr and the
        # last-page lengths on the host and would copy device ones back (a sync)
        indptr, last = meta.host_pages or (meta.kv_indptr, meta.kv_last_page_len)
        qo = meta.host_qo_indptr if meta.host_qo_indptr is not None else meta.qo_indptr
        pages = (indptr, meta.kv_indices, last)
        heads, types = self._plan_args(meta)
        if meta.is_decode:
            self._decode.plan(*pages, *heads, **types)
            self._wrapper = self._decode
        else:
            self._prefill.plan(qo, *pages, *heads, causal=True, **types)
            self._wrapper = self._prefill

    def plan_padded(self, meta: AttentionMetadata) -> None:
        """Plan a padded decode batch (see :meth:`AttentionBackend.plan_padded`) on the
        bucket's CUDA-graph wrapper, built on first use over ``meta``'s buffers: FlashInfer
        keeps the indptr / last-page-length views (``bucket + 1`` and ``bucket`` entries)
        and the whole page-index buffer (``meta.kv_indices``'s base) as its fixed inputs.
        The page table is passed as the host copies in ``meta.host_pages`` (no device
        sync; FlashInfer copies them into its buffers) and the device page indices, which
        already are its buffer."""
        assert meta.is_decode and meta.host_pages is not None, "a PaddedDecodeBuffers batch"
        bucket = meta.batch_size
        wrapper = self._graph_decode.get(bucket)
        if wrapper is None:
            flashinfer = import_flashinfer()
            base = meta.kv_indices._base if meta.kv_indices._base is not None else meta.kv_indices
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                kv_layout="NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=meta.kv_indptr,
                paged_kv_indices_buffer=base,
                paged_kv_last_page_len_buffer=meta.kv_last_page_len,
            )
            self._graph_decode[bucket] = wrapper
        self._meta = meta
        indptr_host, last_host = meta.host_pages
        heads, types = self._plan_args(meta)
        wrapper.plan(indptr_host, meta.kv_indices, last_host, *heads, **types)
        self._wrapper = wrapper

    def _check_pool(self, layer_id: int, pool: KVPool) -> None:
        """Raises ``ValueError`` if the pool's dtype is not the planned K/V dtype."""
        assert self._wrapper is not None, "plan() before forward()"
        k_buf = pool.k_buffers[layer_id]
        if k_buf.dtype != self.kv_dtype:
            raise ValueError(
                f"KV pool dtype {k_buf.dtype} differs from the planned {self.kv_dtype}"
            )

    def _attend(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, layer_id: int, pool: KVPool
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend._attend`: the planned wrapper over the layer's pages."""
        k_buf, v_buf = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        scales = {}
        if pool.quantized:
            k_scale, v_scale = pool.scales(layer_id)
            scales = {"k_scale": k_scale, "v_scale": v_scale}
        out = self._wrapper.run(q.to(self.dtype).contiguous(), (k_buf, v_buf), **scales)
        return out.to(q.dtype)
