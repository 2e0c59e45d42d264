"""The test checkpoints' weights: seeded random values, drawn and written.

Weights are seeded random values, scaled (not the usual 0.02 std) so that different images
produce clearly different greedy answers. Same seed and same library versions give
byte-identical files. Real-shape sizes are written tensor by tensor
(:func:`write_weights_streamed`), never the whole model in memory.

Also :func:`quantize_checkpoint` (the decoder's projections rewritten in the
compressed-tensors layout) and :func:`count_parameters`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def _init_std(name: str, shape: torch.Size, tied: bool = False) -> float | None:
    """Std of the normal init for parameter ``name``; ``None`` means norm (ones/zeros).

    ``tied``: the LM head is the embedding matrix, which then gets a smaller std
    (:data:`TIED_EMBED_STD`), and the decoder's output projections a larger gain."""
    if len(shape) == 1 and "norm" in name:
        return None
    if "language_model" in name and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return 0.5  # Qwen2's q/k/v biases: non-zero, so a decoder that drops them differs
    if name.endswith("bias"):
        return 0.0
    if "position_embedding" in name:
        return 0.02  # small, so patch content (not position) dominates image features
    if "class_embedding" in name:
        return 1.0
    if "embed_tokens" in name:
        return TIED_EMBED_STD if tied else 1.0
    fan_in = math.prod(shape[1:])
    gain = 1.0
    if "multi_modal_projector" in name:
        gain = 2.0  # amplify image features entering the language model
    elif "q_proj" in name or "k_proj" in name:
        gain = 2.0  # peaky attention, so image content changes what tokens attend to
    elif "lm_head" in name:
        gain = 3.0  # logits std ~3, so sampling at temperature 1 is not near-uniform
    elif tied and "language_model" in name and name.endswith(("o_proj.weight", "down_proj.weight")):
        gain = 3.0  # the layers, not the (tied) input embedding, dominate the residual
    return gain / math.sqrt(fan_in)


#: Embedding std of a tied-embedding checkpoint. With std 1 a token's own embedding
#: dominates the residual stream and, through the tied head, the logits, so the model
#: repeats its last token whatever the image; at 0.1 the layers' outputs dominate.
TIED_EMBED_STD = 0.1
#: Final norm weight of a tied-embedding checkpoint: logits std ~3 (as ``lm_head``'s gain
#: of 3 gives an untied one) despite the small embeddings.
TIED_FINAL_NORM = 3.0


def _init_value(name: str, shape: torch.Size, tied: bool, gen: torch.Generator) -> torch.Tensor:
    """The fp32 initial value of parameter ``name``; random ones draw from ``gen``, so
    parameters must be visited in one fixed order (sorted names)."""
    std = _init_std(name, shape, tied)
    if std is None:
        final = tied and name.endswith("language_model.norm.weight")
        fill = (TIED_FINAL_NORM if final else 1.0) if name.endswith("weight") else 0.0
        return torch.full(shape, fill, dtype=torch.float32)
    if std == 0.0:
        return torch.zeros(shape, dtype=torch.float32)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int, tied: bool = False) -> None:
    """Deterministically overwrite every parameter (sorted by name) from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name in sorted(params):
        params[name].copy_(_init_value(name, params[name].shape, tied, gen))


#: Largest weight shard :func:`write_weights_streamed` writes (bytes), as transformers'
#: ``max_shard_size`` default in spirit: a 7B checkpoint becomes a handful of files.
SHARD_BYTES = 2 << 30


def _saved_key(name: str) -> str:
    """The checkpoint key transformers' ``save_pretrained`` writes for parameter ``name``
    of a LLaVA-family model (the llava-hf layout: ``language_model.model.*``,
    ``language_model.lm_head.*``, ``vision_tower.*``, ``multi_modal_projector.*``)."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    return name.removeprefix("model.")


