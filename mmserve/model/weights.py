"""Where a checkpoint's tensors are and which part of the model each belongs to.

Kept free of transformers so that tensor-parallel worker ranks, which read only
their decoder slices, start without importing it.
"""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or holds an unsupported model."""


def short_error(exc: BaseException) -> str:
    """The first line of an exception's message, without the Hub advice, at most 200 chars."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    text = text.split(" If you were trying to load it from")[0].strip()
    text = text or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir``: the shards its
    ``model.safetensors.index.json`` lists, else every ``*.safetensors`` file.

    Raises:
        CheckpointError: for an unreadable index, no weights, or a listed shard missing.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"{model_dir}: model.safetensors.index.json is unreadable "
                f"(needs a 'weight_map' of tensor name -> shard file): {short_error(exc)}"
            ) from exc
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    paths = []
    for name in files:
        path = model_dir / name
        if not path.exists():
            raise CheckpointError(
                f"{model_dir}: weight shard {name} is listed in model.safetensors.index.json "
                "but missing"
            )
        paths.append(path)
    return paths


def split_weights(
    weights: dict[str, object], vision_prefixes: dict[str, str]
) -> tuple[dict, dict[str, dict]]:
    """Route checkpoint keys to the decoder's state dict and, per vision attribute
    (``vision_prefixes``: key prefix after ``model.`` -> attribute,
    :attr:`ModelFamily.vision_prefixes`), its state dict (a parameter's is ``{"": t}``)."""
    dec: dict = {}
    vision: dict[str, dict] = {attr: {} for attr in vision_prefixes.values()}
    for key, t in weights.items():
        k = key.removeprefix("model.")
        if k in ("lm_head.weight", "language_model.lm_head.weight"):
            dec["lm_head.weight"] = t
        elif k.startswith("language_model."):
            dec[k.removeprefix("language_model.").removeprefix("model.")] = t
        else:
            for prefix, attr in vision_prefixes.items():
                if k.startswith(prefix):
                    vision[attr][k.removeprefix(prefix)] = t
    return dec, vision


#: Fused decoder modules and the checkpoint modules whose rows they concatenate, in order
#: (q, k, v heads; gate, up columns): the decoder runs one matmul where transformers runs
#: three or two, and checkpoints keep transformers' names.
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_sources(name: str) -> list[str]:
    """The checkpoint-side decoder state names whose tensors make state ``name``,
    concatenated along dim 0 in this order: ``layers.0.self_attn.qkv_proj.weight`` ->
    its ``q_proj``, ``k_proj`` and ``v_proj`` weights; any other name -> ``[name]``."""
    owner, _, rest = name.rpartition(".")
    parent, _, module = owner.rpartition(".")
    parts = FUSED_MODULES.get(module)
    if parts is None:
        return [name]
    return [f"{parent}.{p}.{rest}" for p in parts]
