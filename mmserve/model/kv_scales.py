"""Per-layer fp8 KV-cache scales a checkpoint may carry (for ``--kv-cache-dtype fp8_e4m3``).

A scale is a dequantization factor, as in vLLM: the real K (or V) is the stored float8
value times the scale. Checkpoints give them as scalar tensors next to each decoder
layer's attention, under the names the quantization tools write:

* ``...layers.{i}.self_attn.k_scale`` and ``...self_attn.v_scale``: compressed-tensors
  (llm-compressor's ``kv_cache_scheme``) and vLLM's current layout;
* ``...layers.{i}.self_attn.kv_scale``: one scale for both (AutoFP8 and older vLLM);
* ``...layers.{i}.self_attn.k_proj.k_scale`` and ``...v_proj.v_scale``: NVIDIA ModelOpt.

Keys under a vision tower are not the decoder's and are skipped. A checkpoint with none
of these names gets 1.0 for every layer (the engine logs it); one with scales for some
layers only, a scale that is not one positive finite number, or two names for the same
scale is refused.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from mmserve.model.weights import CheckpointError, weight_files

_NAMES = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(k_scale|v_scale|kv_scale)|k_proj\.(k_scale)|v_proj\.(v_scale))$"
)


def read_kv_scales(
    model_dir: str | Path, num_layers: int
) -> tuple[list[float], list[float]] | None:
    """The checkpoint's per-layer ``(k_scales, v_scales)``, or None when it has none.

    Args:
        model_dir: checkpoint directory (safetensors files, as :func:`weight_files`).
        num_layers: decoder layers.

    Returns:
        Two lists of ``num_layers`` floats, or None (no scale in the checkpoint).

    Raises:
        CheckpointError: scales for only some layers, a layer index out of range, a scale
            tensor of more than one element or not positive and finite, or one scale
            given under two names; the message names the tensor.
    """
    from safetensors import safe_open  # transformers' dependency; only fp8 KV reads it

    model_dir = Path(model_dir)
    found: dict[tuple[int, str], tuple[float, str]] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # safe_open is no mapping
                m = _NAMES.search(key)
                if m is None or "vision" in key:
                    continue
                layer = int(m.group(1))
                name = m.group(2) or m.group(3) or m.group(4)
                t = f.get_tensor(key)
                value = float(t.float().reshape(-1)[0]) if t.numel() == 1 else math.nan
                if t.numel() != 1 or not 0 < value < math.inf:
                    raise CheckpointError(
                        f"{model_dir}: KV scale {key} must be one positive finite number "
                        f"(shape {tuple(t.shape)}); per-head KV scales are not supported"
                    )
                if layer >= num_layers:
                    raise CheckpointError(
                        f"{model_dir}: KV scale {key} is past layer {num_layers - 1}"
                    )
                for which in ("k", "v") if name == "kv_scale" else (name[0],):
                    if (layer, which) in found:
                        raise CheckpointError(
                            f"{model_dir}: KV scale {key} repeats {found[(layer, which)][1]}"
                        )
                    found[(layer, which)] = (value, key)
    if not found:
        return None
    missing = [
        f"{w}_scale of layer {i}" for i in range(num_layers) for w in "kv" if (i, w) not in found
    ]
    if missing:
        raise CheckpointError(
            f"{model_dir}: the checkpoint has KV scales for some layers only; missing "
            f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}"
        )
    k = [found[(i, "k")][0] for i in range(num_layers)]
    v = [found[(i, "v")][0] for i in range(num_layers)]
    return k, v
