"""The test checkpoints' tokenizers, trained at build time on ``assets/corpus.txt``.

A family's ``"tokenizer"`` description asks for a byte-level BPE (grown to a real
tokenizer's ids when padded) or a SentencePiece model laid out as Llama's; the chat
template comes from ``assets/``. Same corpus and library versions give the same
tokenizer. :mod:`mmserve.testing.checkpoints` writes them into a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
#: Trained vocabulary size (special tokens included) of the test tokenizers.
VOCAB_SIZE = 2000
#: Llama's first four ids, which a SentencePiece test tokenizer must start with.
SENTENCEPIECE_HEAD = ("<unk>", "<s>", "</s>", "<pad>")


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
