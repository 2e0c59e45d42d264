"""Per-layer fp8 KV-cache scales a checkpoint may carry (for ``--kv-cache-dtype fp8_e4m3``).

A scale is a dequantization factor, as in vLLM: the real K (or V) is the stored float8
value times the scale. Checkpoints give them as scalar tensors next to each decoder
layer's attention, under the names the quantization tools write:

* ``...layers.{i}.self_attn.k_scale`` and ``...self_attn.v_scale``: compressed-tensors
  (llm-compressor's ``kv_cache_scheme``) and vLLM's current layout;
* ``...layers.{i}.self_attn.kv_scale``: one scale for both (AutoFP8 and older vLLM);
* ``...layers.{i}.self_attn.k_proj.k_scale`` and ``...v_proj.v_scale``: NVIDIA ModelOpt.

Keys under a vision tower are not the decoder's and are skipped. A checkpoint with none
of these names gets 1.0 for every layer; one with scales for some layers only, a scale
that is not one positive finite number, or two names for the same scale is refused.
:func:`kv_scale_plan` decides, for an engine, whether the pool is fp8 (``--kv-cache-dtype
fp8_e4m3``, or ``auto`` on a checkpoint whose compressed-tensors ``kv_cache_scheme`` asks
for fp8 K/V) and says in one log line where the scales come from (the tensor names found,
or 1.0 and why) and their range.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from mmserve.model.weights import CheckpointError, weight_files

#: The documented namings, each as the pattern of its tensors' names (layer index "N").
NAMINGS = {
    "k_scale": "self_attn.k_scale / self_attn.v_scale (compressed-tensors kv_cache_scheme, vLLM)",
    "kv_scale": "self_attn.kv_scale, one for K and V (AutoFP8, older vLLM)",
    "proj": "self_attn.k_proj.k_scale / v_proj.v_scale (NVIDIA ModelOpt)",
}

_NAMES = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(k_scale|v_scale|kv_scale)|k_proj\.(k_scale)|v_proj\.(v_scale))$"
)


@dataclass
class KVScales:
    """Per-layer K and V scales read from a checkpoint, and where they were found.

    Attributes:
        k, v: ``num_layers`` positive floats each (dequantization factors).
        keys: every tensor name read, in layer order.
        namings: which of :data:`NAMINGS` the names follow (keys of it, sorted).
    """

    k: list[float]
    v: list[float]
    keys: list[str]
    namings: list[str]

    def patterns(self) -> list[str]:
        """The distinct tensor names with the layer index written ``N``, with counts
        (``"24 x language_model.model.layers.N.self_attn.k_scale"``)."""
        counts: dict[str, int] = {}
        for key in self.keys:
            p = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.N.", key)
            counts[p] = counts.get(p, 0) + 1
        return [f"{n} x {p}" for p, n in sorted(counts.items())]

    def names(self) -> str:
        """The tensor names read: all of them up to :data:`LISTED_NAMES`, else the first
        and last layer's, around an ellipsis."""
        if len(self.keys) <= LISTED_NAMES:
            return ", ".join(self.keys)
        per_layer = len(self.keys) // max(1, len(self.k))
        return f"{', '.join(self.keys[:per_layer])}, ..., {', '.join(self.keys[-per_layer:])}"

    def describe(self) -> str:
        """Where the scales came from (patterns with counts, the names, the naming they
        follow) and their range, in words (for the log)."""
        return (
            f"read from the checkpoint: {', '.join(self.patterns())} "
            f"({'; '.join(NAMINGS[n] for n in self.namings)}): {self.names()}; "
            f"range {_range(self.k, self.v)}"
        )


#: Tensor names listed one by one in the log, at most (beyond: the first and last layer's).
LISTED_NAMES = 8


def _range(k: list[float], v: list[float]) -> str:
    return f"k_scale min {min(k):.6g} max {max(k):.6g}, v_scale min {min(v):.6g} max {max(v):.6g}"


def read_kv_scales(
    model_dir: str | Path, num_layers: int
) -> tuple[list[float], list[float]] | None:
    """The checkpoint's per-layer ``(k_scales, v_scales)``, or None when it has none
    (:func:`find_kv_scales` without the names).

    Raises:
        CheckpointError: as :func:`find_kv_scales`.
    """
    found = find_kv_scales(model_dir, num_layers)
    return None if found is None else (found.k, found.v)


