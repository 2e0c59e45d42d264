"""Weight quantization of the decoder's linear layers: int8 and fp8 (e4m3), per output
channel, symmetric.

A quantized linear keeps ``weight`` ``[out, in]`` (int8, or float8_e4m3fn) and fp32
``weight_scale`` ``[out]``; its dequantized weight is ``weight * weight_scale[:, None]``,
and :meth:`QuantizedLinear.forward` computes ``x @ dequantized^T + bias`` through the
fastest kernel that exists for the case (picked per call, by device, dtype and rows):

* int8, CPU, bf16 activations, at most :data:`INT8PACK_MAX_ROWS` rows (and input
  features a multiple of :data:`INT8PACK_K_MULTIPLE`): torch's weight-only int8 matmul
  (``torch.ops.aten._weight_int8pack_mm``), measured here at 896 x 4864 on one thread:
  0.40 ms against 1.64 for the bf16 matmul at 1 row, 0.99 vs 1.38 at 4, but 2.3 vs 1.9 at
  8 and 11 vs 4.5 at 64 (it does the work of each row again); with fp32 activations
  3-40x slower than fp32 (never used);
* int8, CPU, bf16 activations, more rows (features multiples of :data:`INT_MM_MULTIPLE`):
  W8A8 as on CUDA below, which reads the weight once for all rows: oneDNN's prepacked
  u8 x s8 matmul on AVX-512 CPUs (:mod:`mmserve.model.quant_onednn`: 1.1 ms at 8 rows of
  9728 x 896 on one thread), else ``torch._int_mm`` (1.7 ms, against 2.5 for the int8
  kernel in chunks and 2.5 for bf16; ``python -m benchmarks quant-rows``,
  benchmarks/README.md);
* fp8 on CUDA with compute capability >= 8.9, bf16 or fp16 activations:
  ``torch._scaled_mm`` with the activations quantized per token on the fly (dynamic
  per-token scales, as vLLM's fp8 W8A8 does); its CPU twin is :func:`fp8_w8a8_ref`;
* int8 on CUDA (input and output features multiples of 8): ``torch._int_mm`` (int8 x
  int8 -> int32) on activations quantized to int8 per token on the fly (W8A8, dynamic
  per-token scales), rows padded to more than 16 (cuBLASLt's rule); its CPU twin is
  :func:`int8_w8a8_ref`. No per-call copy of the weight is made;
* otherwise the dequantized matmul (prefill-sized CPU batches; fp32; shapes the fast
  paths refuse): ``linear(x, weight.to(x.dtype)) * scale``, except in fp16, whose range
  (65504) the unscaled product of real activations and raw int8/fp8 values exceeds:
  there the weight is dequantized to fp16 with its scale folded in first, a block of
  output channels at a time (:data:`DEQUANT_BLOCK_BYTES` of fp32 temporary), so no
  intermediate leaves the true result's range.

fp8 is refused on the CPU (:func:`check_quantization`): torch's CPU ``_scaled_mm`` took
~27 ms for that projection (17x the bf16 matmul) and upcasting fp8 weights ~20 ms.

Symmetric per-channel scales: Jacob et al., "Quantization and Training of Neural Networks
for Efficient Integer-Arithmetic-Only Inference" (arXiv 1712.05877), Section 2; fp8 e4m3:
Micikevicius et al., "FP8 Formats for Deep Learning" (arXiv 2209.05433).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.config import CHECKPOINT_QUANTIZATIONS, QUANTIZATIONS
from mmserve.model import quant_onednn
from mmserve.model.int4_formats import SUPPORTED_INT4, Int4Format, Int4FormatError

__all__ = [
    "QUANTIZATIONS",
    "QuantizedLinear",
    "QuantizationError",
    "check_quantization",
]
#: Storage dtype of each method's weights.
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
#: Largest magnitude each storage dtype holds (the scale maps a row's max |w| to it).
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: Rows up to which the CPU int8 kernel beats the bf16 matmul (measured; module docstring).
INT8PACK_MAX_ROWS = 4
#: The CPU int8 kernel needs input features in multiples of this (torch 2.13 crashes or
#: returns garbage at 8, 40 or 100; 16, 48, 80, 896 and 4864 are exact).
INT8PACK_K_MULTIPLE = 16
#: ``torch._int_mm`` needs more rows than this (cuBLASLt int8); fewer are zero-padded.
INT_MM_MIN_ROWS = 17
#: ... and input and output features that are multiples of this.
INT_MM_MULTIPLE = 8
#: fp32 temporary bytes of one block of output channels in the fp16 dequantized matmul.
DEQUANT_BLOCK_BYTES = 32 << 20


class QuantizationError(ValueError):
    """A quantization setting or checkpoint this build cannot serve; the message names the
    flag or method and what is supported."""


def check_quantization(method: str, device: str) -> None:
    """Refuse a ``--quantization`` value (or a checkpoint's method) ``device`` cannot run.

    Raises:
        QuantizationError: for an unknown method, fp8 on the CPU (no fp8 matmul: use int8),
            or fp8 on a CUDA device below compute capability 8.9.
    """
    if method not in QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS:
        choices = ", ".join(QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS)
        raise QuantizationError(f"unknown --quantization {method!r}; choose one of {choices}")
    if method in ("none", "int8", "int4", *CHECKPOINT_QUANTIZATIONS):
        return
    if not str(device).startswith("cuda"):
        raise QuantizationError(
            "--quantization fp8 needs a CUDA GPU with compute capability >= 8.9 (fp8 "
            "matmuls); the CPU has none: use --quantization int8 (weight-only int8) instead"
        )
    cc = torch.cuda.get_device_capability(torch.device(device))
    if cc < (8, 9):
        raise QuantizationError(
            f"--quantization fp8 needs compute capability >= 8.9, this GPU has "
            f"{cc[0]}.{cc[1]}: use --quantization int8 instead"
        )


def quantize_per_channel(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of ``w`` ``[out, in]``.

    ``scale = max|w_row| / QMAX`` (1 for an all-zero row) and ``q = w / scale``, rounded to
    the nearest int8 in ``[-127, 127]``, or cast to float8_e4m3fn (round to nearest even).

    Returns:
        ``(q, scale)``: ``[out, in]`` in :data:`STORAGE` ``[method]`` and fp32 ``[out]``.
    """
    dtype = STORAGE[method]
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))
    return quantize_with_scale(w, scale, method), scale