@torch.no_grad()
def write_weights_streamed(
    out: Path,
    model_cls: type,
    config: object,
    seed: int,
    tied: bool,
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
) -> int:
    """Write seeded weights for ``model_cls(config)`` without building the model.

    The model is instantiated on the meta device (shapes only); each parameter is then
    drawn in fp32 exactly as :func:`_reinit` draws it (same order, same generator, so a
    tiny checkpoint gets the same values either way), cast to ``dtype`` and written in
    safetensors shards of at most ``shard_bytes`` (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``). Peak
    memory is one shard plus one fp32 tensor, so a 7B checkpoint can be written on a
    machine that could not hold it in fp32.

    Args:
        out: checkpoint directory (exists).
        model_cls: a transformers LLaVA-family ``...ForConditionalGeneration`` class.
        config: its config.
        seed: weight seed.
        tied: the LM head is the embedding matrix (not written, as transformers saves it).
        dtype: stored dtype (bf16 for the real shapes, as published).
        shard_bytes: shard size bound (bytes); a larger single tensor gets its own shard.

    Returns:
        The number of parameters written.
    """
    from safetensors.torch import save_file

    with torch.device("meta"):
        meta = model_cls(config)
    shapes = {n: p.shape for n, p in meta.named_parameters()}
    del meta
    gen = torch.Generator().manual_seed(seed)
    shards: list[list[str]] = [[]]
    sizes = [0]
    nbytes = torch.empty((), dtype=dtype).element_size()
    for name in sorted(shapes):  # plan the shards first: names only, no memory
        size = math.prod(shapes[name]) * nbytes
        if shards[-1] and sizes[-1] + size > shard_bytes:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += size
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)
    ]  # fmt: skip
    weight_map: dict[str, str] = {}
    for names, fname in zip(shards, files, strict=True):
        tensors = {}
        for name in names:
            value = _init_value(name, shapes[name], tied, gen).to(dtype)
            tensors[_saved_key(name)] = value
            weight_map[_saved_key(name)] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    if n > 1:
        index = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return sum(math.prod(s) for s in shapes.values())


#: Decoder projections a compressed-tensors checkpoint stores quantized (llm-compressor's
#: default recipe: every Linear of the language model; the LM head, vision tower and
#: projector ignored).
_QUANTIZED_PROJ = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))


def quantize_checkpoint(model_dir: str | Path, method: str) -> Path:
    """Rewrite ``model_dir``'s decoder projections in the compressed-tensors layout
    llm-compressor writes and vLLM loads: each ``<module>.weight`` as int8 or float8_e4m3fn
    (symmetric, per output channel: :func:`mmserve.model.quant.quantize_per_channel`) with
    its ``<module>.weight_scale`` ``[out, 1]`` in the checkpoint's dtype, and config.json's
    ``quantization_config`` saying so (``ignore``: the LM head, vision tower, projector).

    Args:
        model_dir: an unquantized checkpoint (:func:`make_checkpoint`), rewritten in place.
        method: "int8" or "fp8".

    Raises:
        ValueError: for another method or an already quantized checkpoint.
    """
    from safetensors.torch import load_file, save_file

    from mmserve.model.quant import quantize_per_channel, scale_key
    from mmserve.model.weights import weight_files

    if method not in ("int8", "fp8"):
        raise ValueError(f"unknown quantization {method!r}; expected int8 or fp8")
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized")
    for path in weight_files(model_dir):
        tensors = load_file(path)
        out = {}
        for key, t in tensors.items():
            if "language_model" in key and key.endswith(_QUANTIZED_PROJ):
                q, scale = quantize_per_channel(t, method)
                out[key] = q
                out[scale_key(key)] = scale[:, None].to(t.dtype)
            else:
                out[key] = t
        save_file(out, path, metadata={"format": "pt"})
    int8 = method == "int8"
    weights = {"num_bits": 8, "type": "int" if int8 else "float", "symmetric": True}
    weights.update(strategy="channel", dynamic=False)
    act = None if int8 else {"num_bits": 8, "type": "float", "symmetric": True}
    if act is not None:
        act.update(strategy="token", dynamic=True)  # fp8 W8A8 with per-token scales
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if int8 else "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act}
        },
        "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
    }
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return model_dir


def count_parameters(model_dir: str | Path) -> int:
    """Total number of parameters stored in ``model_dir``'s safetensors file(s)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total
