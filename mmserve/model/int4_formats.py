"""4-bit checkpoint formats: which ``quantization_config`` values are served, and each
format's tensors unpacked to :mod:`mmserve.model.int4`'s form (uint8 ``q`` ``[out, in]``,
fp32 ``scale`` and uint8 ``zero`` ``[out, in / group]``, weight ``(q - zero) * scale``).

Served layouts (every other value is refused by name, :class:`Int4Format` ``.parse``):

* compressed-tensors ``format: "pack-quantized"`` (llm-compressor's W4A16): one config
  group of ``num_bits 4``, ``type int``, ``strategy group``, ``group_size`` 32/64/128,
  symmetric or not, no activation quantization, ``actorder`` none or ``"static"`` (a
  ``"group"`` / ``"weight"`` order stores a ``weight_g_idx`` that permutes the input
  features: refused). Per module ``weight_packed`` int32
  ``[out, in / 8]`` (eight values per int32 along the input, the first in the low bits,
  each stored as ``value + 8``), ``weight_scale`` ``[out, in / group]``, and when
  asymmetric ``weight_zero_point`` (int32 packed the same way along the output rows,
  ``[ceil(out / 8), in / group]``, or unpacked int8 ``[out, in / group]``), plus
  ``weight_shape``.
* AWQ ``version: "gemm"``, ``bits 4``, ``zero_point true``, group 32/64/128: ``qweight``
  int32 ``[in, out / 8]`` and ``qzeros`` int32 ``[in / group, out / 8]`` (eight output
  columns per int32 in AWQ's order 0, 2, 4, 6, 1, 3, 5, 7 from the low bits), ``scales``
  ``[in / group, out]``.
* GPTQ (``checkpoint_format`` "gptq" or "gptq_v2", ``bits 4``, ``desc_act false``, group
  32/64/128, symmetric or not): ``qweight`` int32 ``[in / 8, out]`` (eight input rows per
  int32, the first in the low bits), ``qzeros`` int32 ``[in / group, out / 8]`` (along the
  output, same order; "gptq" stores each zero minus one), ``scales`` ``[in / group, out]``,
  ``g_idx`` ``[in]`` (must be ``i // group``: act-order is refused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmserve.model.int4 import GROUP_SIZES

#: AWQ packs output column ``AWQ_ORDER[j]`` of each eight in bits ``4j .. 4j + 3``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Stored tensor suffixes of each format (beside the module's optional ``bias``).
SUFFIXES = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
}
#: The served 4-bit layouts in words (for refusals and the docs).
SUPPORTED_INT4 = (
    "4-bit checkpoints: compressed-tensors pack-quantized W4A16 (int, group 32/64/128, "
    "symmetric or asymmetric), AWQ version gemm (zero_point true, group 32/64/128) and "
    "GPTQ (checkpoint_format gptq or gptq_v2, desc_act false, group 32/64/128)"
)


class Int4FormatError(ValueError):
    """A 4-bit ``quantization_config`` this build does not serve (the message names the
    field and its value)."""


def _refuse(what: str, field: str, value: object) -> Int4FormatError:
    return Int4FormatError(
        f"{what} quantization_config {field}={value!r} is not supported: mmserve serves "
        f"{SUPPORTED_INT4}"
    )


@dataclass(frozen=True)
class Int4Format:
    """One served 4-bit layout: ``kind`` ("compressed-tensors", "awq", "gptq"), its
    ``group`` size, whether it is ``symmetric`` (no zero points stored) and, for GPTQ,
    whether zeros are stored minus one (``gptq_v1``)."""

    kind: str
    group: int
    symmetric: bool = False
    gptq_v1: bool = False

    @staticmethod
    def parse(qc: dict | None) -> Int4Format | None:
        """The layout of a config.json ``quantization_config``; None when it is no 4-bit
        config (compressed-tensors 8-bit ones are :mod:`mmserve.model.quant`'s).

        Raises:
            Int4FormatError: for an AWQ, GPTQ or pack-quantized config outside the served
                layouts, naming the field and value.
        """
        qc = dict(qc or {})
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            return _parse_ct(qc) if qc.get("format") == "pack-quantized" else None
        if method not in ("awq", "gptq"):
            return None
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise _refuse(method, "bits", bits)
        group = qc.get("group_size", qc.get("q_group_size"))
        if group not in GROUP_SIZES:
            raise _refuse(method, "group_size", group)
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise _refuse("awq", "version", qc.get("version"))
            if not qc.get("zero_point", True):
                raise _refuse("awq", "zero_point", qc.get("zero_point"))
            return Int4Format("awq", group)
        if qc.get("desc_act"):
            raise _refuse("gptq", "desc_act", qc.get("desc_act"))
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse("gptq", "checkpoint_format", fmt)
        return Int4Format("gptq", group, symmetric=False, gptq_v1=fmt == "gptq")

    def weight_key(self) -> str:
        """The suffix of the tensor whose presence says a module is stored in 4 bits."""
        return SUFFIXES[self.kind][0]

    def read(
        self, get: Callable[[str], torch.Tensor], has: Callable[[str], bool], module: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Module ``module``'s ``(q, scale, zero)`` (see the module docstring) from the
        stored tensors ``get(f"{module}.{suffix}")``.

        Raises:
            Int4FormatError: for tensors whose shapes do not fit the layout.
        """
        if self.kind == "compressed-tensors":
            zp = f"{module}.weight_zero_point"
            return unpack_ct(
                get(f"{module}.weight_packed"),
                get(f"{module}.weight_scale"),
                None if self.symmetric or not has(zp) else get(zp),
                self.group,
            )
        qweight, qzeros, scales = (get(f"{module}.{s}") for s in ("qweight", "qzeros", "scales"))
        if self.kind == "awq":
            return unpack_awq(qweight, qzeros, scales, self.group)
        g_idx = get(f"{module}.g_idx") if has(f"{module}.g_idx") else None
        return unpack_gptq(qweight, qzeros, scales, g_idx, self.group, self.gptq_v1)


def _parse_ct(qc: dict) -> Int4Format:
    groups = {n: g or {} for n, g in (qc.get("config_groups") or {}).items()}
    if len(groups) != 1:
        raise _refuse("compressed-tensors pack-quantized", "config_groups", sorted(groups))
    ((name, group),) = groups.items()
    w = group.get("weights") or {}
    for field, want in (("num_bits", 4), ("type", "int"), ("strategy", "group")):
        if w.get(field) != want:
            path = f"config_groups.{name}.weights.{field}"
            raise _refuse("compressed-tensors", path, w.get(field))
    if w.get("group_size") not in GROUP_SIZES:
        field = f"config_groups.{name}.weights.group_size"
        raise _refuse("compressed-tensors", field, w.get("group_size"))
    if w.get("actorder") not in (None, False, "static"):  # "group" / "weight": a g_idx
        field = f"config_groups.{name}.weights.actorder"  # permutes the input features
        raise _refuse("compressed-tensors", field, w.get("actorder"))
    if group.get("input_activations"):
        field = f"config_groups.{name}.input_activations"
        raise _refuse("compressed-tensors", field, group["input_activations"])
    return Int4Format("compressed-tensors", w["group_size"], bool(w.get("symmetric", True)))


# ---- unpacking: int32 words of eight 4-bit values -------------------------------------------
def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., n]`` -> uint8 ``[..., n, 8]``: nibble ``j`` is bits ``4j .. 4j + 3``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.to(torch.int32)[..., None] >> shifts) & 15).to(torch.uint8)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_nibbles`: uint8 ``[..., n, 8]`` -> int32 ``[..., n]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=nibbles.device)
    v = (nibbles.to(torch.int64) << shifts).sum(-1)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)  # the same 32 bits, signed


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise Int4FormatError(f"4-bit checkpoint tensors do not fit the layout: {what}")


def unpack_ct(
    packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors pack-quantized -> ``(q, scale, zero)`` (module docstring)."""
    out_f = packed.shape[0]
    q = _nibbles(packed).reshape(out_f, -1)
    _check(scale.shape[0] == out_f and q.shape[1] == scale.shape[1] * group, "weight_scale")
    if zero_point is None:
        zero = torch.full(scale.shape, 8, dtype=torch.uint8, device=scale.device)
    elif zero_point.dtype == torch.int32:  # packed along the output rows
        zero = _nibbles(zero_point.T).reshape(zero_point.shape[1], -1).T[:out_f].contiguous()
    else:  # unpacked signed zero points
        zero = (zero_point.to(torch.int16) + 8).to(torch.uint8)
    _check(tuple(zero.shape) == tuple(scale.shape), "weight_zero_point")
    return q, scale.float(), zero


def pack_ct(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, symmetric: bool
) -> dict[str, torch.Tensor]:
    """``(q, scale, zero)`` as compressed-tensors pack-quantized tensors (suffix -> tensor;
    ``scale`` kept fp32: the writer casts)."""
    out_f, in_f = q.shape
    t = {
        "weight_packed": _words(q.reshape(out_f, in_f // 8, 8)),
        "weight_scale": scale.float(),
        "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),
    }
    if not symmetric:
        pad = (-out_f) % 8
        z = torch.cat([zero, zero.new_full((pad, zero.shape[1]), 8)]) if pad else zero
        t["weight_zero_point"] = _words(z.T.reshape(z.shape[1], -1, 8)).T.contiguous()
    return t


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ gemm -> ``(q, scale, zero)``: nibble ``j`` of a word is column ``AWQ_ORDER[j]``."""
    inv = torch.tensor([AWQ_ORDER.index(i) for i in range(8)], device=qweight.device)
    q = _nibbles(qweight)[..., inv].reshape(qweight.shape[0], -1)  # [in, out]
    z = _nibbles(qzeros)[..., inv].reshape(qzeros.shape[0], -1)  # [groups, out]
    _check(tuple(scales.shape) == tuple(z.shape) and q.shape[0] == z.shape[0] * group, "scales")
    return q.T.contiguous(), scales.float().T.contiguous(), z.T.contiguous()


def pack_awq(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """``(q, scale, zero)`` as AWQ gemm tensors (``scales`` fp32: the writer casts)."""
    order = list(AWQ_ORDER)

    def words(m: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8]
        return _words(m.reshape(m.shape[0], -1, 8)[..., order])

    return {"qweight": words(q.T), "qzeros": words(zero.T), "scales": scale.float().T.contiguous()}


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group: int,
    v1: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ -> ``(q, scale, zero)``; ``v1``: stored zeros are one less (AutoGPTQ's
    original format). The 4-bit arithmetic wraps as the packers' int32 does.

    Raises:
        Int4FormatError: for a ``g_idx`` that is not ``i // group`` (act-order).
    """
    in_f = qweight.shape[0] * 8
    q = _nibbles(qweight.T).reshape(qweight.shape[1], in_f)  # [out, in]
    z = _nibbles(qzeros).reshape(qzeros.shape[0], -1)  # [groups, out]
    if v1:
        z = (z + 1) & 15
    _check(tuple(scales.shape) == tuple(z.shape) and in_f == z.shape[0] * group, "scales")
    if g_idx is not None:
        want = torch.arange(in_f, device=g_idx.device) // group
        if not torch.equal(g_idx.to(torch.int64), want):
            raise _refuse("gptq", "g_idx (act-order: desc_act)", "permuted")
    return q.contiguous(), scales.float().T.contiguous(), z.T.contiguous()


def pack_gptq(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, v1: bool = True
) -> dict[str, torch.Tensor]:
    """``(q, scale, zero)`` as GPTQ tensors (``v1``: zeros stored minus one)."""
    out_f, in_f = q.shape
    z = ((zero.to(torch.int16) - 1) & 15).to(torch.uint8) if v1 else zero
    return {
        "qweight": _words(q.T.reshape(in_f // 8, 8, out_f).transpose(1, 2)),
        "qzeros": _words(z.T.reshape(z.shape[1], -1, 8)),
        "scales": scale.float().T.contiguous(),
        "g_idx": torch.arange(in_f, dtype=torch.int32) // group,
    }