def quantize_rows_into(
    w: torch.Tensor, method: str, q_out: torch.Tensor, scale_out: torch.Tensor
) -> None:
    """:func:`quantize_per_channel` of ``w`` ``[rows, in]`` written into ``q_out``
    ``[rows, in]`` (:data:`STORAGE` ``[method]``) and ``scale_out`` ``[rows]`` (fp32), the
    same values, with one fp32 temporary of ``w``'s size (none when ``w`` is fp32 already
    and may be overwritten: it is divided in place). For loading a matrix a slice at a
    time without whole-matrix fp32 temporaries."""
    dtype = STORAGE[method]
    w = w.float()
    amax = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg())  # max |w| without |w|'s copy
    scale = torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))
    w.div_(scale[:, None])
    if dtype == torch.int8:
        w.round_().clamp_(-127, 127)
    q_out.copy_(w)
    scale_out.copy_(scale)


def quantize_with_scale(w: torch.Tensor, scale: torch.Tensor, method: str) -> torch.Tensor:
    """``w`` ``[out, k]`` quantized with given per-row ``scale`` ``[out]`` (as
    :func:`quantize_per_channel` rounds): a column slice of a matrix whose scales come
    from its whole rows (a tensor-parallel rank's ``o_proj`` / ``down_proj``)."""
    dtype = STORAGE[method]
    q = w.float() / scale[:, None]
    if dtype == torch.int8:
        q = q.round().clamp(-127, 127)
    return q.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale[:, None]``: the weight a quantized linear stands for."""
    return q.float() * scale.float()[:, None]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token fp8 activations: each row of ``x`` ``[T, in]`` divided by its
    own scale ``max|x_row| / 448`` and cast to e4m3.

    Returns:
        ``(xq, xs)``: float8_e4m3fn ``[T, in]`` and fp32 ``[T, 1]`` scales.
    """
    qmax = QMAX[torch.float8_e4m3fn]
    xs = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax
    return (x.float() / xs).clamp(-qmax, qmax).to(torch.float8_e4m3fn), xs