def find_kv_scales(model_dir: str | Path, num_layers: int) -> KVScales | None:
    """The checkpoint's per-layer K and V scales with the tensor names they came from,
    or None when it has none.

    Args:
        model_dir: checkpoint directory (safetensors files, as :func:`weight_files`).
        num_layers: decoder layers.

    Returns:
        A :class:`KVScales`, or None (no scale in the checkpoint).

    Raises:
        CheckpointError: scales for only some layers, a layer index out of range, a scale
            tensor of more than one element or not positive and finite, or one scale
            given under two names; the message names the tensor.
    """
    from safetensors import safe_open  # transformers' dependency; only fp8 KV reads it

    model_dir = Path(model_dir)
    found: dict[tuple[int, str], tuple[float, str]] = {}
    namings: set[str] = set()
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # safe_open is no mapping
                m = _NAMES.search(key)
                if m is None or "vision" in key:
                    continue
                layer = int(m.group(1))
                name = m.group(2) or m.group(3) or m.group(4)
                namings.add(
                    "proj"
                    if m.group(2) is None
                    else "kv_scale"
                    if name == "kv_scale"
                    else "k_scale"
                )
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
    keys = sorted({key for _, key in found.values()}, key=_layer_order)
    return KVScales(k, v, keys, sorted(namings))


def _layer_order(key: str) -> tuple[int, str]:
    m = _NAMES.search(key)
    return (int(m.group(1)) if m else -1, key)


@dataclass
class KVScalePlan:
    """What an engine's KV pool stores and with which scales (:func:`kv_scale_plan`).

    Attributes:
        fp8: whether the pool stores float8 e4m3.
        scales: the checkpoint's ``(k_scales, v_scales)``, or None (1.0 for every layer).
        source: where the scales come from (tensor names, or 1.0 and why) and their
            range, in words; the engine logs it and ``describe`` reports it.
        level: the logging level of that line (a warning when a ``kv_cache_scheme``
            promises scales the checkpoint lacks, or fp8 asked by the checkpoint is not
            used).
    """

    fp8: bool
    scales: tuple[list[float], list[float]] | None
    source: str
    level: int = logging.INFO


#: The names looked for, in words (for "none found").
_LOOKED_FOR = (
    "layers.N.self_attn.k_scale/v_scale, self_attn.kv_scale, k_proj.k_scale/v_proj.v_scale"
)


def kv_scale_plan(
    kv_cache_dtype: str,
    model_dir: str | Path | None,
    num_layers: int,
    scheme: dict | None,
    fp8_unavailable: str | None = None,
) -> KVScalePlan:
    """Decide the KV pool's storage and scales, and say why.

    Args:
        kv_cache_dtype: ``--kv-cache-dtype``: "fp8_e4m3" / "fp8" (fp8), or "auto": fp8
            when the checkpoint's compressed-tensors ``kv_cache_scheme`` (``scheme``)
            asks for it, else the model's dtype.
        model_dir: the checkpoint directory (None: a model built in-process; no scales).
        num_layers: decoder layers.
        scheme: the checkpoint's ``kv_cache_scheme``
            (:func:`mmserve.model.quant.kv_cache_scheme`), or None.
        fp8_unavailable: why ``auto`` cannot pick fp8 here (tensor parallelism, a torch
            without float8), or None.

    Raises:
        CheckpointError: as :func:`find_kv_scales`, when the pool would use the scales
            (fp8 asked for, or a ``kv_cache_scheme``).
    """
    asked = kv_cache_dtype in ("fp8_e4m3", "fp8")
    try:
        found = find_kv_scales(model_dir, num_layers) if model_dir is not None else None
    except CheckpointError as e:
        if asked or scheme is not None:
            raise
        # scales this pool would not use: reported, never a reason to refuse the model
        return KVScalePlan(False, None, f"not used (K/V in the model's dtype), and unreadable: {e}")
    if not asked and scheme is not None and fp8_unavailable is None:
        fp8, why = True, "--kv-cache-dtype auto: the checkpoint's kv_cache_scheme is fp8"
    else:
        fp8, why = asked, f"--kv-cache-dtype {kv_cache_dtype}"
    if not fp8:
        if scheme is not None:
            return KVScalePlan(
                False,
                None,
                f"not used: the checkpoint's kv_cache_scheme asks for fp8 K/V, but "
                f"{fp8_unavailable}; K/V stay in the model's dtype",
                logging.WARNING,
            )
        if found is not None:
            return KVScalePlan(
                False,
                None,
                f"not used: the checkpoint has KV scales ({', '.join(found.patterns())}), "
                "but --kv-cache-dtype auto keeps K/V in the model's dtype (fp8_e4m3 reads them)",
            )
        return KVScalePlan(False, None, "none (K/V in the model's dtype)")
    if found is not None:
        return KVScalePlan(True, (found.k, found.v), f"{why}; scales {found.describe()}")
    if model_dir is None:
        reason = "the model was given in-process, with no checkpoint directory to read"
    elif scheme is not None:
        reason = (
            f"the checkpoint's kv_cache_scheme declares static fp8 scales, but none of its "
            f"tensors is named {_LOOKED_FOR}"
        )
    else:
        reason = f"the checkpoint has no KV scale tensors ({_LOOKED_FOR})"
    level = logging.WARNING if scheme is not None else logging.INFO
    ones = [1.0] * num_layers
    return KVScalePlan(
        True, None, f"{why}; scales 1.0 defaults for every layer: {reason}; range "
        f"{_range(ones, ones)}", level
    )  # fmt: skip
