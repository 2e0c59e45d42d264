"""4-bit weight-only linears (``--quantization int4``): grouped affine int4 weights.

A weight ``[out, in]`` is stored as 4-bit integers ``q`` in ``[0, 15]`` with one fp32
``scale`` and one integer ``zero`` in ``[0, 15]`` per output row and group of ``group``
consecutive input features; the weight it stands for is ``(q - zero) * scale``
(:func:`dequantize_int4`: the reference dequantization every checkpoint format is
unpacked to). Symmetric quantization is ``zero = 8``.

:class:`Int4Linear` keeps the weight packed for the kernel of its device and computes
``x @ W^T + bias`` through it:

* CPU: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (fp32, bf16 and fp16 activations;
  output rows a multiple of 16) up to :data:`CPU_KERNEL_MAX_ROWS` rows. It unpacks every
  weight again for each row (one thread, 9728 x 896, bf16: 0.5 ms at 1 row against 1.0
  for the int8 kernel and 2.0 for bf16, but 1.7 at 8 rows, 21 at 64, 30 at 128), so
  above that a step dequantizes the weight once into a reusable buffer (:func:`dequant_buffer`,
  ~15-20 ms for that matrix) and runs the dense matmul: measured crossover between 64
  and 128 rows on all three of OneVision-0.5B's matrix shapes (``python -m benchmarks
  quant-rows``; benchmarks/README.md). Decode batches stay on the kernel.
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

import threading

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


#: torch's CPU int4 packing works in blocks of this many output rows.
CPU_BLOCK_N = 64


def unpack_cpu(packed: torch.Tensor, out_f: int, in_f: int, interleaved: bool) -> torch.Tensor:
    """uint8 ``q`` ``[out, in]`` from ``_convert_weight_to_int4pack_for_cpu``'s bytes
    ``[out, in / 2]`` (torch 2.5-2.13's layout; :meth:`Int4Linear.from_int` checks it on
    every matrix it packs). Rows go in blocks of :data:`CPU_BLOCK_N`, each block ``[in,
    rows / 2]`` bytes; in a full block of an AVX-512 build (``interleaved``) byte ``d`` of
    an input feature holds rows ``d`` and ``d + 32``, byte ``16 + d`` rows ``d + 16`` and
    ``d + 48``; otherwise byte ``j`` holds rows ``2j`` and ``2j + 1`` (low nibble first)."""
    flat = packed.reshape(-1)
    full, tail = divmod(out_f, CPU_BLOCK_N)
    out = torch.empty(out_f, in_f, dtype=torch.uint8, device=packed.device)
    half = CPU_BLOCK_N // 2
    if full:
        b = flat[: full * in_f * half].view(full, in_f, half)
        dst = out[: full * CPU_BLOCK_N].view(full, CPU_BLOCK_N, in_f)
        if interleaved:  # rows d, d + 16 low; d + 32, d + 48 high
            dst[:, :half].copy_((b & 15).transpose(1, 2))
            dst[:, half:].copy_((b >> 4).transpose(1, 2))
        else:
            dst[:, 0::2].copy_((b & 15).transpose(1, 2))
            dst[:, 1::2].copy_((b >> 4).transpose(1, 2))
    if tail:
        b = flat[full * in_f * half :].view(in_f, tail // 2)
        out[full * CPU_BLOCK_N :: 2].copy_((b & 15).T)
        out[full * CPU_BLOCK_N + 1 :: 2].copy_((b >> 4).T)
    return out


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


#: Rows above which a CPU int4 matmul dequantizes the weight into a reusable buffer and
#: runs the dense matmul (measured, ``python -m benchmarks quant-rows``: see the module
#: docstring).
CPU_KERNEL_MAX_ROWS = 96
#: Reusable dequantization buffers, by thread, dtype and device, each as big as the
#: largest matrix dequantized (a thread runs its layers one at a time; engines in other
#: threads get their own).
_BUFFERS: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}


def dequant_buffer(layer: Int4Linear, dtype: torch.dtype) -> torch.Tensor:
    """``layer``'s transposed weight ``[in, out]`` dequantized into the shared buffer of
    ``dtype`` (:meth:`Int4Linear.dequantized_t`; valid until the next call)."""
    key = (threading.get_ident(), dtype, str(layer.weight.device))
    n = layer.out_features * layer.in_features
    buf = _BUFFERS.get(key)
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or buf.numel() < n or stale:  # (an inference tensor: written outside)
        buf = _BUFFERS[key] = torch.empty(n, dtype=dtype, device=layer.weight.device)
    out = buf[:n].view(layer.in_features, layer.out_features)
    return layer.dequantized_t(dtype, out=out)


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
    #: how the CPU packing was read back ("interleaved", "pairs"; "" when not)
    unpacked_as: str = ""

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
        unpacked_as = ""
        if layout == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            for way, inter in (("interleaved", True), ("pairs", False)):
                if torch.equal(unpack_cpu(packed, out_f, in_f, inter), q):
                    unpacked_as = way
                    break
        elif layout == "cuda":
            nib = (q[:, 0::2] << 4) | q[:, 1::2]  # tinygemm's input: high nibble first
            packed = torch.ops.aten._convert_weight_to_int4pack(nib, _inner_k_tiles(in_f))
        else:
            packed = pack_nibbles(q)
        sz = scales_and_zeros(scale, zero).to(device)
        new = cls(packed, sz, group, (out_f, in_f), layout, bias)
        new.unpacked_as = unpacked_as
        if layout == "cpu" and not unpacked_as:  # a packing this file does not know:
            new.register_buffer("plain", pack_nibbles(q), persistent=False)  # keep ours too
        return new

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

    def _q_t_into(self, out: torch.Tensor) -> bool:
        """Write ``q^T`` ``[in, out]`` into ``out`` (any dtype); False where only the
        kernel can read the weight. From the CPU packing it is written block by block
        in the packed order (contiguous runs of 32 rows), so no full transpose is made."""
        n, k = self.out_features, self.in_features
        if self.layout == "cpu" and self.unpacked_as:
            flat = self.weight.reshape(-1)
            full, tail = divmod(n, CPU_BLOCK_N)
            half = CPU_BLOCK_N // 2
            if full:
                b = flat[: full * k * half].view(full, k, half).transpose(0, 1)  # [k, full, 32]
                dst = out[:, : full * CPU_BLOCK_N].view(k, full, CPU_BLOCK_N)
                lo, hi = (
                    (dst[..., :half], dst[..., half:])
                    if self.unpacked_as == "interleaved"
                    else (dst[..., 0::2], dst[..., 1::2])
                )
                lo.copy_(b & 15)
                hi.copy_(b >> 4)
            if tail:
                b = flat[full * k * half :].view(k, tail // 2)
                out[:, full * CPU_BLOCK_N :: 2].copy_(b & 15)
                out[:, full * CPU_BLOCK_N + 1 :: 2].copy_(b >> 4)
            return True
        packed = self.weight if self.layout == "plain" else self._buffers.get("plain")
        if packed is None:
            return False
        out.copy_(unpack_nibbles(packed).T)
        return True

    def dequantized_t(
        self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The transposed weight ``[in, out]`` the kernels compute with, ``(q - 8) *
        scale + offset`` in ``dtype`` (written into ``out`` when given); a layout only
        its kernel reads (CUDA's) is read back through the kernel (the identity's rows)."""
        n, k, g = self.out_features, self.in_features, self.group
        if out is None:
            out = torch.empty(k, n, dtype=dtype, device=self.weight.device)
        if not self._q_t_into(out):
            eye = torch.eye(k, device=self.weight.device, dtype=torch.bfloat16)
            return out.copy_(self.matmul(eye))
        sz = self.scales_zeros.to(dtype)
        scale = sz[..., 0].contiguous()  # [groups, out]: a strided operand is ~7x slower
        offset = sz[..., 1] - 8 * scale  # (q - 8) * s + o = q * s + (o - 8 s)
        w = out.view(k // g, g, n)
        w.mul_(scale[:, None, :]).add_(offset[:, None, :])
        return out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` the kernels compute with (:meth:`dequantized_t`)."""
        return self.dequantized_t(dtype).T

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` (no bias): ``x`` ``[..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.layout == "cpu" and x2.shape[0] > CPU_KERNEL_MAX_ROWS and self.unpacked_as:
            y = torch.mm(x2, dequant_buffer(self, x.dtype))
        elif self.layout == "cpu":
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
        return y.reshape(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, group={self.group}, "
            f"layout={self.layout}"
        )
