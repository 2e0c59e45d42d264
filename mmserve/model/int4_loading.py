"""Loading the decoder's linears as :class:`~mmserve.model.int4.Int4Linear`: quantized at
load (``--quantization int4``) or read from a 4-bit checkpoint
(:mod:`mmserve.model.int4_formats`), whole (:func:`load_int4_decoder`) or as one
tensor-parallel rank's slice (:func:`int4_slice`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from mmserve.model import int4, quant
from mmserve.model.int4_formats import Int4Format
from mmserve.model.weights import CheckpointError, fused_sources

#: Bytes of fp32 rows quantized at once while loading (as the int8 loader's).
QUANTIZE_CHUNK_BYTES = 4 << 20

Int4Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def source_modules(name: str) -> list[str]:
    """The checkpoint-side modules whose rows decoder module ``name`` fuses, in order."""
    return [s.removesuffix(".weight") for s in fused_sources(f"{name}.weight")]


def stored_int4(fmt: Int4Format | None, name: str, has: Callable[[str], bool]) -> bool:
    """Whether decoder module ``name`` is stored in 4 bits in the checkpoint (all its
    sources, or none: the LM head and ``ignore``d modules are dense).

    Raises:
        CheckpointError: for a fused module whose sources are stored 4-bit only in part.
    """
    if fmt is None:
        return False
    mods = source_modules(name)
    have = [has(f"{m}.{fmt.weight_key()}") for m in mods]
    if any(have) and not all(have):
        raise CheckpointError(f"decoder: {name} fuses {', '.join(mods)}, quantized only in part")
    return all(have)


def quantize_rows(
    rows: Callable[[int, int], torch.Tensor], out_f: int, in_f: int, group: int, device: str
) -> Int4Parts:
    """Asymmetric :func:`~mmserve.model.int4.quantize_int4` of an ``[out_f, in_f]`` matrix
    read ``rows(start, stop)`` a slice of :data:`QUANTIZE_CHUNK_BYTES` of fp32 at a time
    into tensors allocated once (loading never holds the whole matrix in fp32)."""
    q = torch.empty(out_f, in_f, dtype=torch.uint8, device=device)
    scale = torch.empty(out_f, in_f // group, dtype=torch.float32, device=device)
    zero = torch.empty(out_f, in_f // group, dtype=torch.uint8, device=device)
    step = max(1, QUANTIZE_CHUNK_BYTES // (4 * in_f))
    for lo in range(0, out_f, step):
        hi = min(out_f, lo + step)
        q[lo:hi], scale[lo:hi], zero[lo:hi] = int4.quantize_int4(
            rows(lo, hi).to(device), group, symmetric=False
        )
    return q, scale, zero


def _cat(parts: list[Int4Parts]) -> Int4Parts:
    if len(parts) == 1:
        return parts[0]
    return cast(Int4Parts, tuple(torch.cat(ts) for ts in zip(*parts, strict=True)))


def load_int4_decoder(decoder: Any, dec_w: dict, fmt: Int4Format | None, to: Any) -> None:
    """Put an :class:`~mmserve.model.int4.Int4Linear` in place of each of ``decoder``'s
    targets (:func:`~mmserve.model.quant.target_modules`, the LM head included): read from
    the checkpoint's 4-bit tensors when ``fmt`` is given and the module is stored so (its
    sources fused by rows), dense as stored otherwise (the LM head: tied again when the
    checkpoint ties it); quantized here with group
    :func:`~mmserve.model.int4.group_size_for` when ``fmt`` is None.

    ``dec_w``: decoder-side name -> checkpoint key; ``to``: the loader's target (its
    ``weights``, ``dtype``, ``device``).

    Raises:
        CheckpointError: for a fused module stored 4-bit in part, or missing tensors.
        QuantizationError: for stored tensors that do not fit the layout.
    """
    shape = decoder.shape

    def get(n: str) -> torch.Tensor:
        if n not in dec_w:
            raise CheckpointError(f"decoder: weights missing from checkpoint: [{n!r}]")
        return cast(torch.Tensor, to.weights.get(dec_w[n], None, to.device))

    for name in quant.target_modules(shape.num_layers, quantize_head=True):
        linear = cast(nn.Linear, decoder.get_submodule(name))
        mods = source_modules(name)
        if fmt is not None and not stored_int4(fmt, name, dec_w.__contains__):
            if name == "lm_head" and shape.tie_word_embeddings:
                linear.weight = decoder.embed_tokens.weight
            else:
                dense = [to.weights.get(dec_w[f"{m}.weight"], to.dtype, to.device) for m in mods]
                linear.weight = nn.Parameter(torch.cat(dense), requires_grad=False)
            continue
        if fmt is not None:
            try:
                parts = [fmt.read(get, dec_w.__contains__, m) for m in mods]
            except ValueError as e:
                raise quant.QuantizationError(f"decoder: {name}: {e}") from None
            group = fmt.group
        else:
            in_f = linear.in_features
            group = int4.group_size_for(in_f)
            parts = []
            for m in mods:
                key = dec_w[f"{m}.weight"]
                out_f = to.weights.shape(key)[0]

                def rows(lo: int, hi: int, key: str = key) -> torch.Tensor:
                    return cast(torch.Tensor, to.weights.rows(key, lo, hi))

                parts.append(quantize_rows(rows, out_f, in_f, group, to.device))
        q, scale, zero = _cat(parts)
        bias = None if linear.bias is None else linear.bias.detach()
        new = int4.Int4Linear.from_int(q, scale, zero, group, bias, to.device)
        quant.replace_module(decoder, name, new)


def int4_regroup(parts: Int4Parts, group: int, new_group: int) -> Int4Parts:
    """``(q, scale, zero)`` in groups of ``new_group`` (a divisor of ``group``): each
    group's ``scale`` and ``zero`` repeated over its ``group / new_group`` parts, so the
    weight ``(q - zero) * scale`` is unchanged bit for bit."""
    q, scale, zero = parts
    k = group // new_group
    return q, scale.repeat_interleave(k, dim=1), zero.repeat_interleave(k, dim=1)


def int4_slice(
    parts: Int4Parts, axis: str, span: tuple[int, int] | None, group: int, what: str
) -> tuple[Int4Parts, int]:
    """One tensor-parallel rank's rows (``axis`` "row") or input columns ("col") of
    ``(q, scale, zero)``, and the group size of the slice. A column span inside a group
    (``--tp 2`` of 128 input features in groups of 128) regroups exactly first: the largest
    of :data:`~mmserve.model.int4.GROUP_SIZES` that divides the group and both ends of the
    span, each part keeping its group's scale and zero (:func:`int4_regroup`).

    Raises:
        QuantizationError: for a column span no kernel group size fits, naming the module,
            the span and the group size.
    """
    q, scale, zero = parts
    if axis == "row" and span is not None:
        lo, hi = span
        return (q[lo:hi], scale[lo:hi], zero[lo:hi]), group
    if axis == "col" and span is not None:
        lo, hi = span
        if lo % group or hi % group:
            fits = [g for g in int4.GROUP_SIZES if not (group % g or lo % g or hi % g)]
            if not fits:
                raise quant.QuantizationError(
                    f"--tp splits {what}'s {q.shape[1]} input features at [{lo}, {hi}), "
                    f"which no int4 group size of {int4.GROUP_SIZES} fits inside its groups "
                    f"of {group}: use a --tp that divides {q.shape[1]} input features into "
                    f"multiples of {min(int4.GROUP_SIZES)}"
                )
            q, scale, zero = int4_regroup((q, scale, zero), group, max(fits))
            group = max(fits)
        g = group
        return (q[:, lo:hi], scale[:, lo // g : hi // g], zero[:, lo // g : hi // g]), group
    return parts, group
