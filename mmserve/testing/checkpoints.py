"""Write seeded, randomly initialised checkpoints of the model families' test shapes.

Each family describes its checkpoints (:meth:`mmserve.model.families.base.ModelFamily.test_config`:
the transformers config, the tokenizer, the processors); this module only writes them,
whatever the family: the tokenizer (a byte-level BPE or SentencePiece model trained at build
time on ``assets/corpus.txt``, chat template from ``assets/``), the processor files and the
weights. A written directory loads offline with transformers' ``from_pretrained`` (the
family's ``...ForConditionalGeneration`` and processor) and with mmserve's loader.

Not on the serving path: ``mmserve make-model`` (:mod:`mmserve.cli`), the server's bundled
default model (:func:`ensure_model`), tests and benchmarks call in here.

The tokenizers are trained in :mod:`mmserve.testing.tokenizer` and the seeded weights drawn
in :mod:`mmserve.testing.weights`; their public names are re-exported here.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmserve.model.families import FAMILIES, FAMILY_NAMES, ModelFamily, family_named
from mmserve.model.families.sizes import special_token_ids
from mmserve.testing.tokenizer import ASSETS_DIR, CORPUS_PATH, build_tokenizer, train_sentencepiece
from mmserve.testing.weights import (
    QUANTIZED_FORMATS,
    _reinit,
    count_parameters,
    fix_modes,
    quantize_checkpoint,
    write_weights_streamed,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

#: Every checkpoint size some family has (``make-model --size``), in registry order.
SIZES: tuple[str, ...] = tuple(dict.fromkeys(s for f in FAMILIES.values() for s in f.test_sizes))

__all__ = [
    "CORPUS_PATH",
    "FAMILY_NAMES",
    "SIZES",
    "RANDOM_WEIGHTS_KEY",
    "STAMP_NAME",
    "build_config",
    "build_stamp",
    "build_tokenizer",
    "checkpoint_spec",
    "count_parameters",
    "default_model_dir",
    "ensure_model",
    "make_checkpoint",
    "quantize_checkpoint",
    "random_weights_checkpoint",
    "train_sentencepiece",
    "write_checkpoint",
    "write_weights_streamed",
]


def checkpoint_spec(
    size: str = "tiny", family: str | None = None, variant: str | None = None
) -> dict[str, Any]:
    """The description of ``family``'s checkpoint of ``size`` (its
    :meth:`~mmserve.model.families.base.ModelFamily.test_config`), as ``variant`` if given.

    Args:
        size: one of :data:`SIZES`.
        family: one of :data:`FAMILY_NAMES`; None: the first registered family that has
            ``size`` ("llava" for the test sizes, the model's own family for a real shape),
            or the variant's family.
        variant: None, or one of :data:`~mmserve.model.families.onevision_variants.TEST_VARIANTS`
            ("llava-video": LLaVA-Video-7B-Qwen2's settings on the OneVision layout).

    Raises:
        ValueError: if ``size``, ``family`` or ``variant`` is unknown, ``family`` has no
            ``size`` (a real shape belongs to one family), or the variant is of another
            family.
    """
    if variant is not None:
        from mmserve.model.families.onevision_variants import TEST_VARIANTS

        if variant not in TEST_VARIANTS:
            raise ValueError(
                f"unknown variant {variant!r}; expected one of {', '.join(TEST_VARIANTS)}"
            )
        owner, transform = TEST_VARIANTS[variant]
        if family not in (None, owner):
            raise ValueError(f"variant {variant!r} is a {owner} checkpoint, not {family}")
        return transform(checkpoint_spec(size, owner))
    if size not in SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; expected one of {', '.join(SIZES)}")
    owners = [f for f in FAMILIES.values() if size in f.test_sizes]
    cls: type[ModelFamily] | None = owners[0] if family is None else family_named(family)
    if cls is None:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILY_NAMES)}")
    if cls not in owners:
        raise ValueError(f"size {size!r} is a {owners[0].name} model, not {cls.name}")
    return cls.test_config(size)


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
    video_json = {**json.loads(video_processor.to_json_string()), **spec.get("video_extra", {})}
    if spec.get("video_extra"):  # settings the class does not keep (a variant's pooling)
        path = out / "video_preprocessor_config.json"
        path.write_text(json.dumps(video_json, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)
    nested = {
        "image_processor": json.loads(image_processor.to_json_string()),
        "video_processor": video_json,
        **args,
        "processor_class": spec["processor"]["class"],
    }
    (out / "processor_config.json").write_text(json.dumps(nested, indent=2, sort_keys=True) + "\n")


def write_checkpoint(
    out_dir: str | Path, spec: dict[str, Any], seed: int = 0, dtype: str | None = None
) -> Path:
    """Write the checkpoint a family's description (:func:`checkpoint_spec`) asks for.

    Files: ``config.json``, ``generation_config.json``, the weights (``model.safetensors``;
    a real shape's sharded above :data:`~mmserve.testing.weights.SHARD_BYTES`, with an
    index), the tokenizer (``tokenizer.json`` and/or ``tokenizer.model``,
    ``tokenizer_config.json``), ``chat_template.jinja``, ``processor_config.json`` and
    ``preprocessor_config.json`` (with a video processor also
    ``video_preprocessor_config.json``). Existing files of the same names are overwritten.

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
    # the mark a server reads to say its answers are noise (random_weights_checkpoint)
    setattr(config, RANDOM_WEIGHTS_KEY, True)
    assert config.architectures, "build_config names the architecture"
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
    fix_modes(out)  # safetensors writes 0600; the other files are 0644 under umask 022
    return out


def make_checkpoint(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    family: str | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    variant: str | None = None,
    group_size: int = 128,
    symmetric: bool | None = None,
) -> Path:
    """Write ``family``'s seeded checkpoint of ``size`` (:func:`write_checkpoint` of
    :func:`checkpoint_spec`), as ``variant`` if given.

    Args:
        out_dir: target directory; created (with parents) if missing.
        size: one of :data:`SIZES`: "tiny" (~1.0M parameters, for tests), "small" (~28M,
            for CPU benchmarks), or a real model's shapes with its tile sizes, grids,
            vocabulary size and special-token ids: "onevision-0.5b" (894M parameters,
            1.8 GB in bf16), "llava-1.5-7b" or "llava-next-7b" (7.1B, 14 GB).
        seed: weight seed; the same seed and library versions give byte-identical files.
        family: one of :data:`FAMILY_NAMES`; None: "llava", or a real shape's family.
        dtype: "float32" or "bfloat16"; None: bfloat16 for the real shapes, else float32.
        quantization: None, or "int8" / "fp8" (the compressed-tensors 8-bit layout),
            "int4" (compressed-tensors pack-quantized W4A16), "awq" or "gptq": the
            decoder's projections stored quantized (:func:`quantize_checkpoint`).
        group_size, symmetric: the 4-bit formats' group size and symmetry (None: the
            format's usual), as :func:`quantize_checkpoint`.
        variant: None, or a variant of :func:`checkpoint_spec` ("llava-video").

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: if ``size``, ``family`` or ``dtype`` is unknown, or ``family`` is not
            the family of a real ``size``.
    """
    if dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"unknown checkpoint dtype {dtype!r}; expected float32 or bfloat16")
    if quantization not in (None, "none", *QUANTIZED_FORMATS):
        raise ValueError(
            f"unknown quantization {quantization!r}; expected {', '.join(QUANTIZED_FORMATS)}"
        )
    path = write_checkpoint(out_dir, checkpoint_spec(size, family, variant), seed, dtype)
    if quantization in (None, "none"):
        return path
    return quantize_checkpoint(path, quantization, group_size, symmetric)


def default_model_dir(size: str = "tiny", family: str = "llava") -> Path:
    """Return the cache path of the seed-0 ``family`` ``size`` checkpoint (nothing is created).

    The path is ``$MMSERVE_CACHE_DIR/{family}-{size}-seed0``, with ``~/.cache/mmserve`` when
    the environment variable is unset or empty.
    """
    root = os.environ.get("MMSERVE_CACHE_DIR") or Path.home() / ".cache" / "mmserve"
    return Path(root) / f"{family}-{size}-seed0"


def ensure_model(size: str = "tiny", family: str = "llava") -> Path:
    """Return :func:`default_model_dir`, building the seed-0 checkpoint there if missing
    or built by another generator (its :data:`STAMP_NAME` is not :func:`build_stamp`'s:
    a changed chat template, corpus or writer; a cache from before stamps is rebuilt once).

    The build goes to a temporary sibling directory that is renamed into place, so a
    concurrent or interrupted build never leaves a half-written checkpoint behind.

    Raises:
        ValueError: if ``size`` is unknown.
    """
    target = default_model_dir(size, family)
    stamp = build_stamp(size, family)
    if _cached(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        make_checkpoint(tmp, size=size, seed=0, family=family)
        (tmp / STAMP_NAME).write_text(stamp + "\n", encoding="utf-8")
        if target.exists() and not _cached(target, stamp):  # built by an older generator
            stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
            try:
                os.rename(target, stale)
            except OSError:  # another process moved it first
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race (target exists and is non-empty)
            if not _cached(target, stamp):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


#: The file in a cached checkpoint that names the generator that built it.
STAMP_NAME = ".mmserve-build"

#: The ``config.json`` key (``true``) that :func:`write_checkpoint` writes: the weights
#: are seeded random numbers, so the model's answers carry no meaning.
RANDOM_WEIGHTS_KEY = "mmserve_random_weights"


def random_weights_checkpoint(model_dir: str | os.PathLike | None) -> bool:
    """Whether ``model_dir`` holds a checkpoint of seeded random weights written here
    (``mmserve make-model``, the bundled default model): its ``config.json`` has
    :data:`RANDOM_WEIGHTS_KEY` set, or (a checkpoint built before that key) the directory
    has the :data:`STAMP_NAME` that :func:`ensure_model` writes. False for None, a
    missing or unreadable directory, and any other checkpoint."""
    if not model_dir:
        return False
    path = Path(model_dir)
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    return (isinstance(cfg, dict) and cfg.get(RANDOM_WEIGHTS_KEY) is True) or (
        path / STAMP_NAME
    ).is_file()


def build_stamp(size: str = "tiny", family: str = "llava") -> str:
    """A digest of what a seed-0 checkpoint is built from: its description
    (:func:`checkpoint_spec`), the files in ``assets/`` (chat templates, corpus) and the
    generator's source (``mmserve/testing/*.py``). :func:`ensure_model` rebuilds a cached
    checkpoint whose stamp differs, so a changed template or generator never leaves an
    old checkpoint in use.

    Raises:
        ValueError: if ``size`` or ``family`` is unknown.
    """
    h = hashlib.sha256(json.dumps(checkpoint_spec(size, family), sort_keys=True).encode())
    here = Path(__file__).resolve().parent
    for path in sorted([*ASSETS_DIR.iterdir(), *here.glob("*.py")]):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _cached(target: Path, stamp: str) -> bool:
    """Whether ``target`` holds a whole checkpoint built with ``stamp``."""
    try:
        found = (target / STAMP_NAME).read_text(encoding="utf-8").strip()
    except OSError:
        return False
    return found == stamp and (target / "model.safetensors").is_file()
