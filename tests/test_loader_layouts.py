"""Checkpoint layouts written or read by the installed transformers load in mmserve.

A directory saved by transformers 5's ``save_pretrained`` (image processor nested in
``processor_config.json``, no ``preprocessor_config.json``) loads and answers greedily like
``LlavaForConditionalGeneration.generate``; sharded weights with an index load the same
weights; a SentencePiece ``tokenizer.model`` without ``tokenizer.json`` is accepted when
transformers can read it; every refusal is one line naming the directory and what is missing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration
from transformers.utils import is_protobuf_available

from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model.loader import CheckpointError, load_model
from mmserve.testing.checkpoints import checkpoint_spec, train_sentencepiece
from tests.helpers import check_against_reference, greedy, user

MAX_NEW = 8
SHARD_SIZE = "300KB"  # the tiny checkpoint is ~4 MB: several shards


@pytest.fixture(scope="module")
def saved(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoint re-saved by transformers: one file, and sharded with an index."""
    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    root = tmp_path_factory.mktemp("layouts")
    plain, sharded = root / "saved", root / "sharded"
    model.save_pretrained(plain)
    processor.save_pretrained(plain)
    model.save_pretrained(sharded, max_shard_size=SHARD_SIZE)
    processor.save_pretrained(sharded)
    return {"plain": plain, "sharded": sharded}


@pytest.fixture(scope="module")
def plain_engine(saved: dict[str, Path]) -> Engine:
    return Engine(EngineConfig(model_path=str(saved["plain"]), dtype="float32"))


@pytest.fixture(scope="module")
def plain_ref(saved: dict[str, Path]):
    """transformers' model and processor read back from the re-saved directory."""
    model = LlavaForConditionalGeneration.from_pretrained(saved["plain"]).eval()
    return model, AutoProcessor.from_pretrained(saved["plain"])


@pytest.fixture(scope="module")
def prompts(plain_engine: Engine, photos: dict[str, bytes]) -> dict[str, tuple[list, list]]:
    """name -> (messages, prepared images): a text prompt and an image prompt."""
    cat = plain_engine.processor.prepare_image(photos["cat.png"])
    return {
        "text": (user("Name three colours of a sunset."), []),
        "image": (user(None, "What animal is this?"), [cat]),
    }


def run(engine: Engine, messages: list, images: list):
    req = engine.processor.make_request(messages=messages, images=images, params=greedy(MAX_NEW))
    (res,) = engine.generate([req])
    return res


# ---- (a) transformers 5 save_pretrained layout -------------------------------------------


def test_saved_layout_has_no_preprocessor_config(saved: dict[str, Path]) -> None:
    for d in saved.values():
        assert (d / "processor_config.json").is_file()
        assert "image_processor" in json.loads((d / "processor_config.json").read_text())
        assert not (d / "preprocessor_config.json").exists()


@pytest.mark.parametrize("kind", ["text", "image"])
def test_saved_layout_greedy_equals_transformers(
    plain_engine: Engine, plain_ref, prompts, kind: str
) -> None:
    messages, images = prompts[kind]
    check_against_reference(plain_engine, plain_ref, messages, images, f"saved, {kind}", MAX_NEW)


# ---- (b) sharded weights with model.safetensors.index.json --------------------------------


def test_sharded_layout_loads_same_weights_and_answers(
    saved: dict[str, Path], plain_engine: Engine, prompts
) -> None:
    sharded = saved["sharded"]
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    engine = Engine(EngineConfig(model_path=str(sharded), dtype="float32"))
    for ours, plain in [
        (engine.model.decoder, plain_engine.model.decoder),
        (engine.model.vision, plain_engine.model.vision),
    ]:
        sa, sb = ours.state_dict(), plain.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for kind, (messages, images) in prompts.items():
        a, b = run(engine, messages, images), run(plain_engine, messages, images)
        assert a.output_ids == b.output_ids, kind


# ---- (c) SentencePiece tokenizer.model, no tokenizer.json ---------------------------------


def sentencepiece_dir(src: Path, dst: Path, vocab_size: int) -> Path:
    """Copy ``src`` with tokenizer.json replaced by a SentencePiece tokenizer.model whose ids
    match the checkpoint's: <unk> 0, <s> 1, </s> 2, <pad> 3, <image> 4, ``vocab_size`` in all."""
    shutil.copytree(src, dst)
    (dst / "tokenizer.json").unlink()
    specials = checkpoint_spec("tiny", "llava")["tokenizer"]["specials"]
    (dst / "tokenizer.model").write_bytes(train_sentencepiece(specials, vocab_size))
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "LlamaTokenizer"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst


def test_sentencepiece_tokenizer_model(saved: dict[str, Path], tmp_path: Path) -> None:
    vocab = json.loads((saved["plain"] / "config.json").read_text())["text_config"]["vocab_size"]
    d = sentencepiece_dir(saved["plain"], tmp_path / "spm", vocab)
    assert (d / "tokenizer.model").is_file() and not (d / "tokenizer.json").exists()
    if is_protobuf_available():
        # transformers converts tokenizer.model to a fast tokenizer: the loader accepts it.
        loaded = load_model(d)
        tok = loaded.tokenizer
        assert len(tok) == vocab
        assert tok.convert_tokens_to_ids(["<unk>", "<s>", "</s>", "<pad>", "<image>"]) == [
            0,
            1,
            2,
            3,
            4,
        ]
        assert loaded.image_token_id == 4
    else:
        # transformers 5 needs protobuf to read tokenizer.model: the loader says so.
        with pytest.raises(CheckpointError) as err:
            load_model(d)
        msg = str(err.value)
        assert str(d) in msg and "tokenizer.model" in msg and "protobuf" in msg, msg
        assert "\n" not in msg and "Traceback" not in msg


# ---- (d) refusals name the directory and what is missing ----------------------------------


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def no_config(d: Path) -> str:
    (d / "config.json").unlink()
    return "config.json is missing"


def qwen2_vl(d: Path) -> str:
    edit_json(d / "config.json", model_type="qwen2_vl")
    return "unsupported architecture 'qwen2_vl'"


def unknown_model_type(d: Path) -> str:
    edit_json(d / "config.json", model_type="mystery_vlm")
    return "unsupported architecture 'mystery_vlm'"


def garbage_config(d: Path) -> str:
    (d / "config.json").write_text("{not json")
    return "cannot read config.json"


def missing_shard(d: Path) -> str:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (d / victim).unlink()
    return f"weight shard {victim} is listed in model.safetensors.index.json but missing"


def no_tokenizer(d: Path) -> str:
    (d / "tokenizer.json").unlink()
    return "the tokenizer is missing (no tokenizer.json or tokenizer.model)"


def no_image_processor(d: Path) -> str:
    (d / "processor_config.json").unlink()
    return "the image processor config is missing (no preprocessor_config.json"


CASES = {
    f.__name__: f
    for f in (
        no_config,
        qwen2_vl,
        unknown_model_type,
        garbage_config,
        missing_shard,
        no_tokenizer,
        no_image_processor,
    )
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refusal_names_directory_and_missing_piece(
    saved: dict[str, Path], tmp_path: Path, case: str
) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(saved["sharded"], d)
    words = CASES[case](d)
    with pytest.raises(CheckpointError) as err:
        load_model(d)
    msg = str(err.value)
    assert str(d) in msg, msg
    assert words in msg, msg
    assert "\n" not in msg and "Traceback" not in msg and len(msg) < 400, msg
