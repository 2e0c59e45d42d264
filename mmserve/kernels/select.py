"""Choosing and building the attention backend: "auto", "torch" or "flashinfer".

"auto" takes FlashInfer when it can run (a CUDA device that torch can see, the
``flashinfer`` package importable, and an fp16/bf16 model) and the torch
reference backend otherwise. An explicit "flashinfer" that cannot run is an
error naming every missing piece and its fix, never a silent fallback and never
a bare ImportError.
"""

from __future__ import annotations

import torch

from mmserve.config import ATTENTION_BACKENDS
from mmserve.kernels.backend import AttentionBackend
from mmserve.kernels.flashinfer_backend import (
    FALLBACK_HINT,
    SUPPORTED_DTYPES,
    BackendUnavailableError,
    FlashInferAttentionBackend,
    flashinfer_import_problem,
)
from mmserve.kernels.torch_backend import TorchAttentionBackend


def _flashinfer_problems(device: torch.device, dtype: torch.dtype, probe_import: bool) -> list[str]:
    """Reasons FlashInfer cannot run here, each with its fix; empty if it can."""
    problems = []
    if device.type != "cuda":
        problems.append(
            f"it runs on CUDA only, but the device is {str(device)!r} (use --device cuda)"
        )
    elif not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch build ({torch.__version__}) has no CUDA support"
            fix = "install a CUDA build of torch"
        else:
            why = "torch.cuda.is_available() is False (no GPU visible or driver problem)"
            fix = "check nvidia-smi and CUDA_VISIBLE_DEVICES"
        problems.append(f"CUDA is not available: {why} ({fix})")
    if dtype not in SUPPORTED_DTYPES:
        problems.append(
            f"it needs float16 or bfloat16 weights, but the dtype is {dtype} "
            "(use --dtype bfloat16 or --dtype auto)"
        )
    if probe_import:
        problem = flashinfer_import_problem()
        if problem is not None:
            problems.append(problem)
    return problems


def resolve_attention_backend(
    name: str, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> str:
    """Decide which backend ``name`` means on this machine, without building it.

    Args:
        name: "auto", "torch" or "flashinfer".
        device: the model's device ("cpu", "cuda", "cuda:1", ...).
        dtype: the model's (and KV pool's) dtype.

    Returns:
        "torch" or "flashinfer".

    Raises:
        ValueError: for an unknown ``name`` (the message lists the choices).
        BackendUnavailableError: for "flashinfer" when it cannot run here; the
            message lists every missing piece and how to fix it.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    device = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "auto":
        # Probe the import only where it could be used: importing flashinfer on a
        # CPU-only machine is slow and may warn.
        cheap = _flashinfer_problems(device, dtype, probe_import=False)
        if cheap or _flashinfer_problems(device, dtype, probe_import=True):
            return "torch"
        return "flashinfer"
    problems = _flashinfer_problems(device, dtype, probe_import=True)
    if problems:
        listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        raise BackendUnavailableError(
            f"attention backend 'flashinfer' cannot run here: {listed}. {FALLBACK_HINT}"
        )
    return "flashinfer"


def make_attention_backend(
    name: str,
    device: torch.device | str,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    deterministic: bool = False,
) -> AttentionBackend:
    """Build the attention backend ``name`` resolves to (see :func:`resolve_attention_backend`).

    Args:
        name: "auto", "torch" or "flashinfer".
        device: the model's device.
        num_qo_heads, num_kv_heads, head_dim: the decoder's attention shape.
        dtype: the model's dtype.
        kv_dtype: the KV pool's dtype (None: ``dtype``; else ``torch.float8_e4m3fn``,
            which both backends read).
        deterministic: batch- and chunk-invariant attention (``--deterministic``): the
            torch backend's fixed key blocks
            (:mod:`mmserve.kernels.batch_invariant`); FlashInfer is not used then
            (its kernels split keys by the batch's shape), so "auto" resolves to torch.

    Returns:
        A :class:`TorchAttentionBackend` or a :class:`FlashInferAttentionBackend`.

    Raises:
        ValueError: for an unknown ``name``.
        BackendUnavailableError: for "flashinfer" when it cannot run here.
    """
    if deterministic:
        if name == "flashinfer":
            raise ValueError(
                "attention_backend 'flashinfer' cannot run --deterministic (its split over "
                "keys follows the batch); use 'auto' or 'torch'"
            )
        return TorchAttentionBackend(deterministic=True)
    if resolve_attention_backend(name, device, dtype) == "flashinfer":
        return FlashInferAttentionBackend(
            num_qo_heads, num_kv_heads, head_dim, device, dtype, kv_dtype=kv_dtype
        )
    return TorchAttentionBackend()
