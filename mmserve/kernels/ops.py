"""The decoder's elementwise ops, fused: RMSNorm with the residual add, RoPE in place from
a cos/sin cache, SiLU-and-mul.

Each op has two implementations with one contract. The torch one (``*_ref``) is the
specification and runs everywhere; its arithmetic is transformers' Llama arithmetic
(RMSNorm in fp32 then rounded, RoPE tables computed in fp32 from fp32 inverse
frequencies then rounded), so greedy tokens stay equal to transformers'. On CUDA with
fp16/bf16 tensors and an importable ``flashinfer``, FlashInfer's fused kernels run instead
(inside a decoder forward only when the attention backend is FlashInfer: see
:func:`fused_ops`, so ``--attention-backend torch`` runs no FlashInfer kernel)
(``flashinfer.norm.rmsnorm`` / ``fused_add_rmsnorm``,
``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace``,
``flashinfer.activation.silu_and_mul``); they keep intermediates in fp32, so they equal the
torch ones within a rounding of the output dtype (``tests/gpu/test_fused_ops_gpu.py``).

In-place contract (FlashInfer's): :func:`fused_add_rms_norm` may overwrite both its
inputs and :func:`apply_rope` always overwrites ``q`` and ``k``; callers pass tensors
they own.
Sources: Zhang & Sennrich, "Root Mean Square Layer Normalization" (arXiv 1910.07467);
Su et al., "RoFormer" (arXiv 2104.09864), rotate-half (GPT-NeoX) layout; Shazeer, "GLU
Variants Improve Transformer" (arXiv 2002.05202).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from mmserve.kernels.fused_rules import fused_add_rms_norm_fits, silu_and_mul_fits

#: dtypes FlashInfer's norm, RoPE and activation kernels take (fp32 runs the torch ops).
_FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flashinfer():
    """The ``flashinfer`` module, or None when it cannot be imported (then torch runs)."""
    try:
        import flashinfer
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope
    except Exception:  # noqa: BLE001 - a broken install raises OSError/RuntimeError too
        return None
    return flashinfer


#: Whether FlashInfer's fused ops may run in this context (None: where they can, as
#: outside a decoder forward). A context variable: each thread / engine sets its own.
_FUSED_FLASHINFER: ContextVar[bool | None] = ContextVar("fused_flashinfer", default=None)


@contextlib.contextmanager
def fused_ops(flashinfer: bool) -> Iterator[None]:
    """Within the block, the fused ops run FlashInfer's kernels only if ``flashinfer``
    (and where they can: CUDA fp16/bf16, ``flashinfer`` importable); with False the torch
    ones always run and ``flashinfer`` is never imported. The decoder's forward enters it
    with ``backend.name == "flashinfer"``, so the fused ops follow the attention backend."""
    token = _FUSED_FLASHINFER.set(flashinfer)
    try:
        yield
    finally:
        _FUSED_FLASHINFER.reset(token)


def _use_flashinfer(x: torch.Tensor) -> bool:
    if _FUSED_FLASHINFER.get() is False:
        return False
    return x.is_cuda and x.dtype in _FLASHINFER_DTYPES and _flashinfer() is not None


# --- RMSNorm ------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalised in fp32 and rounded to
    ``x.dtype`` before the weight multiplies (transformers' ``LlamaRMSNorm``).

    Args:
        x: ``[T, H]`` activations, any float dtype.
        weight: ``[H]`` scale, ``x``'s dtype.
        eps: added to the mean square.

    Returns:
        ``[T, H]`` in the promoted dtype of ``weight`` and ``x`` (``x.dtype`` when equal).
    """
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, H]`` (see :func:`rms_norm_ref`); FlashInfer's ``rmsnorm``
    on CUDA fp16/bf16. ``x`` is not modified."""
    if _use_flashinfer(x) and weight.dtype == x.dtype:
        return _flashinfer().norm.rmsnorm(x.contiguous(), weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = residual + x`` (rounded to the dtype, as an unfused ``+`` is) and
    ``rms_norm_ref(residual')``.

    Args:
        x: ``[T, H]`` the block's output.
        residual: ``[T, H]`` the residual stream, same dtype.
        weight: ``[H]``.
        eps: added to the mean square.

    Returns:
        ``(normed, residual')``, each ``[T, H]``; the inputs are left as they were.
    """
    new = residual + x
    return rms_norm_ref(new, weight, eps), new


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm in one pass (see :func:`fused_add_rms_norm_ref`).

    On CUDA fp16/bf16 FlashInfer's ``fused_add_rmsnorm`` writes ``residual + x`` into
    ``residual`` and the normed rows into ``x`` and both are returned, so callers must own
    both tensors and use only the returned ones.
    """
    if _use_flashinfer(x) and fused_add_rms_norm_fits(x, residual, weight):
        _flashinfer().norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    return fused_add_rms_norm_ref(x, residual, weight, eps)


# --- RoPE ---------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """fp32 inverse frequencies ``theta ** (-2i / head_dim)``, ``i < head_dim / 2`` (on the
    CPU; transformers computes them in fp32 and keeps them so)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu")
    return 1.0 / (theta ** (steps / head_dim))


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """fp32 ``[max_positions, head_dim]`` table: ``cos(p * f)`` in the first half of a
    row, ``sin(p * f)`` in the second (FlashInfer's and SGLang's layout), built once per
    model. Each angle is the fp32 product transformers computes per step, so the rows
    equal its per-step tables.

    Args:
        inv_freq: fp32 ``[head_dim / 2]`` (:func:`rope_inv_freq`).
        max_positions: rows (positions ``0 .. max_positions - 1``).
    """
    pos = torch.arange(max_positions, dtype=torch.float, device=inv_freq.device)
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    head_dim: int,
    cache: torch.Tensor,
) -> None:
    """Rotate-half RoPE on ``q`` and ``k`` in place: ``x * cos + rotate_half(x) * sin``
    with the cache's rows for ``positions``, cos and sin rounded to ``q.dtype`` first
    (transformers' ``apply_rotary_pos_emb``).

    Args:
        positions: int64 ``[T]`` absolute positions (< ``cache.shape[0]``).
        q: ``[T, Hq * head_dim]`` (may be a column slice of a wider tensor), overwritten.
        k: ``[T, Hkv * head_dim]``, overwritten.
        head_dim: ``D``.
        cache: fp32 ``[max_positions, head_dim]`` (:func:`cos_sin_cache`).
    """
    rows = cache.index_select(0, positions)
    half = head_dim // 2
    cos, sin = rows[:, :half], rows[:, half:]
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype)[:, None, :]
    for x in (q, k):
        v = x.view(x.shape[0], -1, head_dim)
        v.copy_(v * cos + _rotate_half(v) * sin)


def apply_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    head_dim: int,
    cache: torch.Tensor,
) -> None:
    """RoPE on ``q`` ``[T, Hq * D]`` and ``k`` ``[T, Hkv * D]`` in place (see
    :func:`apply_rope_ref`); FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``
    (``is_neox=True``: rotate-half) on CUDA fp16/bf16."""
    if _use_flashinfer(q):
        _flashinfer().rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, head_dim, cache, is_neox=True
        )
        return
    apply_rope_ref(positions, q, k, head_dim, cache)


# --- SiLU-and-mul -------------------------------------------------------------------


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]`` (gate then up, as the
    fused ``gate_up_proj`` writes them); ``[..., I]`` in ``x.dtype``."""
    gate, up = x.chunk(2, dim=-1)
    # contiguous: on a strided view torch's CPU SiLU takes a scalar path whose fp32
    # results differ from the vectorised one's (and the unfused gate_proj's) by an ulp
    return F.silu(gate.contiguous()) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU-gated product (see :func:`silu_and_mul_ref`); FlashInfer's ``silu_and_mul``
    on CUDA fp16/bf16."""
    if _use_flashinfer(x) and silu_and_mul_fits(x):
        return _flashinfer().activation.silu_and_mul(x)
    return silu_and_mul_ref(x)
