"""Build small, deterministic, randomly initialised LLaVA-1.5-shaped checkpoints.

The checkpoint directory written by :func:`make_checkpoint` loads offline with
``transformers.LlavaForConditionalGeneration.from_pretrained(dir)`` and
``transformers.AutoProcessor.from_pretrained(dir)`` (a ``LlavaProcessor``). It has the
real LLaVA-1.5 layout -- CLIP vision tower at 336 px / patch 14 (576 image tokens, CLS
dropped, features from layer -2), a two-layer GELU projector and a Llama text model
with grouped-query attention and head_dim 64 -- but tiny widths, so that the serving
stack can be exercised on CPU. The tokenizer is a byte-level BPE trained at build time
on ``assets/corpus.txt``; the chat template is ``assets/chat_template.jinja``.

Weights are seeded random values, scaled (not the usual 0.02 std) so that different
images produce clearly different greedy answers. Same seed and same library versions
give byte-identical files.

Families (``--family``): "llava" (above), "llava-next" (any-resolution tiles, a
SentencePiece tokenizer) and "llava-onevision" (SigLIP tower, Qwen2 decoder with q/k/v
biases, any-resolution grid, video path; a byte-level BPE tokenizer with Qwen2's ChatML
specials and ``assets/chat_template_chatml.jinja``).

Command line: ``python -m mmserve.testing.checkpoints OUT_DIR [--size tiny|small]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    from transformers import LlavaConfig, PreTrainedTokenizerFast

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
CHAT_TEMPLATE_PATH = ASSETS_DIR / "chat_template.jinja"
CHATML_TEMPLATE_PATH = ASSETS_DIR / "chat_template_chatml.jinja"

#: Special tokens, in id order (``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2, ``<pad>`` = 3,
#: ``<image>`` = 4).
SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
VOCAB_SIZE = 2000
IMAGE_SIZE = 336
PATCH_SIZE = 14
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

#: Width/depth per size. ``v_*``: CLIP vision tower, ``t_*``: Llama text model.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        v_hidden=64, v_layers=2, v_heads=4, v_inter=128,
        t_hidden=128, t_layers=2, t_heads=2, t_kv_heads=1, t_inter=256,
    ),
    "small": dict(
        v_hidden=256, v_layers=4, v_heads=4, v_inter=1024,
        t_hidden=512, t_layers=8, t_heads=8, t_kv_heads=2, t_inter=1408,
    ),
    # Real shapes (seeded random weights), as published in the llava-hf config.json files.
    # llava-onevision-qwen2-0.5b-ov-hf: SigLIP so400m (27 layers, 26 used at 384 px) and
    # Qwen2-0.5B (tied embeddings; 151,936 embedding rows for 151,648 token ids).
    "onevision-0.5b": dict(
        v_hidden=1152, v_layers=26, v_heads=16, v_inter=4304,
        t_hidden=896, t_layers=24, t_heads=14, t_kv_heads=2, t_inter=4864,
        t_vocab=151936, t_max_pos=32768, t_head_dim=64,
    ),
    # llava-1.5-7b-hf: CLIP ViT-L/14 at 336 px and Vicuna-7B (Llama, 32,064 rows).
    "llava-1.5-7b": dict(
        v_hidden=1024, v_layers=24, v_heads=16, v_inter=4096, v_proj=768,
        t_hidden=4096, t_layers=32, t_heads=32, t_kv_heads=32, t_inter=11008,
        t_vocab=32064, t_max_pos=4096, t_head_dim=128,
    ),
    # llava-v1.6-vicuna-7b-hf: the same two models, 336-px tiles on NeXT's five grids.
    "llava-next-7b": dict(
        v_hidden=1024, v_layers=24, v_heads=16, v_inter=4096, v_proj=768,
        t_hidden=4096, t_layers=32, t_heads=32, t_kv_heads=32, t_inter=11008,
        t_vocab=32064, t_max_pos=4096, t_head_dim=128,
    ),
}  # fmt: skip
#: The family of each real-shape size (the test sizes take any family).
REAL_SIZES: dict[str, str] = {
    "onevision-0.5b": "llava-onevision",
    "llava-1.5-7b": "llava",
    "llava-next-7b": "llava-next",
}
#: Qwen2's special tokens in real id order, then LLaVA-OneVision's two placeholders.
QWEN2_REAL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
#: Token ids (the tokenizer's length) of the real-shape sizes: the regular vocabulary of
#: the real tokenizer, then its special tokens at their real ids (see :func:`pad_vocabulary`).
REAL_TOKENIZERS: dict[str, tuple[int, tuple[str, ...]]] = {
    # Qwen2: 151,643 byte-level BPE tokens, then <|endoftext|> 151643, <|im_start|> 151644,
    # <|im_end|> 151645, and OneVision's <image> 151646, <video> 151647
    "onevision-0.5b": (151643, QWEN2_REAL_SPECIALS),
    # Llama's 32,000 (<unk> 0, <s> 1, </s> 2 among them), then llava-hf's <image> 32000, <pad> 32001
    "llava-1.5-7b": (32000, ("<image>", "<pad>")),
    "llava-next-7b": (32000, ("<image>", "<pad>")),
}  # fmt: skip


def build_tokenizer(
    corpus_path: str | Path = CORPUS_PATH, vocab_size: int = VOCAB_SIZE, real: str | None = None
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer and wrap it for transformers.

    Args:
        corpus_path: UTF-8 text file, one sentence per line.
        vocab_size: target vocabulary size including the special tokens.
        real: a LLaVA key of :data:`REAL_TOKENIZERS`: the vocabulary is padded to the
            real tokenizer's 32,000 ids (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2) and
            ``<image>`` / ``<pad>`` take their real ids 32000 / 32001
            (:func:`pad_vocabulary`); else ids follow :data:`SPECIAL_TOKENS`.

    Returns:
        A ``transformers`` fast tokenizer (``TokenizersBackend``) that prepends ``<s>``
        to every encoded sequence, with ``<image>`` as a single special token.

    Raises:
        FileNotFoundError: if ``corpus_path`` does not exist.
    """
    from transformers import PreTrainedTokenizerFast

    if real is None:
        tok = _train_byte_bpe(corpus_path, vocab_size, SPECIAL_TOKENS)
    else:
        regular, tail = REAL_TOKENIZERS[real]
        head = tuple(t for t in SPECIAL_TOKENS if t not in tail)
        tok = pad_vocabulary(_train_byte_bpe(corpus_path, vocab_size, head), regular, tail)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        model_max_length=SIZES[real]["t_max_pos"] if real else 8192,
        chat_template=CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
    )


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


