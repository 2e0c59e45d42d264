"""Load a Hugging Face LLaVA-1.5 checkpoint directory into our model.

Reads ``config.json``, the safetensors weights (one file or shards with an
index), the tokenizer and the processor. Both key layouts seen in the wild are
accepted: transformers 5 (``model.language_model.*``, ``model.vision_tower.*``,
``lm_head.*``) and the llava-hf release layout (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.vision_model.*``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, LlavaConfig

from mmserve.model.llama import LlamaDecoder, LlamaShape
from mmserve.model.vision_tower import VisionEncoder


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or holds an unsupported model."""


@dataclass
class LoadedModel:
    """Everything the engine needs from one checkpoint.

    Attributes:
        config: the ``LlavaConfig``.
        decoder: our paged-KV Llama decoder with LM head.
        vision: CLIP tower + projector.
        processor: transformers' ``LlavaProcessor`` (tokenizer + image processor).
        image_token_id: id of the ``<image>`` placeholder in the tokenizer.
        num_image_tokens: pseudo-tokens per image (576 for 336 px / patch 14).
        eos_token_ids: ids that end generation.
        never_sample_ids: ids masked out of sampling (image placeholder, padding).
    """

    config: LlavaConfig
    decoder: LlamaDecoder
    vision: VisionEncoder
    processor: object
    image_token_id: int
    num_image_tokens: int
    eos_token_ids: list[int]
    never_sample_ids: list[int]

    @property
    def tokenizer(self):  # noqa: ANN201
        """The checkpoint's tokenizer."""
        return self.processor.tokenizer


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = model_dir / name
        if not path.exists():
            raise CheckpointError(f"{model_dir}: weight shard {name} listed but missing")
        weights.update(load_file(str(path)))
    return weights


def _split_weights(weights: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """Route checkpoint keys to (decoder, vision tower, projector) state dicts."""
    dec, tower, proj = {}, {}, {}
    for key, t in weights.items():
        k = key.removeprefix("model.")
        if k in ("lm_head.weight", "language_model.lm_head.weight"):
            dec["lm_head.weight"] = t
        elif k.startswith("language_model."):
            dec[k.removeprefix("language_model.").removeprefix("model.")] = t
        elif k.startswith("vision_tower."):
            tower[k.removeprefix("vision_tower.")] = t
        elif k.startswith("multi_modal_projector."):
            proj[k.removeprefix("multi_modal_projector.")] = t
    return dec, tower, proj


def _load_strict(module: torch.nn.Module, state: dict, what: str) -> None:
    expected = set(module.state_dict())
    # Accept CLIP weights with or without the ``vision_model.`` level.
    if expected and not any(k.startswith("vision_model.") for k in expected):
        state = {k.removeprefix("vision_model."): v for k, v in state.items()}
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"{what}: weights missing from checkpoint: {missing[:8]}")
    module.load_state_dict(state, strict=False)


def text_shape(config: LlavaConfig) -> LlamaShape:
    """Decoder hyperparameters from a ``LlavaConfig``.

    Raises:
        CheckpointError: for a non-Llama decoder or an unsupported RoPE type.
    """
    tc = config.text_config
    if tc.model_type != "llama":
        raise CheckpointError(f"unsupported text model {tc.model_type!r}: only llama decoders")
    rope = getattr(tc, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(f"unsupported rope_type {rope_type!r}: only 'default'")
    return LlamaShape(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_layers=tc.num_hidden_layers,
        num_heads=tc.num_attention_heads,
        num_kv_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
        max_position_embeddings=tc.max_position_embeddings,
        attention_bias=bool(getattr(tc, "attention_bias", False)),
        mlp_bias=bool(getattr(tc, "mlp_bias", False)),
    )


def load_model(
    model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """Load a LLaVA-1.5 checkpoint directory.

    Args:
        model_dir: a directory as written by ``save_pretrained`` (config.json,
            safetensors weights, tokenizer and processor files).
        device: torch device for every module.
        dtype: parameter dtype (fp32 on CPU).

    Returns:
        A :class:`LoadedModel`.

    Raises:
        CheckpointError: naming the missing file, missing weights or the
            unsupported architecture.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{model_dir}: config.json is missing")
    raw = json.loads(cfg_path.read_text())
    if raw.get("model_type") != "llava":
        raise CheckpointError(
            f"unsupported architecture {raw.get('model_type')!r} in {cfg_path}: "
            "only LLaVA-1.5 ('llava') checkpoints"
        )
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        if not (model_dir / name).exists():
            raise CheckpointError(f"{model_dir}: {name} is missing")
    config = LlavaConfig.from_pretrained(model_dir)
    shape = text_shape(config)
    weights = _read_weights(model_dir)
    dec_w, tower_w, proj_w = _split_weights(weights)

    decoder = LlamaDecoder(shape)
    _load_strict(decoder, dec_w, "decoder")
    vision = VisionEncoder(config)
    _load_strict(vision.vision_tower, tower_w, "vision tower")
    _load_strict(vision.multi_modal_projector, proj_w, "projector")
    decoder.to(device=device, dtype=dtype).eval()
    vision.to(device=device, dtype=dtype).eval()

    processor = AutoProcessor.from_pretrained(model_dir)
    tok = processor.tokenizer
    if len(tok) != shape.vocab_size:
        raise CheckpointError(f"tokenizer has {len(tok)} ids but vocab_size is {shape.vocab_size}")
    image_token_id = int(config.image_token_index)
    vc = config.vision_config
    n_img = (vc.image_size // vc.patch_size) ** 2
    if config.vision_feature_select_strategy == "full":
        n_img += 1
    eos = config.text_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in eos_ids:
        eos_ids.append(tok.eos_token_id)
    never = [image_token_id]
    if tok.pad_token_id is not None and tok.pad_token_id not in eos_ids:
        never.append(tok.pad_token_id)
    return LoadedModel(
        config=config,
        decoder=decoder,
        vision=vision,
        processor=processor,
        image_token_id=image_token_id,
        num_image_tokens=n_img,
        eos_token_ids=eos_ids,
        never_sample_ids=never,
    )