def fp8_w8a8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What :meth:`QuantizedLinear.forward` computes on the fp8 matmul path, in torch:
    ``x`` ``[T, in]`` quantized per token (:func:`quantize_per_token`), the product of the
    upcast operands in fp32, both scales applied, rounded to ``x.dtype``. Returns
    ``[T, out]`` (no bias)."""
    xq, xs = quantize_per_token(x)
    y = (xq.float() @ q.float().T) * xs * scale.float()[None, :]
    return y.to(x.dtype)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 activations: each row of ``x`` ``[T, in]`` divided by its
    own scale ``max|x_row| / 127``, rounded to the nearest and clamped to ``[-127, 127]``.

    Returns:
        ``(xq, xs)``: int8 ``[T, in]`` and fp32 ``[T, 1]`` scales.
    """
    xf = x.float()
    xs = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    return (xf / xs).round_().clamp_(-127, 127).to(torch.int8), xs


def int8_w8a8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What :meth:`QuantizedLinear.forward` computes on the CUDA int8 path, on any device:
    ``x`` ``[T, in]`` quantized per token (:func:`quantize_per_token_int8`), the exact
    integer product ``xq @ q^T`` (in fp64, exact for ``in < 2**39``: what ``_int_mm``'s
    int32 accumulator holds), both scales applied in fp32, rounded to ``x.dtype``.
    Returns ``[T, out]`` (no bias)."""
    xq, xs = quantize_per_token_int8(x)
    acc = (xq.double() @ q.double().T).float()
    return (acc * xs * scale.float()[None, :]).to(x.dtype)


def _int_mm_w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The CUDA int8 path: per-token int8 activations, ``torch._int_mm`` against the
    stored weight (``w.T``: column-major, as cuBLASLt wants), scales applied to the int32
    accumulator in fp32. On CUDA rows are zero-padded to :data:`INT_MM_MIN_ROWS`."""
    xq, xs = quantize_per_token_int8(x)
    n = xq.shape[0]
    if n < INT_MM_MIN_ROWS and _on_cuda(x):
        xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - n))
    acc = torch._int_mm(xq, w.T)[:n]
    return (acc.float() * xs * s[None, :]).to(x.dtype)