#: Qwen2's special tokens, in id order (``<|endoftext|>`` = 0, ``<|im_start|>`` = 1,
#: ``<|im_end|>`` = 2), then the ``<image>`` (3) and ``<video>`` (4) placeholders.
QWEN2_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<video>",
)


def build_qwen2_tokenizer(
    corpus_path: str | Path = CORPUS_PATH, vocab_size: int = VOCAB_SIZE, real: str | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer shaped like Qwen2's: no BOS, ``<|im_end|>`` ends a turn
    (EOS), ``<|endoftext|>`` pads, ``<image>`` and ``<video>`` are single special tokens,
    and the ChatML chat template (``assets/chat_template_chatml.jinja``).

    Ids: see :data:`QWEN2_SPECIAL_TOKENS`; every special string is in
    ``all_special_tokens``, so a typed ``<|im_start|>`` stays plain text. With ``real``
    ("onevision-0.5b"), the real layout instead: 151,643 regular ids (the trained ones,
    then unreachable fillers, :func:`pad_vocabulary`) and the specials at 151643..151647.

    Raises:
        FileNotFoundError: if ``corpus_path`` does not exist.
    """
    from transformers import PreTrainedTokenizerFast

    if real is None:
        tok = _train_byte_bpe(corpus_path, vocab_size, QWEN2_SPECIAL_TOKENS)
    else:
        regular, tail = REAL_TOKENIZERS[real]
        tok = pad_vocabulary(_train_byte_bpe(corpus_path, vocab_size, ()), regular, tail)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>", "<image>", "<video>"],
        image_token="<image>",
        video_token="<video>",
        model_max_length=SIZES[real]["t_max_pos"] if real else 8192,
        chat_template=CHATML_TEMPLATE_PATH.read_text(encoding="utf-8"),
    )


#: Checkpoint families ``make_checkpoint`` writes (``--family``).
FAMILY_NAMES = ("llava", "llava-next", "llava-onevision")
#: LLaVA-NeXT tile side (pixels) and grid pinpoints per size: small tiles keep a CPU
#: prefill short; real llava-v1.6 checkpoints use 336-px tiles.
NEXT_TILES: dict[str, tuple[int, list[list[int]]]] = {
    "tiny": (112, [[112, 224], [224, 112], [224, 224], [112, 336], [336, 112]]),
    "small": (168, [[168, 336], [336, 168], [336, 336], [168, 504], [504, 168]]),
    "llava-next-7b": (336, [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]),
}


#: LLaVA-OneVision tile side (pixels, patch 14) and grid size (tiles per side, up to) per
#: size. Real checkpoints use 384-px tiles (27 x 27 patches) on a 6 x 6 grid; these give
#: 7 x 7 (tiny) and 9 x 9 (small) patches, odd like 27, so video pooling (to ceil(n / 2))
#: is a real bilinear resize, and a 4 x 4 tiny grid is past "anyres_max_9", so large
#: images are shrunk as on the real model.
ONEVISION_TILES: dict[str, tuple[int, int]] = {
    "tiny": (98, 4),
    "small": (126, 3),
    "onevision-0.5b": (384, 6),
}
#: Mean and std of the SigLIP image and video processors.
SIGLIP_MEAN = [0.5, 0.5, 0.5]
SIGLIP_STD = [0.5, 0.5, 0.5]


def onevision_pinpoints(size: str) -> list[list[int]]:
    """The ``image_grid_pinpoints`` of a OneVision checkpoint: every ``[i * tile, j * tile]``
    for 1 <= i, j <= the grid size of :data:`ONEVISION_TILES` (like the real 6 x 6 list)."""
    tile, grid = ONEVISION_TILES[size]
    return [[i * tile, j * tile] for i in range(1, grid + 1) for j in range(1, grid + 1)]


def build_onevision_config(size: str, tokenizer: object) -> object:
    """The ``LlavaOnevisionConfig`` for ``size``: a SigLIP tower (no head, features of the
    last layer, all patches: "full"), a Qwen2 decoder (q/k/v biases, RoPE base 1e6; tied
    embeddings for "tiny" as Qwen2-0.5B, untied for "small" as the 7B) and the grid of
    :func:`onevision_pinpoints` with ``vision_aspect_ratio`` "anyres_max_9".

    Raises:
        ValueError: if ``size`` is not a key of :data:`SIZES`.
    """
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    if size not in SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; expected one of {sorted(SIZES)}")
    s = SIZES[size]
    tile, _ = ONEVISION_TILES[size]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_SPECIAL_TOKENS}
    tied = size in ("tiny", "onevision-0.5b")
    vision = SiglipVisionConfig(
        hidden_size=s["v_hidden"],
        intermediate_size=s["v_inter"],
        num_hidden_layers=s["v_layers"],
        num_attention_heads=s["v_heads"],
        image_size=tile,
        patch_size=PATCH_SIZE,
        vision_use_head=False,
    )
    text = Qwen2Config(
        vocab_size=s.get("t_vocab", len(tokenizer)),
        hidden_size=s["t_hidden"],
        intermediate_size=s["t_inter"],
        num_hidden_layers=s["t_layers"],
        num_attention_heads=s["t_heads"],
        num_key_value_heads=s["t_kv_heads"],
        max_position_embeddings=s.get("t_max_pos", 8192),
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=tied,
    )
    return LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        projector_hidden_act="gelu",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
        image_grid_pinpoints=onevision_pinpoints(size),
        tie_word_embeddings=tied,
    )


def _write_onevision_processor(out: Path, size: str, config: object, tokenizer: object) -> None:
    """The OneVision processor files, as transformers' ``save_pretrained`` lays them out:
    ``preprocessor_config.json`` (PIL image processor), ``video_preprocessor_config.json``,
    ``processor_config.json`` (both nested, plus the processor's own settings), the
    tokenizer and ``chat_template.jinja``. Written by hand: a ``LlavaOnevisionProcessor``
    cannot be built without torchvision (its video processor needs it)."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    # the module, not ``transformers.LlavaOnevisionVideoProcessor`` (a stand-in that
    # refuses to exist without torchvision); only its settings are used
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor,
    )

    tile, _ = ONEVISION_TILES[size]
    common = dict(
        size={"height": tile, "width": tile},
        image_mean=SIGLIP_MEAN,
        image_std=SIGLIP_STD,
        do_convert_rgb=True,
    )
    image_processor = LlavaOnevisionImageProcessorPil(
        image_grid_pinpoints=config.image_grid_pinpoints, do_pad=True, **common
    )
    video_processor = LlavaOnevisionVideoProcessor(**common)
    image_processor.save_pretrained(out)
    video_processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    nested = {
        "image_processor": json.loads(image_processor.to_json_string()),
        "video_processor": json.loads(video_processor.to_json_string()),
        "image_token": "<image>",
        "video_token": "<video>",
        "num_image_tokens": (tile // PATCH_SIZE) ** 2,
        "vision_aspect_ratio": config.vision_aspect_ratio,
        "vision_feature_select_strategy": config.vision_feature_select_strategy,
        "processor_class": "LlavaOnevisionProcessor",
    }
    (out / "processor_config.json").write_text(json.dumps(nested, indent=2, sort_keys=True) + "\n")


def build_sentencepiece_tokenizer(out_dir: Path, corpus_path: str | Path = CORPUS_PATH) -> object:
    """Train a SentencePiece BPE ``tokenizer.model`` into ``out_dir`` and load it with
    transformers (a Llama tokenizer, as llava-v1.6 Vicuna/Mistral checkpoints have).

    Ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 3, ``<image>`` 4; byte fallback on.

    Returns:
        The transformers tokenizer read from ``out_dir`` (needs protobuf to convert).
    """
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(corpus_path),
        model_writer=buf,
        vocab_size=VOCAB_SIZE,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        user_defined_symbols=["<image>"],
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        normalization_rule_name="identity",
        split_digits=True,
        minloglevel=2,
    )
    (out_dir / "tokenizer.model").write_bytes(buf.getvalue())
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "legacy": False,
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "extra_special_tokens": {"image_token": "<image>"},
                "model_max_length": 8192,
                "chat_template": CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
            }
        )
    )
    return AutoTokenizer.from_pretrained(out_dir)


