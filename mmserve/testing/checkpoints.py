"""Write seeded, randomly initialised checkpoints of the model families' test shapes.

Each family describes its checkpoints (:meth:`mmserve.model.families.base.ModelFamily.test_config`:
the transformers config, the tokenizer, the processors); this module only writes them,
whatever the family: the tokenizer (a byte-level BPE or SentencePiece model trained at build
time on ``assets/corpus.txt``, chat template from ``assets/``), the processor files and the
weights. A written directory loads offline with transformers' ``from_pretrained`` (the
family's ``...ForConditionalGeneration`` and processor) and with mmserve's loader.

Weights are seeded random values, scaled (not the usual 0.02 std) so that different images
produce clearly different greedy answers. Same seed and same library versions give
byte-identical files. Real-shape sizes are written tensor by tensor
(:func:`write_weights_streamed`), never the whole model in memory.

Not on the serving path: ``mmserve make-model`` (:mod:`mmserve.cli`), the server's bundled
default model (:func:`ensure_model`), tests and benchmarks call in here.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mmserve.model.families import FAMILIES, FAMILY_NAMES, ModelFamily, family_named
from mmserve.model.families.sizes import special_token_ids

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
#: Trained vocabulary size (special tokens included) of the test tokenizers.
VOCAB_SIZE = 2000
#: Every checkpoint size some family has (``make-model --size``), in registry order.
SIZES: tuple[str, ...] = tuple(dict.fromkeys(s for f in FAMILIES.values() for s in f.test_sizes))
#: Llama's first four ids, which a SentencePiece test tokenizer must start with.
SENTENCEPIECE_HEAD = ("<unk>", "<s>", "</s>", "<pad>")

__all__ = [
    "CORPUS_PATH",
    "FAMILY_NAMES",
    "SIZES",
    "build_config",
    "build_tokenizer",
    "checkpoint_spec",
    "count_parameters",
    "default_model_dir",
    "ensure_model",
    "make_checkpoint",
    "quantize_checkpoint",
    "train_sentencepiece",
    "write_checkpoint",
    "write_weights_streamed",
]


def checkpoint_spec(size: str = "tiny", family: str | None = None) -> dict[str, Any]:
    """The description of ``family``'s checkpoint of ``size`` (its
    :meth:`~mmserve.model.families.base.ModelFamily.test_config`).

    Args:
        size: one of :data:`SIZES`.
        family: one of :data:`FAMILY_NAMES`; None: the first registered family that has
            ``size`` ("llava" for the test sizes, the model's own family for a real shape).

    Raises:
        ValueError: if ``size`` or ``family`` is unknown, or ``family`` has no ``size``
            (a real shape belongs to one family).
    """
    if size not in SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; expected one of {', '.join(SIZES)}")
    owners = [f for f in FAMILIES.values() if size in f.test_sizes]
    cls: type[ModelFamily] | None = owners[0] if family is None else family_named(family)
    if cls is None:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILY_NAMES)}")
    if cls not in owners:
        raise ValueError(f"size {size!r} is a {owners[0].name} model, not {cls.name}")
    return cls.test_config(size)


def build_tokenizer(
    spec: dict[str, Any], out_dir: Path | None = None, corpus_path: str | Path = CORPUS_PATH
) -> PreTrainedTokenizerBase:
    """Train the tokenizer a family's ``"tokenizer"`` description asks for.

    "bpe": a byte-level BPE of :data:`VOCAB_SIZE` ids (``specials`` first), grown to a real
    tokenizer's ids when ``padded`` (:func:`pad_vocabulary`), with ``prepend`` put before
    every sequence, wrapped as transformers' fast tokenizer with ``settings``.
    "sentencepiece": :func:`train_sentencepiece` writes ``tokenizer.model`` and
    ``tokenizer_config.json`` (``settings``) into ``out_dir``, read back with
    ``AutoTokenizer`` (transformers needs protobuf to convert it).

    Returns:
        A transformers tokenizer with the description's chat template.

    Raises:
        FileNotFoundError: if ``corpus_path`` does not exist.
        ValueError: for an unknown ``kind``, or "sentencepiece" without ``out_dir``.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    template = (ASSETS_DIR / spec["chat_template"]).read_text(encoding="utf-8")
    if spec["kind"] == "sentencepiece":
        if out_dir is None:
            raise ValueError("a SentencePiece tokenizer is written into out_dir: give one")
        model = train_sentencepiece(spec["specials"], corpus_path=corpus_path)
        (out_dir / "tokenizer.model").write_bytes(model)
        settings = {**spec["settings"], "chat_template": template}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(settings))
        return AutoTokenizer.from_pretrained(out_dir)
    if spec["kind"] != "bpe":
        raise ValueError(f"unknown tokenizer kind {spec['kind']!r}; expected bpe or sentencepiece")
    tok = _train_byte_bpe(corpus_path, VOCAB_SIZE, tuple(spec["specials"]))
    if spec.get("padded"):
        regular, tail = spec["padded"]
        tok = pad_vocabulary(tok, regular, tuple(tail))
    if first := spec.get("prepend"):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{first} $A",
            pair=f"{first} $A {first} $B",
            special_tokens=[(first, tok.token_to_id(first))],
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, **spec["settings"], chat_template=template)


