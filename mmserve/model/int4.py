"""4-bit weight-only linears (``--quantization int4``): grouped affine int4 weights.

A weight ``[out, in]`` is stored as 4-bit integers ``q`` in ``[0, 15]`` with one fp32
``scale`` and one integer ``zero`` in ``[0, 15]`` per output row and group of ``group``
consecutive input features; the weight it stands for is ``(q - zero) * scale``
(:func:`dequantize_int4`: the reference dequantization every checkpoint format is
unpacked to). Symmetric quantization is ``zero = 8``.

:class:`Int4Linear` keeps the weight packed for the kernel of its device and computes
``x @ W^T + bias`` through it:

* CPU: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (fp32, bf16 and fp16 activations;
  output rows a multiple of 16). It reads the packed weight once per call whatever the
  row count, and measured on this machine's 2 cores (bf16, 9728 x 896) it stays within
  ~10% of the bf16 matmul from 8 rows up (0.81 against 0.87 ms at 8 rows, 1.63 against
  1.56 at 16), so it runs at every row count: a dequantized copy per step (~0.5 ms to
  write 17 MB of bf16 per 9728 x 896 matrix) would only add to that. Numbers:
  ``python -m benchmarks quant_rows``.
* CUDA: ``torch.ops.aten._weight_int4pack_mm`` (tinygemm, bf16 activations; other dtypes
  are cast to bf16 and back; output rows a multiple of 8, input features a multiple of
  32), measured by benchmarks/quant_cuda.py in scripts/gpu_check.sh. Its CPU twin is the
  CPU kernel (the same arithmetic: ``(q - 8) * scale + offset`` per group).
* otherwise (shapes the kernels refuse): the weight kept as two 4-bit values per byte
  and dequantized per call (:meth:`Int4Linear.dequantized`).

Both kernels compute ``(q - 8) * scale + offset`` with ``offset = (8 - zero) * scale``
(torch's ``scales_and_zeros`` ``[groups, out, 2]``), which equals ``(q - zero) * scale``
up to one rounding of the offset.

Grouped affine quantization: Frantar et al., "GPTQ" (arXiv 2210.17323) and Lin et al.,
"AWQ" (arXiv 2306.00978) both store this form; the kernels are torch's.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

#: ``--quantization int4``'s group size when quantizing at load.
INT4_GROUP_SIZE = 128
#: Group sizes a checkpoint may use (compressed-tensors, AWQ, GPTQ).
GROUP_SIZES = (32, 64, 128)
#: The CPU kernel packs output rows in blocks of this many.
CPU_N_MULTIPLE = 16
#: The CUDA kernel's output-row and input-feature multiples.
CUDA_N_MULTIPLE, CUDA_K_MULTIPLE = 8, 32


def group_size_for(in_features: int, wanted: int = INT4_GROUP_SIZE) -> int:
    """The group size ``--quantization int4`` uses for ``in_features``: ``wanted`` when it
    divides them, else the largest of :data:`GROUP_SIZES` below it that does.

    Raises:
        ValueError: when none divides ``in_features``.
    """
    for g in sorted({wanted, *GROUP_SIZES}, reverse=True):
        if g <= wanted and in_features % g == 0:
            return g
    raise ValueError(f"int4: no group size in {GROUP_SIZES} divides {in_features} input features")


def quantize_int4(
    w: torch.Tensor, group: int, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped int4 quantization of ``w`` ``[out, in]`` (``in`` a multiple of ``group``).

    Symmetric: ``scale = max|w| / 7`` per group, ``zero = 8``, ``q = round(w / scale) + 8``
    clamped to ``[0, 15]``. Asymmetric: the group's range ``[min(w, 0), max(w, 0)]`` over
    15 steps, ``zero = round(-min / scale)``. An all-zero group gets scale 1.

    Returns:
        ``(q, scale, zero)``: uint8 ``[out, in]``, fp32 ``[out, in / group]``, uint8
        ``[out, in / group]``.
    """
    out_f, in_f = w.shape
    if in_f % group:
        raise ValueError(f"int4: {in_f} input features are not a multiple of group {group}")
    wg = w.float().reshape(out_f, in_f // group, group)
    if symmetric:
        amax = wg.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
        zero = torch.full_like(scale, 8.0)
    else:
        lo = wg.amin(dim=-1).clamp(max=0)
        hi = wg.amax(dim=-1).clamp(min=0)
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
        zero = (-lo / scale).round().clamp(0, 15)
    q = (wg / scale[..., None]).round() + zero[..., None]
    q = q.clamp(0, 15).reshape(out_f, in_f).to(torch.uint8)
    return q, scale, zero.to(torch.uint8)


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
) -> torch.Tensor:
    """The reference dequantization: fp32 ``(q - zero) * scale`` with ``scale`` and
    ``zero`` ``[out, in / group]`` repeated over each group of ``q`` ``[out, in]``."""
    z = zero.float().repeat_interleave(group, dim=1)
    s = scale.float().repeat_interleave(group, dim=1)
    return (q.float() - z) * s


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, in]`` values in ``[0, 15]`` as ``[out, in / 2]`` bytes: column ``2j``
    in the low four bits of byte ``j``, column ``2j + 1`` in the high four."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: ``[out, in / 2]`` bytes -> uint8 ``[out, in]``."""
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)


def scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """torch's int4 kernels' ``[in / group, out, 2]`` fp32 table from ``scale`` and
    ``zero`` ``[out, in / group]``: ``scale`` and the offset ``(8 - zero) * scale``."""
    s = scale.float()
    return torch.stack([s, (8.0 - zero.float()) * s], dim=-1).transpose(0, 1).contiguous()


def _inner_k_tiles(in_f: int) -> int:
    return 8 if in_f % 128 == 0 else 4 if in_f % 64 == 0 else 2


def layout_for(out_f: int, in_f: int, group: int, device: torch.device | str) -> str:
    """How :class:`Int4Linear` keeps a weight: "cpu" (the CPU kernel's packing), "cuda"
    (tinygemm's) or "plain" (:func:`pack_nibbles`, dequantized per call)."""
    dev = torch.device(device)
    if in_f % group:
        return "plain"
    if dev.type == "cpu" and out_f % CPU_N_MULTIPLE == 0:
        return "cpu"
    if dev.type == "cuda" and out_f % CUDA_N_MULTIPLE == 0 and in_f % CUDA_K_MULTIPLE == 0:
        return "cuda"
    return "plain"


class Int4Linear(nn.Module):
    """``y = x @ ((q - zero) * scale)^T + bias`` with the 4-bit weight packed for its
    device's kernel (module docstring). Build it with :meth:`from_int`.

    Attributes:
        weight: the packed weight (uint8 or int32; its layout is :attr:`layout`'s).
        scales_zeros: ``[in / group, out, 2]`` scales and offsets; follows the module's
            dtype (``Module.to(dtype)``), as the kernels want them in the activations'.
        group: input features per group.
    """

    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        scales_zeros: torch.Tensor,
        group: int,
        shape: tuple[int, int],
        layout: str,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.group, self.layout = group, layout
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scales_zeros = nn.Parameter(scales_zeros, requires_grad=False)
        b = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_parameter("bias", b)

    @classmethod
    def from_int(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group: int,
        bias: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> Int4Linear:
        """From uint8 ``q`` ``[out, in]``, fp32 ``scale`` and uint8 ``zero``
        ``[out, in / group]`` (:func:`quantize_int4`'s form), packed for ``device``."""
        out_f, in_f = q.shape
        layout = layout_for(out_f, in_f, group, device)
        q = q.to(device)
        if layout == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        elif layout == "cuda":
            nib = (q[:, 0::2] << 4) | q[:, 1::2]  # tinygemm's input: high nibble first
            packed = torch.ops.aten._convert_weight_to_int4pack(nib, _inner_k_tiles(in_f))
        else:
            packed = pack_nibbles(q)
        sz = scales_and_zeros(scale, zero).to(device)
        return cls(packed, sz, group, (out_f, in_f), layout, bias)

    def _apply(self, fn, recurse: bool = True):
        # the packed weight is a device's layout: a move to another device type is refused
        def move(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if t is self.weight and self.layout != "plain" and out.device.type != self.layout:
                raise RuntimeError(
                    f"an int4 weight packed for {self.layout} cannot move to {out.device}: "
                    "load the model on the device it runs on"
                )
            return out

        return super()._apply(move, recurse)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` the kernels compute with, ``(q - 8) * scale + offset``
        in fp32 then ``dtype`` (the "plain" layout; the packed layouts are the kernels'
        and are read back through the kernel, a row of the identity at a time)."""
        sz = self.scales_zeros.float()
        if self.layout == "plain":
            q = unpack_nibbles(self.weight).float()
            s = sz[..., 0].T.repeat_interleave(self.group, dim=1)
            o = sz[..., 1].T.repeat_interleave(self.group, dim=1)
            return ((q - 8.0) * s + o).to(dtype)
        eye = torch.eye(self.in_features, device=self.weight.device)
        return self.matmul(eye.to(self._kernel_dtype(eye))).T.to(dtype)

    def _kernel_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.bfloat16 if self.layout == "cuda" else x.dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` (no bias): ``x`` ``[..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.layout == "cpu":
            sz = self.scales_zeros.to(x.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self.weight, self.group, sz
            )
        elif self.layout == "cuda":
            sz = self.scales_zeros.to(torch.bfloat16)
            xb = x2.to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int4pack_mm(xb, self.weight, self.group, sz).to(x.dtype)
        else:
            y = F.linear(x2, self.dequantized(x.dtype))
        return cast(torch.Tensor, y).reshape(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, group={self.group}, "
            f"layout={self.layout}"
        )
