"""Load a Hugging Face LLaVA-family checkpoint directory into our model.

The family (LLaVA-1.5, LLaVA-NeXT, ...) comes from ``config.json``'s
``model_type`` (:mod:`mmserve.model.families`); the decoder is our paged Llama.

The config, tokenizer and processor are read through transformers' Auto classes
(``AutoConfig``, ``AutoProcessor``), so every directory layout the installed
transformers can load is accepted: ``preprocessor_config.json`` or the image
processor nested in ``processor_config.json``, ``tokenizer.json`` or a
SentencePiece ``tokenizer.model``. A family may load its processor itself
(:meth:`ModelFamily.load_processor`: LLaVA-OneVision, whose ``AutoProcessor`` needs
torchvision for its video processor). When transformers refuses the directory, the
error is reported in words that name the directory and the missing piece.

The safetensors weights are one file or shards listed by
``model.safetensors.index.json``. Both key layouts seen in the wild are
accepted: transformers 5 (``model.language_model.*``, ``model.vision_tower.*``,
``lm_head.*``) and the llava-hf release layout (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.vision_model.*``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoProcessor,
    AutoTokenizer,
    PretrainedConfig,
)
from transformers.initialization import no_init_weights
from transformers.utils import is_protobuf_available

from mmserve.model import quant
from mmserve.model.families import FAMILIES, ModelFamily, family_for
from mmserve.model.families.base import IMAGE_MODE, VisionModule
from mmserve.model.int4_loading import load_int4_decoder
from mmserve.model.lazy_weights import LazyWeights, read_weights
from mmserve.model.llama import DecoderStack, LlamaDecoder, LlamaShape
from mmserve.model.weights import CheckpointError, fused_sources, split_weights
from mmserve.model.weights import short_error as _short

_QUANT_KEYS = ("weight_scale", "weight_packed", "qweight")  # quantized tensors' suffixes
#: Decoder ``model_type`` values our Llama decoder runs (Mistral and Qwen2 without a
#: sliding window; Qwen2 with its q/k/v biases).
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: ``(qkv_bias, o_bias)`` of decoders whose attention biases are fixed by the architecture
#: (transformers' ``Qwen2Attention``: biases on q/k/v, none on o); others read
#: ``attention_bias``.
_FIXED_ATTENTION_BIAS = {"qwen2": (True, False)}


@dataclass
class LoadedModel:
    """Everything the engine needs from one checkpoint.

    Attributes:
        config: the transformers config (``LlavaConfig``, ``LlavaNextConfig``, ...).
        decoder: our paged-KV Llama decoder with LM head (a
            :class:`~mmserve.model.llama.LlamaDecoder`, or rank 0's ``TPDecoder`` under
            tensor parallelism).
        vision: the family's vision module (tower, projector, packing).
        processor: transformers' processor (tokenizer + image processor; ``Any``:
            transformers' processors set their attributes per class).
        image_token_id: id of the ``<image>`` placeholder in the tokenizer.
        video_token_id: id of the ``<video>`` placeholder when the family has a video
            path (:meth:`ModelFamily.video_frame_tokens`), else None.
        num_image_tokens: pseudo-tokens per image when the family uses a fixed count
            (576 for LLaVA-1.5 at 336 px / patch 14), None when it depends on the
            image's size (see :meth:`image_tokens`).
        eos_token_ids: ids that end generation.
        never_sample_ids: ids masked out of sampling (image placeholder, padding).
        family: the model family.
        quantization: the decoder weights' method ("none", "int8", "fp8").
        quantization_source: where it came from, in words ("--quantization int8,
            quantized at load" or "the checkpoint's compressed-tensors weights").
        source: the directory the weights were read from (None: built in memory); what
            :func:`~mmserve.model.identity.model_identity` digests.
        identity: :func:`~mmserve.model.identity.model_identity`, once it has been computed.
    """

    config: PretrainedConfig
    decoder: DecoderStack
    vision: VisionModule
    processor: Any
    image_token_id: int
    num_image_tokens: int | None
    eos_token_ids: list[int]
    never_sample_ids: list[int]
    family: ModelFamily
    video_token_id: int | None = None
    quantization: str = "none"
    quantization_source: str = ""
    source: Path | None = None
    identity: bytes | None = None

    def image_tokens(self, width: int, height: int, mode: str = IMAGE_MODE) -> int:
        """Pseudo-tokens an image of ``width`` x ``height`` pixels becomes in ``mode``
        (:data:`~mmserve.model.families.base.IMAGE_MODE`: alone in its prompt)."""
        if mode != IMAGE_MODE:
            return self.family.mode_tokens(width, height, mode)
        if self.num_image_tokens is not None:
            return self.num_image_tokens
        return self.family.num_image_tokens(width, height)

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer."""
        return self.processor.tokenizer


def _split_weights(weights: LazyWeights, family: ModelFamily) -> tuple[dict, dict[str, dict]]:
    """Route checkpoint keys to the decoder's state names and, per vision attribute
    (:attr:`ModelFamily.vision_prefixes`), its state names (a parameter's is ``""``):
    ``{module state name: checkpoint key}``; nothing is read yet."""
    return split_weights({k: k for k in weights.keys()}, family.vision_prefixes)


@dataclass
class _Target:
    """Where loaded tensors go: their dtype and device, and the checkpoint."""

    weights: LazyWeights
    dtype: torch.dtype
    device: str


def _load_vision(vision: VisionModule, states: dict[str, dict], to: _Target) -> None:
    for attr, state in states.items():
        target = getattr(vision, attr)
        if isinstance(target, torch.nn.Parameter):
            if "" not in state:
                raise CheckpointError(f"vision: weight {attr!r} missing from checkpoint")
            t = to.weights.get(state[""], to.dtype, to.device)
            setattr(vision, attr, torch.nn.Parameter(t, requires_grad=False))
        else:
            _load_strict(target, state, attr.replace("_", " "), to)


def _load_strict(
    module: torch.nn.Module, state: dict, what: str, to: _Target, skip: frozenset = frozenset()
) -> None:
    """Put checkpoint tensor ``state[name]`` in place of each of ``module``'s parameters
    and persistent buffers (assigned, not copied: the module may live on the meta
    device). Names that two entries share become one parameter (tied embeddings). A fused
    parameter (``qkv_proj``, ``gate_up_proj``: :func:`~mmserve.model.weights.fused_sources`)
    is its sources' tensors concatenated by rows. Names in ``skip`` are left alone (the
    quantized weights, which :func:`_quantize_decoder` puts in place)."""
    expected = set(module.state_dict()) - skip
    # Accept CLIP weights with or without the ``vision_model.`` level.
    if expected and not any(k.startswith("vision_model.") for k in expected):
        state = {k.removeprefix("vision_model."): v for k, v in state.items()}
    sources = {name: fused_sources(name) for name in expected}
    missing = sorted(s for srcs in sources.values() for s in srcs if s not in state)
    if missing:
        raise CheckpointError(f"{what}: weights missing from checkpoint: {missing[:8]}")
    loaded: dict[tuple[str, ...], torch.Tensor] = {}
    for name in sorted(expected):
        keys = tuple(state[s] for s in sources[name])
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if keys not in loaded:
            parts = [to.weights.get(k, to.dtype, to.device) for k in keys]
            t = parts[0] if len(parts) == 1 else torch.cat(parts)
            if attr in owner._parameters:
                t = torch.nn.Parameter(t, requires_grad=False)
            loaded[keys] = t
        if attr in owner._parameters:  # made a Parameter above
            owner._parameters[attr] = cast(torch.nn.Parameter, loaded[keys])
        else:
            owner._buffers[attr] = loaded[keys]


def text_shape(config: PretrainedConfig) -> LlamaShape:
    """Decoder hyperparameters from a LLaVA-family config's ``text_config`` (and its
    top-level ``tie_word_embeddings``, which transformers' tying reads).

    Raises:
        CheckpointError: for a decoder that is not Llama-shaped (Llama, or Mistral or
            Qwen2 without a sliding window shorter than its context) or an unsupported RoPE.
    """
    tc = config.text_config
    if tc.model_type not in TEXT_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported text model {tc.model_type!r}: only {', '.join(TEXT_MODEL_TYPES)} decoders"
        )
    # Qwen2 keeps a sliding_window value that it uses only with use_sliding_window
    window = (
        getattr(tc, "sliding_window", None) if getattr(tc, "use_sliding_window", True) else None
    )
    if window is not None and window < tc.max_position_embeddings:
        raise CheckpointError(
            f"unsupported sliding_window {window} (< context {tc.max_position_embeddings})"
        )
    rope = getattr(tc, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(f"unsupported rope_type {rope_type!r}: only 'default'")
    bias = bool(getattr(tc, "attention_bias", False))
    qkv_bias, o_bias = _FIXED_ATTENTION_BIAS.get(tc.model_type, (bias, bias))
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
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(tc, "mlp_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _unsupported(model_type: object, cfg_path: Path) -> CheckpointError:
    known = ", ".join(repr(t) for t in FAMILIES)
    return CheckpointError(
        f"unsupported architecture {model_type!r} in {cfg_path}: the supported model "
        f"families are {known}"
    )


def _load_config(model_dir: Path) -> PretrainedConfig:
    """``AutoConfig`` on ``model_dir``; only a registered family's ``model_type``."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{model_dir}: config.json is missing")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many kinds
        try:
            model_type = json.loads(cfg_path.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = next(iter(FAMILIES))  # unreadable: report the config error below
        if family_for(model_type) is None:
            raise _unsupported(model_type, cfg_path) from exc
        raise CheckpointError(f"{model_dir}: cannot read config.json: {_short(exc)}") from exc
    if family_for(config.model_type) is None:
        raise _unsupported(config.model_type, cfg_path)
    return config


def _processor_failure(model_dir: Path, exc: BaseException) -> str:
    """Say which piece ``AutoProcessor`` could not load: ask the tokenizer and image
    processor Auto classes separately, then name the missing file(s)."""
    try:
        AutoTokenizer.from_pretrained(model_dir)
    except Exception as tok_exc:  # noqa: BLE001 - transformers raises many kinds; reported
        has_json = (model_dir / "tokenizer.json").is_file()
        has_model = (model_dir / "tokenizer.model").is_file()
        if not has_json and not has_model:
            return "the tokenizer is missing (no tokenizer.json or tokenizer.model)"
        if not has_json and not is_protobuf_available():
            return (
                "the tokenizer is tokenizer.model (SentencePiece) with no tokenizer.json, and "
                "transformers needs the protobuf package to read it; it is not installed"
            )
        return f"the tokenizer does not load: {_short(tok_exc)}"
    try:
        AutoImageProcessor.from_pretrained(model_dir)
    except Exception as img_exc:  # noqa: BLE001 - transformers raises many kinds; reported
        nested = False
        proc_cfg = model_dir / "processor_config.json"
        if proc_cfg.is_file():
            try:
                nested = "image_processor" in json.loads(proc_cfg.read_text())
            except (OSError, ValueError, TypeError):
                nested = False
        if not nested and not (model_dir / "preprocessor_config.json").is_file():
            return (
                "the image processor config is missing (no preprocessor_config.json, and no "
                "image_processor entry in processor_config.json)"
            )
        return f"the image processor does not load: {_short(img_exc)}"
    return _short(exc)


def _load_processor(model_dir: Path) -> Any:
    """``AutoProcessor`` on ``model_dir``; it must hold a tokenizer and an image processor."""
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many kinds
        why = _processor_failure(model_dir, exc)
        raise CheckpointError(f"{model_dir}: cannot load the tokenizer/processor: {why}") from exc
    missing = [a for a in ("tokenizer", "image_processor") if getattr(processor, a, None) is None]
    if missing:
        raise CheckpointError(
            f"{model_dir}: cannot load the tokenizer/processor: transformers built a "
            f"{type(processor).__name__} without {' and '.join(missing)} (a LLaVA checkpoint "
            "needs a processor_config.json or preprocessor_config.json and a tokenizer)"
        )
    return processor


def _family_class(config: PretrainedConfig) -> type[ModelFamily]:
    """The family serving ``config`` (:func:`_load_config` refuses any other)."""
    family = family_for(config.model_type)
    assert family is not None, config.model_type
    return family


def _family_processor(model_dir: Path, config: PretrainedConfig) -> Any:
    """The family's own processor loading, else ``AutoProcessor`` (:func:`_load_processor`)."""
    try:
        processor = _family_class(config).load_processor(model_dir)
    except Exception as exc:  # transformers raises many kinds
        why = _processor_failure(model_dir, exc)
        raise CheckpointError(f"{model_dir}: cannot load the tokenizer/processor: {why}") from exc
    return processor if processor is not None else _load_processor(model_dir)


def load_processor(model_dir: str | Path) -> Any:
    """The processor (tokenizer + image processor) of a LLaVA-family checkpoint directory,
    as :func:`load_model` loads it: the family's own loading where it has one (OneVision,
    without torchvision), else transformers' ``AutoProcessor``.

    Raises:
        CheckpointError: as :func:`load_model` for the config, tokenizer and processor.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    return _family_processor(model_dir, _load_config(model_dir))


def _quantize_decoder(
    decoder: LlamaDecoder, dec_w: dict, method: str, stored: bool, to: _Target
) -> None:
    """Put a :class:`~mmserve.model.quant.QuantizedLinear` in place of each of the
    decoder's quantized linears (:func:`~mmserve.model.quant.target_modules`).

    ``stored``: the checkpoint holds them quantized (compressed-tensors: ``<module>.weight``
    8-bit and ``<module>.weight_scale`` ``[out, 1]`` or ``[1]``): a module is quantized when
    all its sources have scales (the LM head and anything ``ignore`` lists do not), its
    weights and scales read as stored and fused by rows. Otherwise the weights are read in
    quantized here a slice at a time (:func:`_read_quantized`; the LM head too: quality
    measured in benchmarks/README.md), so loading never holds a whole matrix in fp32.

    Raises:
        CheckpointError: for a fused module whose sources are quantized only in part.
    """
    shape = decoder.shape
    for name in quant.target_modules(shape.num_layers, quantize_head=True):
        linear = cast(torch.nn.Linear, decoder.get_submodule(name))
        sources = fused_sources(f"{name}.weight")
        keys = [dec_w[s] for s in sources]
        scale_keys = [quant.scale_key(k) for k in keys] if stored else []
        if stored:
            have = [to.weights.has(k) for k in scale_keys]
            if not any(have) and name == "lm_head" and shape.tie_word_embeddings:
                linear.weight = decoder.embed_tokens.weight  # tied, as unquantized
                continue
            if not any(have):
                linear.weight = torch.nn.Parameter(
                    torch.cat([to.weights.get(k, to.dtype, to.device) for k in keys]),
                    requires_grad=False,
                )
                continue
            if not all(have):
                raise CheckpointError(
                    f"decoder: {name} fuses {', '.join(keys)}, quantized only in part"
                )
        q, sc = _read_quantized(keys, scale_keys, method, to)
        bias = None if linear.bias is None else linear.bias.detach()
        quant.replace_module(decoder, name, quant.QuantizedLinear(q, sc, bias))


#: Bytes of fp32 rows quantized at once while loading (a slice of one matrix: the peak
#: while quantizing is the quantized model plus about this, never a whole fp32 matrix).
QUANTIZE_CHUNK_BYTES = 4 << 20


def _read_quantized(
    keys: list[str], scale_keys: list[str], method: str, to: _Target
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit weight ``[sum of rows, in]`` and fp32 scales ``[rows]`` of the source
    matrices ``keys`` fused by rows, written into tensors allocated once: read as stored
    when ``scale_keys`` (one per key) are given, else quantized here
    (:func:`~mmserve.model.quant.quantize_rows_into`, the values of
    :func:`~mmserve.model.quant.quantize_per_channel`) slice by slice of
    :data:`QUANTIZE_CHUNK_BYTES` of fp32, read from the file a slice at a time.

    Raises:
        CheckpointError: for a stored weight not in the method's dtype, or sources whose
            columns differ.
    """
    shapes = [to.weights.shape(k) for k in keys]
    if len({tuple(s[1:]) for s in shapes}) != 1:
        raise CheckpointError(f"decoder: {', '.join(keys)} have different columns: {shapes}")
    rows, cols = sum(s[0] for s in shapes), shapes[0][1:]
    dtype = quant.STORAGE[method]
    q = torch.empty([rows, *cols], dtype=dtype, device=to.device)
    sc = torch.empty(rows, dtype=torch.float32, device=to.device)
    at = 0
    for i, (k, s) in enumerate(zip(keys, shapes, strict=True)):
        if scale_keys:
            part = to.weights.get(k, None, to.device)
            if part.dtype != dtype:
                raise CheckpointError(f"decoder: {k} is {part.dtype}, expected {dtype} ({method})")
            q[at : at + s[0]] = part
            stored_scale = to.weights.get(scale_keys[i], torch.float32, to.device)
            sc[at : at + s[0]] = quant.row_scales(stored_scale, s[0])
            del part
        else:
            step = max(1, QUANTIZE_CHUNK_BYTES // (4 * max(1, q[0].numel())))
            for start in range(0, s[0], step):
                w = to.weights.rows(k, start, start + step).to(to.device)
                here = slice(at + start, at + start + len(w))
                quant.quantize_rows_into(w, method, q[here], sc[here])
                del w
        at += s[0]
    return q, sc


def load_model(
    model_dir: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
) -> LoadedModel:
    """Load a LLaVA-family checkpoint directory.

    Any layout that the installed transformers' ``AutoConfig`` and
    ``AutoProcessor`` read is accepted (see the module docstring).

    Args:
        model_dir: a directory as written by ``save_pretrained`` (config.json,
            safetensors weights, tokenizer and processor files).
        device: torch device for every module.
        dtype: parameter dtype (fp32 on CPU).
        quantization: "none", "int8" or "fp8": the decoder's linear layers quantized at
            load (:mod:`mmserve.model.quant`); a compressed-tensors checkpoint is served in
            its own method whatever this says, unless it names another (refused). Whether
            ``device`` can run the method is :func:`~mmserve.model.quant.check_quantization`'s
            to say (the engine calls it); here fp8 on the CPU runs the upcast twin.

    Returns:
        A :class:`LoadedModel`.

    Raises:
        CheckpointError: with the directory in the message, when it or its
            config.json does not exist, the architecture is not ``llava`` (or its
            decoder not Llama), the tokenizer or image processor cannot be loaded
            (naming the missing file), no weights are found, a shard listed in
            the index is missing, tensors are missing, or the tokenizer has more ids
            than the config's vocab_size (fewer is a padded vocabulary, as Qwen2's).
        QuantizationError: for an unknown ``quantization``, a checkpoint quantization
            method or layout that cannot be served, or one that conflicts with the flag.
    """
    model_dir = Path(model_dir)
    config, processor, family = read_front_end(model_dir)
    shape = text_shape(config)
    qc = getattr(config, "quantization_config", None)
    stored = quant.checkpoint_method(qc)
    if quantization not in quant.QUANTIZATIONS:
        quant.check_quantization(quantization, device)  # raises, naming the choices
    method = quant.resolve_method(quantization, stored, qc)
    weights = read_weights(model_dir)
    dec_w, vision_w = _split_weights(weights, family)
    if shape.tie_word_embeddings:  # transformers ignores a stored head and ties it
        dec_w.pop("lm_head.weight", None)
        if "embed_tokens.weight" in dec_w:
            dec_w["lm_head.weight"] = dec_w["embed_tokens.weight"]
    to = _Target(weights, dtype, device)
    # Built without memory or init (meta device, our module) or without init (the
    # family's transformers modules), then each tensor is read, cast and put in place:
    # peak memory while loading is the model plus one tensor (plus the vision side's
    # fp32 construction, freed tensor by tensor).
    with torch.device("meta"):
        decoder = LlamaDecoder(shape)
    targets = quant.target_modules(shape.num_layers, True) if method != "none" else []
    _load_strict(decoder, dec_w, "decoder", to, frozenset(f"{t}.weight" for t in targets))
    if stored != "none" and any(k.endswith(_QUANT_KEYS) for s in vision_w.values() for k in s):
        raise quant.QuantizationError(
            f"{model_dir}: the checkpoint quantizes vision tower or projector weights; "
            f"mmserve serves {quant.SUPPORTED_CHECKPOINTS} of the decoder's linear layers only"
        )
    try:
        with no_init_weights():
            vision = family.build_vision()
    except ValueError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    _load_vision(vision, vision_w, to)
    if method == "int4":
        fmt = quant.int4_format(getattr(config, "quantization_config", None))
        load_int4_decoder(decoder, dec_w, fmt, to)
    elif method != "none":
        _quantize_decoder(decoder, dec_w, method, stored != "none", to)
    decoder.to(device=device, dtype=dtype).eval()  # QuantizedLinear keeps its dtypes
    vision.to(device=device, dtype=dtype).eval()
    loaded = assemble(model_dir, config, processor, family, decoder, vision)
    loaded.quantization = method
    loaded.quantization_source = quantization_source(quantization, stored, qc)
    return loaded


def quantization_source(flag: str, stored: str, qc: dict | None = None) -> str:
    """Where the served quantization comes from, in words: stored weights (``stored``, in
    ``qc``'s format) or ``--quantization`` (``flag``) at load; "" for none."""
    if stored != "none":
        fmt = dict(qc or {}).get("quant_method", "compressed-tensors")
        return f"the checkpoint's {fmt} {stored} weights"
    return f"--quantization {flag}, quantized at load" if flag != "none" else ""


def load_vision(
    model_dir: Path, family: ModelFamily, dtype: torch.dtype, device: str
) -> VisionModule:
    """The vision tower and projector of ``model_dir`` alone, read tensor by tensor as
    :func:`load_model` reads them (the decoder's tensors are not touched).

    Raises:
        CheckpointError: as :func:`load_model`.
    """
    weights = read_weights(model_dir)
    _, vision_w = _split_weights(weights, family)
    try:
        with no_init_weights():
            vision = family.build_vision()
    except ValueError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    _load_vision(vision, vision_w, _Target(weights, dtype, device))
    return vision.to(device=device, dtype=dtype).eval()


def read_front_end(model_dir: Path) -> tuple[PretrainedConfig, Any, ModelFamily]:
    """The config, processor and family of ``model_dir``, without reading weights.

    Raises:
        CheckpointError: as :func:`load_model` for a missing directory, config,
            tokenizer or processor, an unsupported model, or a setting the family does
            not implement (:meth:`~mmserve.model.families.base.ModelFamily.check_checkpoint`).
    """
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    config = _load_config(model_dir)
    cls = _family_class(config)
    try:  # settings the family does not implement, named with their file or field
        cls.check_checkpoint(model_dir)
        processor = _family_processor(model_dir, config)
        return config, processor, cls(config, processor)
    except ValueError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None


def assemble(
    model_dir: Path,
    config: PretrainedConfig,
    processor: Any,
    family: ModelFamily,
    decoder: DecoderStack,
    vision: VisionModule,
) -> LoadedModel:
    """A :class:`LoadedModel` with its special token ids (image, video, EOS, never sampled).

    Raises:
        CheckpointError: when the tokenizer has more ids than the config's vocab_size.
    """
    vocab_size = text_shape(config).vocab_size
    tok = processor.tokenizer
    # more embedding rows than tokens is a padded vocabulary (Qwen2: 151,646 tokens in
    # 152,000 rows); more tokens than rows would index past the embedding matrix
    if len(tok) > vocab_size:
        raise CheckpointError(
            f"{model_dir}: tokenizer has {len(tok)} ids but vocab_size is {vocab_size}"
        )
    image_token_id = int(config.image_token_index)
    eos = config.text_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in eos_ids:
        eos_ids.append(tok.eos_token_id)
    video_token_id = None
    if family.video_frame_tokens() is not None:
        video_token_id = int(config.video_token_index)
    never = [image_token_id] + ([video_token_id] if video_token_id is not None else [])
    if tok.pad_token_id is not None and tok.pad_token_id not in eos_ids:
        never.append(tok.pad_token_id)
    return LoadedModel(
        config=config,
        decoder=decoder,
        vision=vision,
        processor=processor,
        image_token_id=image_token_id,
        num_image_tokens=family.fixed_image_tokens(),
        eos_token_ids=eos_ids,
        never_sample_ids=never,
        family=family,
        video_token_id=video_token_id,
        source=model_dir,
    )
