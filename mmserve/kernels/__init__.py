"""Attention kernels over the paged KV pool: metadata, torch and FlashInfer backends."""

from mmserve.kernels.backend import AttentionBackend
from mmserve.kernels.flashinfer_backend import BackendUnavailableError
from mmserve.kernels.select import (
    ATTENTION_BACKENDS,
    make_attention_backend,
    resolve_attention_backend,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "BackendUnavailableError",
    "make_attention_backend",
    "resolve_attention_backend",
]