def _dequant_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x @ (w * s[:, None])^T`` in ``x.dtype``. fp16: the weight is dequantized with its
    scale folded in (fp32 product, then rounded to fp16) a block of output channels at a
    time, so neither the product nor the temporaries overflow fp16's range; other dtypes
    (fp32, bf16: fp32's range) scale the output."""
    if x.dtype != torch.float16:
        return F.linear(x, w.to(x.dtype)) * s.to(x.dtype)
    out = x.new_empty(*x.shape[:-1], w.shape[0])
    rows = max(1, DEQUANT_BLOCK_BYTES // (4 * w.shape[1]))
    for lo in range(0, w.shape[0], rows):
        hi = min(lo + rows, w.shape[0])
        wd = (w[lo:hi].float() * s[lo:hi, None]).to(x.dtype)
        out[..., lo:hi] = F.linear(x, wd)
    return out


def _on_cuda(x: torch.Tensor) -> bool:
    # one place the kernel choice asks for the device (tests put the CPU in its stead)
    return x.is_cuda


def _fp8_mm_ok(x: torch.Tensor) -> bool:
    return (
        _on_cuda(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device) >= (8, 9)
    )


#: Whether ``_scaled_mm`` writes fp16 with row-wise scales on this build (None: not tried
#: yet). Builds that refuse it get bf16 output, then rounded to fp16.
_FP8_FP16_OUT: bool | None = None


def _scaled_mm_w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    global _FP8_FP16_OUT
    xq, xs = quantize_per_token(x)
    sb = s[None, :]
    if x.dtype == torch.float16 and _FP8_FP16_OUT is not False:
        try:
            y = torch._scaled_mm(xq, w.T, scale_a=xs, scale_b=sb, out_dtype=torch.float16)
            _FP8_FP16_OUT = True
            return y
        except RuntimeError:
            _FP8_FP16_OUT = False
    return torch._scaled_mm(xq, w.T, scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16).to(x.dtype)


def kernel_for(w: torch.Tensor, x: torch.Tensor) -> str:
    """The kernel :meth:`QuantizedLinear.matmul` runs for stored weight ``w`` ``[out, in]``
    and activations ``x`` ``[T, in]``: "int8pack" (CPU weight-only int8), "scaled_mm" (fp8
    W8A8), "onednn" (int8 W8A8 on the CPU above :data:`INT8PACK_MAX_ROWS` bf16 rows where
    :func:`quant_onednn.available`), "int_mm" (int8 W8A8, CUDA, or the CPU's above those
    rows without oneDNN) or "dequant" (the dequantized matmul)."""
    out_f, in_f = w.shape
    if x.dim() != 2:  # the fast kernels are 2-D matmuls
        return "dequant"
    if (
        w.dtype == torch.int8
        and x.device.type == "cpu"
        and not _on_cuda(x)
        and x.dtype == torch.bfloat16
        and in_f % INT8PACK_K_MULTIPLE == 0
    ):
        if x.shape[0] <= INT8PACK_MAX_ROWS:
            return "int8pack"
        if out_f % INT_MM_MULTIPLE == 0:  # the CPU's W8A8: every row in one weight pass
            return "onednn" if quant_onednn.available() else "int_mm"
    if w.dtype == torch.float8_e4m3fn and in_f % 16 == 0 and out_f % 16 == 0 and _fp8_mm_ok(x):
        return "scaled_mm"  # 16: _scaled_mm's shape rule
    if (
        w.dtype == torch.int8
        and _on_cuda(x)
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and in_f % INT_MM_MULTIPLE == 0
        and out_f % INT_MM_MULTIPLE == 0
    ):
        return "int_mm"
    return "dequant"


class QuantizedLinear(nn.Module):
    """``y = x @ (weight * weight_scale[:, None])^T + bias`` with ``weight`` stored
    quantized (see the module docstring for the kernel each case runs).

    Args:
        weight: ``[out, in]`` int8 or float8_e4m3fn.
        weight_scale: ``[out]`` scales (kept fp32).
        bias: ``[out]`` in the compute dtype, or None.
    """

    bias: torch.Tensor | None  # registered in __init__ (a parameter, or None)

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        if weight.dtype not in QMAX:
            raise ValueError(f"quantized weight must be int8 or float8_e4m3fn, got {weight.dtype}")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.float().reshape(-1), requires_grad=False)
        b = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_parameter("bias", b)
        self._onednn = quant_onednn.packed(self.weight, None)  # at load: the KV pool sees it

    def _apply(self, fn, recurse: bool = True):
        # ``Module.to(dtype)`` casts every floating tensor: the 8-bit weight and the fp32
        # scales keep their dtype (moves between devices still apply); the bias follows.
        def move(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.dtype == t.dtype or not (t is self.weight or t is self.weight_scale):
                return out
            return t.to(device=out.device)

        out = super()._apply(move, recurse)
        self._onednn = quant_onednn.packed(self.weight, self._onednn)  # dropped off the CPU
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ dequantized^T`` (no bias): ``x`` ``[T, in]`` -> ``[T, out]``, ``x.dtype``."""
        w: torch.Tensor = self.weight
        s: torch.Tensor = self.weight_scale
        kernel = kernel_for(w, x)
        if kernel == "int8pack":
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), w, s.to(x.dtype))
        if kernel == "scaled_mm":
            return _scaled_mm_w8a8(x, w, s)
        if kernel == "onednn":
            self._onednn = quant_onednn.packed(w, self._onednn)  # again if w was replaced
            return quant_onednn.w8a8(x, self._onednn[1], s)  # type: ignore[index]
        if kernel == "int_mm":
            return _int_mm_w8a8(x, w, s)
        return _dequant_matmul(x, w, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, out]`` in ``x.dtype``."""
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight={self.weight.dtype}"


def target_modules(num_layers: int, quantize_head: bool) -> list[str]:
    """Names of the decoder's linear modules that quantization replaces: every layer's
    ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, then ``lm_head`` when
    ``quantize_head``. (The vision tower and projector are never quantized, as peers do.)"""
    names = []
    for i in range(num_layers):
        names += [f"layers.{i}.self_attn.{m}" for m in ("qkv_proj", "o_proj")]
        names += [f"layers.{i}.mlp.{m}" for m in ("gate_up_proj", "down_proj")]
    return names + (["lm_head"] if quantize_head else [])


def scale_key(weight_key: str) -> str:
    """compressed-tensors' scale tensor beside ``<module>.weight``: ``<module>.weight_scale``."""
    return weight_key.removesuffix("weight") + "weight_scale"


def row_scales(stored: torch.Tensor, rows: int) -> torch.Tensor:
    """A stored ``weight_scale`` (per channel ``[rows, 1]`` / ``[rows]``, or per tensor
    ``[1]`` / ``[]``) as ``[rows]`` per-row scales (a per-tensor one broadcast)."""
    sc = stored.reshape(-1)
    return sc.expand(rows) if sc.numel() == 1 else sc


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at dotted ``name`` inside ``root``."""
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


#: compressed-tensors ``format`` values whose 8-bit weights are stored as they are
#: (int8 or float8_e4m3fn tensors with a ``weight_scale`` beside each).
CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
#: What a checkpoint's ``quantization_config`` may be, in words (for refusals).
SUPPORTED_CHECKPOINTS = (
    "compressed-tensors checkpoints with 8-bit symmetric int or float (e4m3) weights, per "
    f"channel or per tensor (format {', '.join(CT_FORMATS)}), and {SUPPORTED_INT4}"
)


def checkpoint_method(quantization_config: dict | None) -> str:
    """The method (:data:`QUANTIZATIONS`) a checkpoint's ``quantization_config`` (from its
    config.json) stores its decoder weights in: "none" without one, or for a
    compressed-tensors config that quantizes the KV cache only (a ``kv_cache_scheme``
    and no weight ``config_groups``, ``format`` "dense", as llm-compressor writes for
    KV-only calibration; the scheme is :func:`kv_cache_scheme`'s to check).

    Raises:
        QuantizationError: for any method but compressed-tensors, or a compressed-tensors
            config this loader cannot serve (not 8-bit, asymmetric, grouped or blocked
            scales, packed formats, static activation scales, an unsupported
            ``kv_cache_scheme``), naming what it found and what is supported.
    """
    if not quantization_config:
        return "none"
    qc = dict(quantization_config)
    method = qc.get("quant_method")
    if method in ("awq", "gptq"):
        int4_format(qc)  # refuses a layout it cannot serve
        return "int4"
    if method != "compressed-tensors":
        raise QuantizationError(
            f"the checkpoint's quantization method {method!r} (config.json "
            f"quantization_config) is not supported: mmserve serves {SUPPORTED_CHECKPOINTS}, "
            "or quantizes an unquantized checkpoint at load with --quantization int8, int4 "
            "or fp8"
        )
    if qc.get("format") == "pack-quantized":
        kv_cache_scheme(qc)
        int4_format(qc)
        return "int4"
    kv_cache_scheme(qc)  # refuses a KV scheme it cannot serve, whatever the weights are
    groups = {n: g or {} for n, g in (qc.get("config_groups") or {}).items()}
    fmt = qc.get("format")
    if not any(g.get("weights") for g in groups.values()) and fmt in (None, "dense", *CT_FORMATS):
        # no weight scheme: dense weights (a KV-only config)
        if groups:
            raise QuantizationError(
                f"compressed-tensors config_groups {sorted(groups)} quantize no weights "
                "(activations only, static scales): mmserve serves "
                f"{SUPPORTED_CHECKPOINTS}, or dense weights with a kv_cache_scheme"
            )
        return "none"
    if fmt not in CT_FORMATS:
        raise QuantizationError(
            f"compressed-tensors format {fmt!r} is not supported: mmserve serves "
            f"{SUPPORTED_CHECKPOINTS}"
        )
    kinds = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        ok = (
            w.get("num_bits") == 8
            and w.get("type") in ("int", "float")
            and w.get("symmetric", True)
            and w.get("strategy") in ("channel", "tensor")
        )
        act = group.get("input_activations")
        if act and not act.get("dynamic", False):
            ok = False  # static activation scales: no kernel here reads them
        if not ok:
            raise QuantizationError(
                f"compressed-tensors group {name!r} ({w.get('num_bits')}-bit {w.get('type')}, "
                f"strategy {w.get('strategy')!r}, symmetric {w.get('symmetric', True)}, "
                f"activations {act}) is not supported: mmserve serves {SUPPORTED_CHECKPOINTS} "
                "with no or dynamic activation quantization"
            )
        kinds.add("int8" if w["type"] == "int" else "fp8")
    if len(kinds) != 1:
        raise QuantizationError(
            f"compressed-tensors config_groups hold {sorted(kinds) or 'no'} weight types: "
            f"mmserve serves {SUPPORTED_CHECKPOINTS}, one weight type per checkpoint"
        )
    return kinds.pop()


#: What a ``kv_cache_scheme`` may be, in words (for refusals).
SUPPORTED_KV_SCHEMES = (
    "8-bit float (e4m3) K/V, symmetric, one static scale per layer (strategy 'tensor'), "
    "served with --kv-cache-dtype fp8_e4m3 (or auto)"
)


def kv_cache_scheme(quantization_config: dict | None) -> dict | None:
    """A compressed-tensors checkpoint's ``kv_cache_scheme`` (llm-compressor's KV-cache
    quantization: fp8 K/V with per-layer ``k_scale`` / ``v_scale`` tensors), or None when
    the config has none (or is no compressed-tensors config).

    Raises:
        QuantizationError: for a scheme that is not 8-bit float, symmetric, static and
            per tensor (per-head or per-token KV scales, int8 KV), naming what it found
            and what is supported.
    """
    qc = dict(quantization_config or {})
    scheme = qc.get("kv_cache_scheme")
    if qc.get("quant_method") != "compressed-tensors" or not scheme:
        return None
    ok = (
        scheme.get("num_bits") == 8
        and scheme.get("type") == "float"
        and scheme.get("symmetric", True)
        and scheme.get("strategy", "tensor") == "tensor"
        and not scheme.get("dynamic", False)
    )
    if not ok:
        raise QuantizationError(
            f"compressed-tensors kv_cache_scheme ({scheme.get('num_bits')}-bit "
            f"{scheme.get('type')}, strategy {scheme.get('strategy')!r}, symmetric "
            f"{scheme.get('symmetric', True)}, dynamic {scheme.get('dynamic', False)}) is not "
            f"supported: mmserve serves {SUPPORTED_KV_SCHEMES}"
        )
    return dict(scheme)


def resolve_method(flag: str, stored: str, qc: dict | None = None) -> str:
    """The method to serve: the checkpoint's (``stored``) when it has one, else ``flag``.
    A ``flag`` naming a checkpoint format (:data:`CHECKPOINT_QUANTIZATIONS`) asks for the
    checkpoint's own weights, in that format (``qc``'s ``quant_method``).

    Raises:
        QuantizationError: when both are set and differ (re-quantizing quantized weights is
            not done), or ``flag`` names a format the checkpoint is not in.
    """
    if flag in CHECKPOINT_QUANTIZATIONS:
        kind = dict(qc or {}).get("quant_method")
        if stored == "none" or kind != flag:
            found = f"{kind!r} weights" if stored != "none" else "no quantized weights"
            raise QuantizationError(
                f"--quantization {flag} asks for a {flag} checkpoint, but this one has "
                f"{found} (config.json quantization_config): drop the flag, or quantize "
                "at load with --quantization int8 or int4"
            )
        return stored
    if stored == "none":
        return flag
    if flag not in ("none", stored):
        raise QuantizationError(
            f"--quantization {flag} conflicts with the checkpoint, whose weights are already "
            f"{stored} (compressed-tensors): drop the flag or use --quantization {stored}"
        )
    return stored


def int4_format(qc: dict | None) -> Int4Format | None:
    """:meth:`Int4Format.parse` with its refusal as a :class:`QuantizationError`."""
    try:
        return Int4Format.parse(qc)
    except Int4FormatError as e:
        raise QuantizationError(str(e)) from None
