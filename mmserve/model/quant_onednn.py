"""The CPU's int8 W8A8 matmul through oneDNN (``torch.ops.onednn.qlinear_prepack`` and
``qlinear_pointwise``), for int8 linears above :data:`~mmserve.model.quant.INT8PACK_MAX_ROWS`
rows.

Same arithmetic as :func:`mmserve.model.quant.int8_w8a8_ref` (per-token int8 activations,
the exact int32 product, both scales in fp32): the activations are quantized per token
to ``[-127, 127]`` and handed to oneDNN as uint8 with zero point 128 (its native u8 x s8
product; s8 activations took ~350 ms a call here), unit scales and fp32 output (the
int32 sum rounded once, as ``_int_mm(...).float()`` rounds it); the per-token and
per-channel scales then multiply it in the reference's order, so the result has the
reference's bits.

Measured (``python -m benchmarks quant-rows``, benchmarks/README.md), 9728 x 896, one
thread, AVX-512 VNNI: 1.06 ms at 8 rows and 1.38 at 16 against 1.70 and 2.58 for
``torch._int_mm``. The weight is prepacked once, at load, into oneDNN's blocked layout:
a second copy of the int8 weight (1-4 rows keep the plain one for the weight-only
kernel), so int8 linears hold twice their int8 bytes on these CPUs (prefill always runs
more than 4 rows, so a lazy copy would only move the cost to the first request, after
the KV pool was sized).

Chosen at load time by CPU capability (:func:`available`): AVX-512 (VNNI) machines use
it; others (AVX2-only, measured on none here) keep ``torch._int_mm``. oneDNN's
``qlinear_pointwise`` crashes the process when given an unpacked weight, so only a
tensor from :func:`prepack` ever reaches it.
"""

from __future__ import annotations

import torch

#: CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) that run the oneDNN path.
CAPABILITIES = ("AVX512",)
_AVAILABLE: bool | None = None
_ENABLED = True


def enable(on: bool) -> None:
    """Allow (the default) or forbid the oneDNN path in this process
    (``EngineConfig.disable_int8_onednn``, ``--disable-int8-onednn``): set before the model loads,
    since each int8 linear makes its prepacked copy at load."""
    global _ENABLED
    _ENABLED = on


def available() -> bool:
    """Whether this process runs CPU int8 W8A8 through oneDNN: allowed (:func:`enable`),
    a build with oneDNN and its quantized linear ops, on a CPU whose capability is in
    :data:`CAPABILITIES`, and a prepack of a small weight that succeeds (checked once,
    cached)."""
    global _AVAILABLE
    if not _ENABLED:
        return False
    if _AVAILABLE is None:
        _AVAILABLE = _probe()
    return _AVAILABLE


def _probe() -> bool:
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        if torch.backends.cpu.get_cpu_capability() not in CAPABILITIES:
            return False
        q = torch.ones(16, 16, dtype=torch.int8)
        x = torch.ones(1, 16, dtype=torch.bfloat16)
        y = w8a8(x, prepack(q), torch.ones(16))
        return bool(torch.equal(y, torch.full((1, 16), 16.0, dtype=torch.bfloat16)))
    except (RuntimeError, AttributeError):
        return False


#: A weight's prepacked copy and what it was made from: ``((data_ptr, version), packed)``.
Packed = tuple[tuple[int, int], torch.Tensor]


def packed(w: torch.Tensor, cached: Packed | None) -> Packed | None:
    """``w``'s oneDNN copy: ``cached`` when it was made from this very tensor (same
    storage, no in-place change since), else a new :func:`prepack`; None (nothing made)
    when ``w`` is not an int8 CPU weight this path runs (a meta tensor before a
    tensor-parallel shard is assigned, a device, shapes the W8A8 rules refuse) or oneDNN
    is not :func:`available`. Made at load (:class:`~mmserve.model.quant.QuantizedLinear`'s
    constructor) so the KV pool, sized after loading, counts its memory."""
    key = (w.data_ptr(), w._version)
    if cached is not None and cached[0] == key:
        return cached
    out_f, in_f = w.shape
    if w.dtype != torch.int8 or w.device.type != "cpu" or in_f % 16 or out_f % 8:
        return None
    if not available():
        return None
    return key, prepack(w)


def prepack(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[out, in]`` int8 (CPU) in oneDNN's blocked layout (an opaque mkldnn tensor
    of shape ``[in, out]``), for :func:`w8a8`."""
    return torch.ops.onednn.qlinear_prepack(q.contiguous(), None)


def w8a8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, in]`` (bf16/fp16/fp32) times the int8 weight ``packed`` stands for, with
    per-output-channel fp32 ``scale`` ``[out]``: per-token int8 activations, oneDNN's
    u8 x s8 product with unit scales (the int32 sum rounded once to fp32, as
    ``_int_mm(...).float()``), then both scales in fp32 in the reference's order: the bits
    of :func:`mmserve.model.quant.int8_w8a8_ref`. Returns ``[T, out]`` in ``x.dtype``."""
    xf = x.float()
    xs = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    xu = (xf / xs).round_().clamp_(-127, 127).add_(128).to(torch.uint8)
    ones, zp = _unit(scale.shape[0])
    acc = torch.ops.onednn.qlinear_pointwise(
        xu, 1.0, 128, packed, ones, zp, None, 1.0, 0, torch.float32, "none", [], ""
    )
    return (acc.mul_(xs).mul_(scale[None, :])).to(x.dtype)


_UNITS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _unit(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit weight scales (fp32) and zero points (int64) ``[n]``, one pair per width."""
    if n not in _UNITS:
        _UNITS[n] = (torch.ones(n), torch.zeros(n, dtype=torch.long))
    return _UNITS[n]