def train_sentencepiece(
    specials: list[str] | tuple[str, ...],
    vocab_size: int = VOCAB_SIZE,
    corpus_path: str | Path = CORPUS_PATH,
) -> bytes:
    """A SentencePiece BPE ``tokenizer.model`` (the file's bytes) trained on ``corpus_path``,
    laid out as Llama's: ``specials`` start with :data:`SENTENCEPIECE_HEAD` (ids 0-3); the
    rest (``<image>``) are user-defined symbols from id 4; byte fallback on, digits split,
    no normalisation.

    Raises:
        ValueError: if ``specials`` does not start with :data:`SENTENCEPIECE_HEAD`.
    """
    import io

    import sentencepiece as spm

    if tuple(specials[:4]) != SENTENCEPIECE_HEAD:
        raise ValueError(f"SentencePiece specials must start with {SENTENCEPIECE_HEAD}")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(corpus_path),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        user_defined_symbols=list(specials[4:]),
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        normalization_rule_name="identity",
        split_digits=True,
        minloglevel=2,
    )
    return buf.getvalue()


def pad_vocabulary(tok: Tokenizer, regular: int, tail: tuple[str, ...]) -> Tokenizer:
    """Grow a trained BPE tokenizer to a real tokenizer's number of ids.

    A real vocabulary (Qwen2's 151,643 merges, Llama's 32,000 pieces) cannot be trained on
    the bundled corpus and cannot be downloaded offline, so the trained vocabulary is
    filled up with unreachable entries ``<|filler_N|>`` (in the BPE vocabulary, but no
    merge produces them: text never encodes to them, and they decode to their own
    string) up to ``regular`` ids, and ``tail`` follows as special added tokens with ids
    ``regular, regular + 1, ...``. The result has the real tokenizer's length and the real
    ids of its special tokens; the embedding and LM head rows of the filler ids are real
    rows of the model that greedy decoding can pick.

    Args:
        tok: a trained ``tokenizers.Tokenizer`` with a BPE model of fewer than
            ``regular`` entries (its own special tokens keep their ids).
        regular: ids of the padded BPE vocabulary.
        tail: special tokens placed after it, in id order.

    Returns:
        A new ``tokenizers.Tokenizer`` with ``regular + len(tail)`` ids.

    Raises:
        ValueError: if ``tok`` already has ``regular`` entries or more.
    """
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    if len(vocab) >= regular:
        raise ValueError(f"the trained vocabulary ({len(vocab)}) is not below {regular}")
    vocab.update({f"<|filler_{i}|>": i for i in range(len(vocab), regular)})
    added = spec.get("added_tokens") or []
    for i, content in enumerate(tail):
        added.append(
            {"id": regular + i, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
    spec["added_tokens"] = added
    return Tokenizer.from_str(json.dumps(spec))


def _train_byte_bpe(
    corpus_path: str | Path, vocab_size: int, specials: tuple[str, ...]
) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus_path``; ``specials``
    take ids 0, 1, ... in order.

    Raises:
        FileNotFoundError: if ``corpus_path`` does not exist.
    """
    corpus_path = Path(corpus_path)
    if not corpus_path.is_file():
        raise FileNotFoundError(f"tokenizer corpus not found: {corpus_path}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus_path)], trainer)
    return tok


def build_config(spec: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config of a family's description, for ``tokenizer``: ``text_config``'s
    ``vocab_size`` is the tokenizer's length unless the description gives one.

    Raises:
        ValueError: if the tokenizer's special-token ids are not the ones the description's
            config uses (:func:`~mmserve.model.families.sizes.special_token_ids`).
    """
    from transformers import AutoConfig

    kwargs = copy.deepcopy(spec["config"])
    kwargs["text_config"].setdefault("vocab_size", len(tokenizer))
    for token, want in special_token_ids(spec["tokenizer"]).items():
        got = tokenizer.convert_tokens_to_ids(token)
        if got != want:
            raise ValueError(f"the tokenizer gives {token} id {got}; the config expects {want}")
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def _instance(spec: dict[str, Any]) -> Any:
    """``spec["class"]`` (a transformers name or a dotted path) called with the other keys."""
    name = spec["class"]
    module, _, attr = name.rpartition(".")
    cls = getattr(importlib.import_module(module or "transformers"), attr)
    return cls(**{k: v for k, v in spec.items() if k != "class"})


def _write_processor(out: Path, spec: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> None:
    """The tokenizer and processor files, as transformers' ``save_pretrained`` lays them out:
    the processor's (``processor_config.json`` with the image processor nested, tokenizer,
    ``chat_template.jinja``) and a standalone ``preprocessor_config.json``. A processor with
    a video processor is written file by file (``video_preprocessor_config.json`` too):
    transformers' processor class cannot be built without torchvision, which its video
    processor needs; only the video processor's settings are used here."""
    image_processor = _instance(spec["image_processor"])
    if "video_processor" not in spec:
        template = (ASSETS_DIR / spec["tokenizer"]["chat_template"]).read_text(encoding="utf-8")
        parts = dict(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
        _instance({**spec["processor"], **parts}).save_pretrained(out)
        image_processor.save_pretrained(out)
        return
    args = {k: v for k, v in spec["processor"].items() if k != "class"}
    video_processor = _instance(spec["video_processor"])
    image_processor.save_pretrained(out)
    video_processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    nested = {
        "image_processor": json.loads(image_processor.to_json_string()),
        "video_processor": json.loads(video_processor.to_json_string()),
        **args,
        "processor_class": spec["processor"]["class"],
    }
    (out / "processor_config.json").write_text(json.dumps(nested, indent=2, sort_keys=True) + "\n")


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


def write_checkpoint(
    out_dir: str | Path, spec: dict[str, Any], seed: int = 0, dtype: str | None = None
) -> Path:
    """Write the checkpoint a family's description (:func:`checkpoint_spec`) asks for.

    Files: ``config.json``, ``generation_config.json``, the weights (``model.safetensors``;
    a real shape's sharded above :data:`SHARD_BYTES`, with an index), the tokenizer
    (``tokenizer.json`` and/or ``tokenizer.model``, ``tokenizer_config.json``),
    ``chat_template.jinja``, ``processor_config.json`` and ``preprocessor_config.json``
    (with a video processor also ``video_preprocessor_config.json``). Existing files of the
    same names are overwritten.

    Args:
        out_dir: target directory; created (with parents) if missing.
        spec: the description (not modified).
        seed: weight seed; the same seed and library versions give byte-identical files.
        dtype: stored dtype, "float32" or "bfloat16"; None: bfloat16 for a real shape (as
            published), else float32.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: for an unknown ``dtype`` or a description the tokenizer disagrees with.
    """
    import transformers
    from transformers import GenerationConfig

    if dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"unknown checkpoint dtype {dtype!r}; expected float32 or bfloat16")
    spec = copy.deepcopy(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(spec["tokenizer"], out)
    config = build_config(spec, tokenizer)
    model_cls = getattr(transformers, config.architectures[0])
    stored = getattr(torch, dtype or ("bfloat16" if spec["real"] else "float32"))
    tied = bool(config.tie_word_embeddings)
    _write_processor(out, spec, tokenizer)
    if spec["real"]:  # never the whole model in memory
        config.dtype = stored
        config.save_pretrained(out)
        generation = GenerationConfig.from_model_config(config)
        generation.do_sample = False
        generation.save_pretrained(out)
        write_weights_streamed(out, model_cls, config, seed, tied, stored)
        return out
    model = model_cls(config).to(torch.float32).eval()
    _reinit(model, seed, tied=tied)  # drawn in fp32, then stored in ``stored``
    model.to(stored)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    return out


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


def make_checkpoint(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    family: str | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
) -> Path:
    """Write ``family``'s seeded checkpoint of ``size`` (:func:`write_checkpoint` of
    :func:`checkpoint_spec`).

    Args:
        out_dir: target directory; created (with parents) if missing.
        size: one of :data:`SIZES`: "tiny" (~1.0M parameters, for tests), "small" (~28M,
            for CPU benchmarks), or a real model's shapes with its tile sizes, grids,
            vocabulary size and special-token ids: "onevision-0.5b" (894M parameters,
            1.8 GB in bf16), "llava-1.5-7b" or "llava-next-7b" (7.1B, 14 GB).
        seed: weight seed; the same seed and library versions give byte-identical files.
        family: one of :data:`FAMILY_NAMES`; None: "llava", or a real shape's family.
        dtype: "float32" or "bfloat16"; None: bfloat16 for the real shapes, else float32.
        quantization: None, or "int8" / "fp8": the decoder's projections stored quantized
            in the compressed-tensors layout (:func:`quantize_checkpoint`).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: if ``size``, ``family`` or ``dtype`` is unknown, or ``family`` is not
            the family of a real ``size``.
    """
    if dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"unknown checkpoint dtype {dtype!r}; expected float32 or bfloat16")
    if quantization not in (None, "none", "int8", "fp8"):
        raise ValueError(f"unknown quantization {quantization!r}; expected int8 or fp8")
    path = write_checkpoint(out_dir, checkpoint_spec(size, family), seed, dtype)
    return quantize_checkpoint(path, quantization) if quantization not in (None, "none") else path


def count_parameters(model_dir: str | Path) -> int:
    """Total number of parameters stored in ``model_dir``'s safetensors file(s)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def default_model_dir(size: str = "tiny", family: str = "llava") -> Path:
    """Return the cache path of the seed-0 ``family`` ``size`` checkpoint (nothing is created).

    The path is ``$MMSERVE_CACHE_DIR/{family}-{size}-seed0``, with ``~/.cache/mmserve`` when
    the environment variable is unset or empty.
    """
    root = os.environ.get("MMSERVE_CACHE_DIR") or Path.home() / ".cache" / "mmserve"
    return Path(root) / f"{family}-{size}-seed0"


def ensure_model(size: str = "tiny", family: str = "llava") -> Path:
    """Return :func:`default_model_dir`, building the seed-0 checkpoint there if missing.

    The build goes to a temporary sibling directory that is renamed into place, so a
    concurrent or interrupted build never leaves a half-written checkpoint behind.

    Raises:
        ValueError: if ``size`` is unknown.
    """
    target = default_model_dir(size, family)
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        make_checkpoint(tmp, size=size, seed=0, family=family)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race (target exists and is non-empty)
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