def build_next_config(size: str, tokenizer: object) -> object:
    """The ``LlavaNextConfig`` for ``size``: LLaVA-1.5's widths, NeXT tiles (see
    :data:`NEXT_TILES`).

    Raises:
        ValueError: if ``size`` is not a key of :data:`SIZES`.
    """
    from transformers import LlavaNextConfig

    base = build_config(size, tokenizer)
    tile, pinpoints = NEXT_TILES[size]
    vision = base.vision_config
    vision.image_size = tile
    return LlavaNextConfig(
        vision_config=vision,
        text_config=base.text_config,
        image_token_index=base.image_token_index,
        image_grid_pinpoints=pinpoints,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
        image_seq_length=(tile // PATCH_SIZE) ** 2,
    )


def build_config(size: str, tokenizer: PreTrainedTokenizerFast) -> LlavaConfig:
    """Return the ``LlavaConfig`` for ``size`` (see :data:`SIZES`) and ``tokenizer``.

    Raises:
        ValueError: if ``size`` is not a key of :data:`SIZES`.
    """
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    if size not in SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; expected one of {sorted(SIZES)}")
    s = SIZES[size]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vision = CLIPVisionConfig(
        hidden_size=s["v_hidden"],
        intermediate_size=s["v_inter"],
        num_hidden_layers=s["v_layers"],
        num_attention_heads=s["v_heads"],
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=s.get("v_proj", s["v_hidden"]),
        hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        vocab_size=s.get("t_vocab", len(tokenizer)),
        hidden_size=s["t_hidden"],
        intermediate_size=s["t_inter"],
        num_hidden_layers=s["t_layers"],
        num_attention_heads=s["t_heads"],
        num_key_value_heads=s["t_kv_heads"],
        head_dim=s.get("t_head_dim", 64),
        max_position_embeddings=s.get("t_max_pos", 8192),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )


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


def make_checkpoint(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    family: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Write a complete seeded checkpoint directory in transformers' save layout.

    Files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32; the
    real shapes: bf16, sharded above :data:`SHARD_BYTES` with an index),
    the tokenizer (``tokenizer.json``; for "llava-next" also the SentencePiece
    ``tokenizer.model`` it was built from), ``tokenizer_config.json``,
    ``chat_template.jinja``, ``processor_config.json`` and ``preprocessor_config.json``
    (for "llava-onevision" also ``video_preprocessor_config.json``).
    Existing files of the same names are overwritten.

    Args:
        out_dir: target directory; created (with parents) if missing.
        size: ``"tiny"`` (~1.0M parameters, for tests), ``"small"`` (~28M parameters,
            for CPU benchmarks), or a real shape of :data:`REAL_SIZES`:
            ``"onevision-0.5b"`` (894M parameters, 1.8 GB in bf16), ``"llava-1.5-7b"``
            (7.1B, 14 GB) or ``"llava-next-7b"`` (7.1B, 14 GB), with the real tile sizes,
            grids, vocabulary sizes and special-token ids (tokenizer: :func:`pad_vocabulary`).
            Real shapes are written tensor by tensor (:func:`write_weights_streamed`).
        seed: weight seed; the same seed and library versions give byte-identical files.
        family: "llava" (LLaVA-1.5: CLIP 336 px, 576 tokens per image), "llava-next"
            (any-resolution tiles of :data:`NEXT_TILES`) or "llava-onevision" (SigLIP +
            Qwen2, tiles and grid of :data:`ONEVISION_TILES`, video path). None: "llava",
            or the family of a real shape (which takes no other).
        dtype: stored dtype, "float32" or "bfloat16"; None: float32 for the test sizes,
            bfloat16 (as published) for the real shapes.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: if ``size``, ``family`` or ``dtype`` is unknown, or ``family`` is not
            the family of a real ``size``.
    """
    if size not in SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; expected one of {list(SIZES)}")
    real_family = REAL_SIZES.get(size)
    if family is None:
        family = real_family or "llava"
    if family not in FAMILY_NAMES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILY_NAMES)}")
    if real_family is not None and family != real_family:
        raise ValueError(f"size {size!r} is a {real_family} model, not {family}")
    if dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"unknown checkpoint dtype {dtype!r}; expected float32 or bfloat16")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if real_family is not None:
        return _make_real(out, size, seed, getattr(torch, dtype or "bfloat16"))
    if family == "llava-onevision":
        return _make_onevision(out, size, seed)
    if family == "llava":
        from transformers import LlavaForConditionalGeneration, LlavaProcessor

        tokenizer = build_tokenizer()
        config = build_config(size, tokenizer)
        model = LlavaForConditionalGeneration(config)
        image_processor = _clip_image_processor(IMAGE_SIZE)
        processor_cls = LlavaProcessor
    else:
        from transformers import LlavaNextForConditionalGeneration, LlavaNextProcessor

        tokenizer = build_sentencepiece_tokenizer(out)
        config = build_next_config(size, tokenizer)
        model = LlavaNextForConditionalGeneration(config)
        tile, pinpoints = NEXT_TILES[size]
        image_processor = _clip_image_processor(tile, pinpoints)
        processor_cls = LlavaNextProcessor
    model = model.to(torch.float32).eval()
    _reinit(model, seed)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
    )
    processor.save_pretrained(out)
    image_processor.save_pretrained(out)  # standalone preprocessor_config.json too
    return out


def _make_onevision(out: Path, size: str, seed: int) -> Path:
    """The "llava-onevision" branch of :func:`make_checkpoint`."""
    from transformers import LlavaOnevisionForConditionalGeneration

    tokenizer = build_qwen2_tokenizer()
    config = build_onevision_config(size, tokenizer)
    model = LlavaOnevisionForConditionalGeneration(config).to(torch.float32).eval()
    _reinit(model, seed, tied=config.tie_word_embeddings)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    _write_onevision_processor(out, size, config, tokenizer)
    return out


def _make_real(out: Path, size: str, seed: int, dtype: torch.dtype) -> Path:
    """The real-shape branch of :func:`make_checkpoint`: config, processor files and
    streamed weights, never the whole model in memory."""
    import transformers
    from transformers import GenerationConfig

    family = REAL_SIZES[size]
    if family == "llava-onevision":
        tokenizer = build_qwen2_tokenizer(real=size)
        config = build_onevision_config(size, tokenizer)
        _write_onevision_processor(out, size, config, tokenizer)
        cls = transformers.LlavaOnevisionForConditionalGeneration
    else:
        tokenizer = build_tokenizer(real=size)
        if family == "llava":
            config = build_config(size, tokenizer)
            image_processor = _clip_image_processor(IMAGE_SIZE)
            processor_cls = transformers.LlavaProcessor
            cls = transformers.LlavaForConditionalGeneration
        else:
            config = build_next_config(size, tokenizer)
            tile, pinpoints = NEXT_TILES[size]
            image_processor = _clip_image_processor(tile, pinpoints)
            processor_cls = transformers.LlavaNextProcessor
            cls = transformers.LlavaNextForConditionalGeneration
        processor = processor_cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=PATCH_SIZE,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
        )
        processor.save_pretrained(out)
        image_processor.save_pretrained(out)
    config.architectures = [cls.__name__]
    config.dtype = dtype
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    generation.do_sample = False
    generation.save_pretrained(out)
    write_weights_streamed(out, cls, config, seed, bool(config.tie_word_embeddings), dtype)
    return out


def _clip_image_processor(tile: int, pinpoints: list[list[int]] | None = None) -> object:
    """CLIP-normalising PIL image processor: LLaVA-1.5's, or NeXT's with ``pinpoints``."""
    kw = dict(
        size={"shortest_edge": tile},
        crop_size={"height": tile, "width": tile},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        do_convert_rgb=True,
    )
    if pinpoints is None:
        from transformers import CLIPImageProcessorPil

        return CLIPImageProcessorPil(**kw)
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    return LlavaNextImageProcessorPil(image_grid_pinpoints=pinpoints, do_pad=True, **kw)


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


def main_make_model(argv: list[str] | None = None) -> int:
    """CLI: ``make-model OUT_DIR [--size tiny|small] [--seed N]``; prints the param count."""
    parser = argparse.ArgumentParser(prog="make-model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=FAMILY_NAMES, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = parser.parse_args(argv)
    out = make_checkpoint(
        args.out_dir, size=args.size, seed=args.seed, family=args.family, dtype=args.dtype
    )
    print(f"wrote {args.size} checkpoint to {out} ({count_parameters(out):,} parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_make_model())
