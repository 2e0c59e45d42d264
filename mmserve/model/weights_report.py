"""The weights of a loaded model in words and bytes, for the start-up log and the stats:
each tensor counted once (a tied LM head is the embedding's tensor), by dtype, with the
quantization and where it came from (:mod:`mmserve.model.quant`, :mod:`mmserve.model.int4`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _tensors(model: Any) -> list[torch.Tensor]:
    """Every parameter and buffer of ``model``'s decoder and vision module, each tensor
    once (a tied LM head is the embedding's tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for m in (model.decoder, model.vision):
        if isinstance(m, nn.Module):
            for t in [*m.parameters(), *m.buffers()]:
                seen.setdefault(id(t), t)
    return list(seen.values())


def weight_bytes(model: Any) -> int:
    """Bytes of a :class:`~mmserve.model.loader.LoadedModel`'s parameters and buffers
    (decoder and vision; on this rank under tensor parallelism), each tensor counted once."""
    return sum(t.numel() * t.element_size() for t in _tensors(model))


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def weights_summary(model: Any) -> str:
    """The weights of a :class:`~mmserve.model.loader.LoadedModel` in words, for the
    start-up log: the quantization (method and where it came from), the bytes in all and
    per dtype, and the LM head (tied to the token embedding, or untied, and when a tied
    head was untied to be quantized, the parameters and bytes that added)."""
    by_dtype: dict[str, int] = {}
    for t in _tensors(model):
        name = str(t.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + t.numel() * t.element_size()
    total = sum(by_dtype.values())
    parts = "; ".join(f"{d} {b:,}" for d, b in sorted(by_dtype.items(), key=lambda x: -x[1]))
    method = getattr(model, "quantization", "none")
    if method == "none":
        text = "quantization none"
    else:
        source = getattr(model, "quantization_source", "") or method
        group = next((m.group for m in model.decoder.modules() if hasattr(m, "group")), 0)
        how = f"groups of {group} input features" if method == "int4" else "per output channel"
        text = f"quantization {method} ({source}; {how})"
    text += f"; weight bytes {total:,} = {_mb(total)} ({parts})"
    decoder = model.decoder
    head = getattr(decoder, "lm_head", None)
    embed = getattr(decoder, "embed_tokens", None)
    shape = getattr(decoder, "shape", None)
    if head is None or embed is None or shape is None:
        return text
    hw = head.weight
    dtype = "int4" if hasattr(head, "group") else str(hw.dtype).removeprefix("torch.")
    if hw is embed.weight:
        return f"{text}; LM head tied to the token embedding ({dtype})"
    head_bytes = sum(t.numel() * t.element_size() for t in head.parameters())
    params = head.out_features * head.in_features if hasattr(head, "group") else hw.numel()
    what = f"{params:,} parameters, {head_bytes:,} bytes"
    if shape.tie_word_embeddings:
        return (
            f"{text}; LM head untied: the checkpoint ties it to the token embedding, and "
            f"quantizing made a separate {dtype} copy ({what})"
        )
    return f"{text}; LM head untied ({dtype}, {what})"
