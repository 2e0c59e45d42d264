"""One rank's shard of the Llama decoder, read slice by slice from safetensors.

The layers are :class:`~mmserve.model.llama.DecoderLayer` built with the rank's
local shape (its query and K/V heads, its part of the MLP width), with ``o_proj``
and ``down_proj`` swapped for :class:`RowParallelLinear`, which all-reduces the
partial sums before adding the bias: two all-reduces per layer, the arithmetic
otherwise that of :class:`~mmserve.model.llama.LlamaDecoder`. Under ``--deterministic``
the two all-reduces become all-gathers of fp32 block sums added in a fixed tree, so the
group's bits are one rank's (:mod:`mmserve.kernels.batch_invariant`). Weights are read with
``safe_open(...).get_slice`` so a rank never reads, let alone holds, another rank's
slice (int4 modules excepted: each source's packed tensors are read whole, as their
formats pack along either axis); modules are built on the ``meta`` device and take the
loaded tensors as they are (``load_state_dict(assign=True)``), so nothing full-size is
allocated first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from mmserve.distributed.layout import TPLayout
from mmserve.kernels import batch_invariant, ops
from mmserve.model import int4, quant
from mmserve.model.int4_formats import Int4Format
from mmserve.model.int4_loading import int4_regroup, int4_slice, source_modules, stored_int4
from mmserve.model.llama import (
    DecoderLayer,
    DecoderStack,
    Linear,
    RMSNorm,
    RowLinear,
    row_splits,
)
from mmserve.model.quant import QuantizedLinear
from mmserve.model.weights import CheckpointError, fused_sources, split_weights, weight_files


class RowParallelQuantizedLinear(QuantizedLinear):
    """:class:`RowParallelLinear` over a quantized column slice ``[out, in / N]``: its
    scales are the whole rows' (every rank the same), so the partial products sum to the
    unsplit layer's before the bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, in / N]`` -> ``[T, out]`` (same dtype), summed over ranks."""
        y = self.matmul(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class RowParallelInt4Linear(int4.Int4Linear):
    """:class:`RowParallelLinear` over an int4 column slice (whole groups): the partial
    products sum to the unsplit layer's before the bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, in / N]`` -> ``[T, out]`` (same dtype), summed over ranks."""
        y = self.matmul(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(RowLinear):
    """``y = all_reduce(x @ W_r^T) + b``: a linear layer whose input features are split
    across ranks (``W_r`` is this rank's column slice ``[out, in / N]``); the bias is
    whole on every rank and added once, after the sum.

    Under ``--deterministic`` (``splits``: this rank's ``S / N`` of the model's fixed
    blocks) each rank tree-sums its blocks in fp32, the ``N`` sums are all-gathered and
    tree-summed in rank order, then rounded: the bits of
    :class:`~mmserve.model.llama.RowLinear` on one rank (see
    :mod:`mmserve.kernels.batch_invariant`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, in / N]`` -> ``[T, out]`` (same dtype), summed over ranks."""
        if batch_invariant.invariant_linears_on():
            mine = batch_invariant.split_partials(x, self.weight, self.splits)
            parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, mine)
            y = batch_invariant.tree_sum(parts).to(x.dtype)
        else:
            y = F.linear(x, self.weight)
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _take(sl: Any, axis: str, span: tuple[int, int] | None) -> torch.Tensor:
    """Rows, columns or all of a ``safe_open`` slice (or a tensor)."""
    if axis in ("row", "col"):
        assert span is not None  # _slices gives "row" and "col" their span
        lo, hi = span
        return sl[lo:hi] if axis == "row" else sl[:, lo:hi]
    return sl[:]


def _slices(layout: TPLayout, name: str) -> tuple[str, tuple[int, int] | None]:
    """``(axis, (lo, hi))`` of checkpoint tensor ``name`` (a checkpoint-side name: a fused
    parameter is read source by source, each rank's ``qkv_proj`` its own q, k and v heads)
    this rank reads: axis "row" or "col", or ``("all", None)`` for a replicated tensor."""
    parts = name.split(".")
    leaf = parts[-2] if len(parts) >= 2 else ""
    kind = parts[-1]
    if leaf == "q_proj":
        return "row", layout.q_rows()
    if leaf in ("k_proj", "v_proj"):
        return "row", layout.kv_rows()
    if leaf in ("gate_proj", "up_proj"):
        return "row", layout.mlp_rows()
    if leaf == "o_proj" and kind == "weight":
        return "col", layout.q_rows()
    if leaf == "down_proj" and kind == "weight":
        return "col", layout.mlp_rows()
    if name == "lm_head.weight":
        return "row", layout.vocab_rows()
    return "all", None  # norms, o_proj / down_proj biases, the embedding


class ShardedDecoder(DecoderStack):
    """Rank ``layout.rank``'s part of :class:`~mmserve.model.llama.LlamaDecoder`.

    Args:
        layout: this rank's share.
        with_embedding: hold the whole token embedding (rank 0, which embeds the
            batch and scatters image features in before broadcasting it).

    Attributes:
        shape: the local shape (:meth:`TPLayout.local_shape`): local heads and MLP
            width, whole hidden size and vocabulary.
        lm_head: this rank's vocabulary rows ``[vocab_rows, hidden]``.
    """

    # DecoderStack's RoPE table (the same fp32 frequencies) and its layer loop, final norm
    # and head, on this rank's heads: every rank calls forward with the same batch, and
    # it returns fp32 logits ``[B, vocab_rows]`` of this rank's vocabulary rows
    # (:func:`~mmserve.distributed.worker.gather_logits` joins them).

    def __init__(self, layout: TPLayout, with_embedding: bool) -> None:
        super().__init__()
        self.layout = layout
        full = layout.full
        self.shape = layout.local_shape()
        lo, hi = layout.vocab_rows()
        splits = row_splits(full) // layout.world  # whole blocks: check_tp(deterministic=True)
        with torch.device("meta"):
            self.embed_tokens = (
                nn.Embedding(full.vocab_size, full.hidden_size) if with_embedding else None
            )
            layers = []
            for i in range(full.num_layers):
                layer = DecoderLayer(self.shape, i)
                attn, mlp = layer.self_attn, layer.mlp
                attn.o_proj = RowParallelLinear(
                    attn.h * attn.d, full.hidden_size, full.o_bias, max(1, splits)
                )
                mlp.down_proj = RowParallelLinear(
                    self.shape.intermediate_size, full.hidden_size, full.mlp_bias, max(1, splits)
                )
                layers.append(layer)
            self.layers = nn.ModuleList(layers)
            self.norm = RMSNorm(full.hidden_size, full.rms_norm_eps)
            self.lm_head = Linear(full.hidden_size, hi - lo, bias=False)
        self._inv_freq_fp32 = ops.rope_inv_freq(full.head_dim, full.rope_theta)
        self._rope_cache = ops.cos_sin_cache(self._inv_freq_fp32, full.max_position_embeddings)

    def load(
        self, model_dir: Path, device: str, dtype: torch.dtype, quantization: str = "none"
    ) -> None:
        """Read this rank's slices from ``model_dir``'s safetensors and move them to
        ``device`` / ``dtype``; with a ``quantization`` (or a compressed-tensors
        checkpoint), the quantized linears as :func:`~mmserve.model.loader.load_model`
        makes them, sharded: column-parallel ones (``qkv_proj``, ``gate_up_proj``, the LM
        head) hold their rows' scales, row-parallel ones (``o_proj``, ``down_proj``) the
        whole rows' scales (quantizing at load reads those two whole, for their scales).

        Raises:
            CheckpointError: when a tensor this rank needs is missing.
            QuantizationError: as :func:`~mmserve.model.loader.load_model`.
        """
        files = weight_files(model_dir)
        where: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # safe_open is not a mapping
                    where[key] = path
        dec, _ = split_weights({k: k for k in where}, {})  # decoder name -> stored key
        if self.layout.full.tie_word_embeddings:  # transformers ties and ignores a stored head
            dec.pop("lm_head.weight", None)
            if "embed_tokens.weight" in dec:
                dec["lm_head.weight"] = dec["embed_tokens.weight"]
        qc = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
        stored = quant.checkpoint_method(qc)
        method = quant.resolve_method(quantization, stored, qc)
        targets = []
        fmt = quant.int4_format(qc) if method == "int4" else None
        if method == "int4":
            for name in quant.target_modules(self.layout.full.num_layers, True):
                if fmt is None or stored_int4(fmt, name, dec.__contains__):
                    targets.append(name)
        elif method != "none":
            for name in quant.target_modules(self.layout.full.num_layers, True):
                keys = [dec.get(s, s) for s in fused_sources(f"{name}.weight")]
                scaled = [quant.scale_key(k) in where for k in keys]
                if stored == "none" or all(scaled):
                    targets.append(name)
                elif any(scaled):
                    raise CheckpointError(f"decoder: {name} fuses {keys}, quantized only in part")
        skip = {f"{t}.weight" for t in targets}
        sources = {name: fused_sources(name) for name in self.state_dict() if name not in skip}
        if fmt is None:  # stored 4-bit modules have no ``.weight`` (int4_format's tensors)
            sources.update({f"{t}.weight": fused_sources(f"{t}.weight") for t in targets})
        missing = sorted(s for srcs in sources.values() for s in srcs if s not in dec)
        if missing:
            raise CheckpointError(f"decoder: weights missing from checkpoint: {missing[:8]}")
        parts: dict[str, torch.Tensor] = {}  # checkpoint-side name -> this rank's slice
        by_file: dict[Path, list[str]] = {}
        for src in {s for name, srcs in sources.items() if name not in skip for s in srcs}:
            by_file.setdefault(where[dec[src]], []).append(src)
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for src in names:
                    axis, span = _slices(self.layout, src)
                    t = _take(f.get_slice(dec[src]), axis, span)
                    parts[src] = t.to(device=device, dtype=dtype)
        state = {
            name: parts[srcs[0]] if len(srcs) == 1 else torch.cat([parts.pop(s) for s in srcs])
            for name, srcs in sources.items()
            if name not in skip
        }
        for name in targets:  # their biases are in ``state``, put in place below
            if method == "int4":
                self._quantize_int4(name, fmt, dec, where, device)
            else:
                self._quantize(name, method, stored != "none", dec, where, device)
        self.load_state_dict(state, strict=False, assign=True)
        leftover = [n for n, p in self.state_dict().items() if p.is_meta]
        if leftover:
            raise CheckpointError(f"decoder: weights not loaded: {leftover[:8]}")
        quantized_head = "lm_head" in targets
        if (
            self.layout.full.tie_word_embeddings
            and self.embed_tokens is not None
            and not quantized_head
        ):
            lo, hi = self.layout.vocab_rows()  # the head is a view of the embedding's rows
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight[lo:hi])
        self.eval()

    def _quantize(
        self, name: str, method: str, stored: bool, dec: dict, where: dict, device: str
    ) -> None:
        """Put this rank's quantized slice of module ``name`` in place (see :meth:`load`)."""
        qs, scales = [], []
        for src in fused_sources(f"{name}.weight"):
            key = dec[src]
            axis, span = _slices(self.layout, src)
            with safe_open(str(where[key]), framework="pt") as f:
                sl = f.get_slice(key)
                if stored:
                    q = _take(sl, axis, span)
                    sc = quant.row_scales(
                        f.get_slice(quant.scale_key(key))[:].float(), sl.get_shape()[0]
                    )
                    scales.append(_take(sc, axis, span) if axis == "row" else sc)
                elif axis == "col":  # whole rows for the scales, this rank's columns kept
                    w = sl[:].float()
                    _, sc = quant.quantize_per_channel(w, method)
                    q = quant.quantize_with_scale(_take(w, axis, span), sc, method)
                    scales.append(sc)
                else:
                    q, sc = quant.quantize_per_channel(_take(sl, axis, span).float(), method)
                    scales.append(sc)
            qs.append(q)
        old = self.get_submodule(name)
        bias = cast("torch.Tensor | None", old.bias)  # meta until load_state_dict fills it
        cls = RowParallelQuantizedLinear if isinstance(old, RowParallelLinear) else QuantizedLinear
        new = cls(torch.cat(qs).to(device), torch.cat(scales).to(device), None)
        if bias is not None:
            new.bias = nn.Parameter(torch.empty_like(bias, device="meta"), requires_grad=False)
        quant.replace_module(self, name, new)

    def _quantize_int4(
        self, name: str, fmt: Int4Format | None, dec: dict, where: dict, device: str
    ) -> None:
        """Put this rank's int4 slice of module ``name`` in place: each source's 4-bit
        tensors read whole (``fmt``) or its weight quantized whole (groups run along the
        input features, so a slice of the whole quantized equals the slice quantized),
        then this rank's rows, or its input columns on group boundaries
        (:func:`~mmserve.model.int4_loading.int4_slice`)."""

        def get(n: str) -> torch.Tensor:
            with safe_open(str(where[dec[n]]), framework="pt") as f:
                return f.get_tensor(dec[n])

        parts, groups = [], []
        for m in source_modules(name):
            axis, span = _slices(self.layout, f"{m}.weight")
            if fmt is not None:
                p, group = fmt.read(get, dec.__contains__, m), fmt.group
            else:
                w = get(f"{m}.weight").float()
                group = int4.group_size_for(w.shape[1])
                p = int4.quantize_int4(w, group, symmetric=False)
            p, group = int4_slice(p, axis, span, group, name)
            parts.append(p)
            groups.append(group)
        group = min(groups)  # fused sources: one group size (each a multiple of the least)
        parts = [int4_regroup(p, g, group) for p, g in zip(parts, groups, strict=True)]
        q, scale, zero = (torch.cat(ts) for ts in zip(*parts, strict=True))
        old = self.get_submodule(name)
        bias = cast("torch.Tensor | None", old.bias)
        row = isinstance(old, RowParallelLinear)
        cls = RowParallelInt4Linear if row else int4.Int4Linear
        new = cls.from_int(q, scale, zero, group, None, device)
        if bias is not None:
            new.bias = nn.Parameter(torch.empty_like(bias, device="meta"), requires_grad=False)
        quant.replace_module(self, name, new)

    def weight_bytes(self) -> int:
        """Bytes of this rank's decoder weights (embedding included where held)."""
        seen, total = set(), 0
        for p in self.parameters():
            key = (p.untyped_storage().data_ptr(), p.storage_offset())
            if key not in seen:
                seen.add(key)
                total += p.numel() * p.element_size()
        return total
