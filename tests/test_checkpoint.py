"""Tests for mmserve.testing.checkpoints (the seeded checkpoint writer) and the families'
test checkpoint descriptions it writes (``ModelFamily.test_config``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor

from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model.families import FAMILIES, FAMILY_NAMES, family_for, family_named
from mmserve.model.families.llava import LlavaFamily
from mmserve.model.families.llava_onevision import LlavaOnevisionFamily
from mmserve.testing import checkpoints as mc
from tests.helpers import SAMPLES, run_python

PHOTOS = ("astronaut.png", "cat.png", "coffee.png", "rocket.jpg")
CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "And the colour?"},
]
RENDERED = "USER: <image>\nWhat is this? ASSISTANT: A cat.</s>USER: And the colour?"


@pytest.fixture(scope="module")
def tiny_dir(model_dir: Path) -> Path:
    """The session's tiny checkpoint (``make_checkpoint(..., "tiny", seed=0)``)."""
    return model_dir


@pytest.fixture(scope="module")
def model(ref_model) -> LlavaForConditionalGeneration:
    return ref_model[0]


@pytest.fixture(scope="module")
def processor(ref_model):
    return ref_model[1]


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_files_present(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    expected |= {"chat_template.jinja", "processor_config.json", "preprocessor_config.json"}
    assert expected <= names


def test_config_shape(model: LlavaForConditionalGeneration, processor) -> None:
    cfg = model.config
    tok = processor.tokenizer
    assert cfg.vision_config.image_size == 336 and cfg.vision_config.patch_size == 14
    assert cfg.vision_feature_layer == -2
    assert cfg.vision_feature_select_strategy == "default"
    assert cfg.projector_hidden_act == "gelu"
    assert not cfg.tie_word_embeddings
    text = cfg.text_config
    assert text.vocab_size == len(tok)
    assert text.head_dim == 64
    assert text.num_key_value_heads < text.num_attention_heads
    assert text.max_position_embeddings >= 8192
    assert text.rope_parameters["rope_theta"] == 10000.0
    assert cfg.image_token_index == tok.convert_tokens_to_ids("<image>")
    assert text.pad_token_id == tok.pad_token_id
    assert text.bos_token_id == tok.bos_token_id and text.eos_token_id == tok.eos_token_id
    assert not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)


def test_tokenizer(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert 1900 <= len(tok) <= 2100
    specials = LlavaFamily.test_config("tiny")["tokenizer"]["specials"]
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    assert ids == {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<image>": 4}
    assert tok("<image>", add_special_tokens=False).input_ids == [ids["<image>"]]
    text = "A grey cat sits on a red chair, doesn't it?\n  Ünïcödé 日本 ok."
    enc = tok(text).input_ids
    assert enc[0] == ids["<s>"] and enc.count(ids["<s>"]) == 1
    assert tok.decode(enc, skip_special_tokens=True) == text
    assert tok.chat_template == (mc.ASSETS_DIR / "chat_template.jinja").read_text(encoding="utf-8")


def test_processor_expands_image(processor) -> None:
    assert isinstance(processor, LlavaProcessor)
    image = Image.open(SAMPLES / "cat.png")
    out = processor(
        images=image, text="USER: <image>\nWhat is this? ASSISTANT:", return_tensors="pt"
    )
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert int((out["input_ids"] == image_id).sum()) == 576
    assert tuple(out["pixel_values"].shape) == (1, 3, 336, 336)


@pytest.mark.parametrize("source", ["tokenizer", "processor"])
def test_chat_template(processor, source: str) -> None:
    obj = processor if source == "processor" else processor.tokenizer
    render = obj.apply_chat_template
    assert render(CONVERSATION, tokenize=False, add_generation_prompt=True) == (
        RENDERED + " ASSISTANT:"
    )
    assert render(CONVERSATION, tokenize=False, add_generation_prompt=False) == RENDERED
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(system, tokenize=False, add_generation_prompt=True) == (
        "Be brief. USER: Hi ASSISTANT:"
    )


def test_another_seed_gives_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    # the same seed rebuilds byte for byte: tests/test_families.py
    other = mc.make_checkpoint(tmp_path / "seed1", size="tiny", seed=1)
    assert _digests(other)["model.safetensors"] != _digests(tiny_dir)["model.safetensors"]


def test_images_change_greedy_answers(model: LlavaForConditionalGeneration, processor) -> None:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answers = set()
    for name in PHOTOS:
        inputs = processor(images=Image.open(SAMPLES / name), text=prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=12)
        answers.add(tuple(out[0, inputs["input_ids"].shape[1] :].tolist()))
    assert len(answers) >= 3


def test_unknown_size_family_or_dtype() -> None:
    with pytest.raises(ValueError, match="unknown checkpoint size 'huge' for llava"):
        LlavaFamily.test_config("huge")
    with pytest.raises(ValueError, match="unknown checkpoint size 'huge'; expected one of tiny"):
        mc.make_checkpoint("/nonexistent", size="huge")
    with pytest.raises(ValueError, match="unknown family 'gpt'; expected one of llava, "):
        mc.make_checkpoint("/nonexistent", family="gpt")
    with pytest.raises(ValueError, match="unknown checkpoint dtype 'int8'"):
        mc.make_checkpoint("/nonexistent", dtype="int8")
    with pytest.raises(ValueError, match="size 'llava-1.5-7b' is a llava model, not llava-next"):
        mc.make_checkpoint("/nonexistent", size="llava-1.5-7b", family="llava-next")


def test_families_and_sizes_come_from_the_registry() -> None:
    names = ("llava", "llava-next", "llava-onevision", "llava-next-video")
    assert FAMILY_NAMES == mc.FAMILY_NAMES == names
    assert [family_named(n) for n in FAMILY_NAMES] == list(FAMILIES.values())
    real = {"llava-1.5-7b", "llava-next-7b", "onevision-0.5b", "llava-next-video-7b"}
    assert set(mc.SIZES) == {"tiny", "small", *real}
    # the default family of a size: llava for the shared sizes, the owner of a real shape
    assert mc.checkpoint_spec("tiny")["config"]["model_type"] == "llava"
    assert mc.checkpoint_spec("llava-next-7b")["config"]["model_type"] == "llava_next"


#: (family, size) -> parameters of the model its description builds: ranges for the test
#: sizes; for the real shapes the exact counts of these shapes, which round to the published
#: models' (llava-1.5-7b-hf and llava-v1.6-vicuna-7b-hf 7.06B, the second with its
#: image_newline, as LLaVA-NeXT-Video-7B-hf; llava-onevision-qwen2-0.5b-ov-hf 894M, the tied
#: head counted once)
PARAMETERS = {
    ("llava", "tiny"): (0.6e6, 1.2e6),
    ("llava", "small"): (20e6, 60e6),
    ("llava", "llava-1.5-7b"): (7_063_427_072, 7_063_427_072),
    ("llava-next", "tiny"): (0.6e6, 1.2e6),
    ("llava-next", "small"): (20e6, 60e6),
    ("llava-next", "llava-next-7b"): (7_063_427_072 + 4096, 7_063_427_072 + 4096),
    ("llava-onevision", "tiny"): (0.6e6, 1.2e6),
    ("llava-onevision", "small"): (20e6, 60e6),
    ("llava-onevision", "onevision-0.5b"): (893_618_208, 893_618_208),
    # LLaVA-NeXT's model: the average pooler has no weights
    ("llava-next-video", "tiny"): (0.6e6, 1.2e6),
    ("llava-next-video", "small"): (20e6, 60e6),
    ("llava-next-video", "llava-next-video-7b"): (7_063_427_072 + 4096, 7_063_427_072 + 4096),
}


def test_every_size_of_every_family_is_checked() -> None:
    assert set(PARAMETERS) == {(f.name, s) for f in FAMILIES.values() for s in f.test_sizes}


@pytest.mark.parametrize(("family", "size"), sorted(PARAMETERS))
def test_description_builds_a_model_of_its_family(family: str, size: str, tmp_path: Path) -> None:
    """Each description gives a config that the loader maps back to its family, whose
    special-token ids the trained tokenizer has (build_config checks them), and a model of
    the expected size (built on the meta device: shapes only)."""
    import transformers

    cls = family_named(family)
    spec = cls.test_config(size)
    assert spec == cls.test_config(size) and spec is not cls.test_config(size)
    tok = mc.build_tokenizer(spec["tokenizer"], tmp_path)
    config = mc.build_config(spec, tok)
    assert family_for(config.model_type) is cls
    assert config.text_config.vocab_size >= len(tok)
    assert spec["real"] == (size not in ("tiny", "small"))
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    low, high = PARAMETERS[family, size]
    assert low <= model.num_parameters() <= high


def test_a_tokenizer_that_disagrees_with_the_config_is_refused() -> None:
    spec = LlavaFamily.test_config("tiny")
    tok = mc.build_tokenizer(spec["tokenizer"])
    spec["tokenizer"]["specials"] = ["<s>", "<unk>", "</s>", "<pad>", "<image>"]
    with pytest.raises(ValueError, match="the tokenizer gives <s> id 1; the config expects 0"):
        mc.build_config(spec, tok)


def test_bfloat16_is_stored_for_a_test_size(tmp_path: Path, tiny_dir: Path) -> None:
    from safetensors.torch import load_file

    out = mc.make_checkpoint(tmp_path / "bf16", "tiny", dtype="bfloat16")
    got, want = load_file(out / "model.safetensors"), load_file(tiny_dir / "model.safetensors")
    assert set(got) == set(want)
    assert all(got[k].dtype == torch.bfloat16 for k in got)
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)


def test_engine_needs_a_model_path_or_a_model() -> None:
    with pytest.raises(ValueError, match="no model: set EngineConfig.model_path"):
        Engine(EngineConfig())


def test_ensure_model_uses_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path))
    target = mc.default_model_dir("tiny")
    assert target == tmp_path / "llava-tiny-seed0"
    assert mc.ensure_model("tiny") == target
    stamp = target / mc.STAMP_NAME
    assert stamp.read_text().strip() == mc.build_stamp("tiny")
    assert {k: v for k, v in _digests(target).items() if k != mc.STAMP_NAME} == _digests(tiny_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["llava-tiny-seed0"]  # no temp left over
    built = (target / "model.safetensors").stat().st_mtime_ns
    assert mc.ensure_model("tiny") == target  # second call is a cache hit
    assert (target / "model.safetensors").stat().st_mtime_ns == built


@pytest.mark.parametrize("stamp", [None, "0" * 64])
def test_ensure_model_rebuilds_a_cache_of_another_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path, stamp: str | None
) -> None:
    """A cached checkpoint from before stamps, or from a generator with another chat
    template, is replaced by one with today's template."""
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path))
    target = mc.default_model_dir("tiny")
    shutil.copytree(tiny_dir, target)
    (target / "chat_template.jinja").write_text("{{ 'an old template' }}")
    if stamp is not None:
        (target / mc.STAMP_NAME).write_text(stamp)
    assert mc.ensure_model("tiny") == target
    assert (target / "chat_template.jinja").read_bytes() == (
        tiny_dir / "chat_template.jinja"
    ).read_bytes()
    assert (target / mc.STAMP_NAME).read_text().strip() == mc.build_stamp("tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["llava-tiny-seed0"]


def test_streamed_weights_equal_save_pretrained(tiny_dir: Path, tmp_path: Path) -> None:
    """The real-shape writer (meta model, one tensor at a time, shards) draws exactly the
    values ``_reinit`` + ``save_pretrained`` store, under the same keys."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir)
    n = mc.write_weights_streamed(
        tmp_path, LlavaForConditionalGeneration, config, 0, False, torch.float32, 300_000
    )
    assert (tmp_path / "model.safetensors.index.json").is_file()
    got: dict = {}
    for shard in sorted(tmp_path.glob("*.safetensors")):
        got.update(load_file(shard))
    want = load_file(tiny_dir / "model.safetensors")
    assert set(got) == set(want) and n == mc.count_parameters(tiny_dir)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_onevision_05b_shapes_and_tokenizer() -> None:
    spec = LlavaOnevisionFamily.test_config("onevision-0.5b")
    tok = mc.build_tokenizer(spec["tokenizer"])
    assert len(tok) == 151648
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"])
    assert ids == [151643, 151644, 151645, 151646] and tok.eos_token_id == 151645
    assert tok.decode(tok("a photo of a cat").input_ids) == "a photo of a cat"
    cfg = mc.build_config(spec, tok)
    t, v = cfg.text_config, cfg.vision_config
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.intermediate_size) == (
        151936, 896, 24, 4864,
    )  # fmt: skip
    assert (t.num_attention_heads, t.num_key_value_heads, cfg.tie_word_embeddings) == (14, 2, True)
    assert (v.hidden_size, v.num_hidden_layers, v.image_size, v.intermediate_size) == (
        1152, 26, 384, 4304,
    )  # fmt: skip
    assert cfg.image_grid_pinpoints[-1] == [2304, 2304] and cfg.image_token_index == 151646
    with pytest.raises(ValueError, match="llava-onevision model"):
        mc.make_checkpoint("/nonexistent", size="onevision-0.5b", family="llava")


def test_make_model_choices_come_from_the_registry_when_used() -> None:
    """Building the parser (``mmserve --help``, ``mmserve serve``) does not import the family
    registry and transformers' model code; parsing make-model's arguments checks them
    against the registry's names and sizes."""
    code = (
        "import argparse, sys\n"
        "from mmserve.cli import add_make_model_parser\n"
        "p = argparse.ArgumentParser()\n"
        "add_make_model_parser(p.add_subparsers())\n"
        "loaded = {'mmserve.testing', 'mmserve.model.families'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
        "a = p.parse_args(['make-model', 'd', '--size', 'onevision-0.5b', '--family', "
        "'llava-onevision'])\n"
        "assert (a.size, a.family) == ('onevision-0.5b', 'llava-onevision'), a\n"
        "for bad in (['--family', 'gpt'], ['--size', 'huge']):\n"
        "    try:\n"
        "        p.parse_args(['make-model', 'd', *bad])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 2\n"
        "    else:\n"
        "        raise AssertionError(bad)\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    choices = "'llava', 'llava-next', 'llava-onevision', 'llava-next-video'"
    assert f"invalid choice: 'gpt' (choose from {choices})" in done.stderr


# ---- make-model's files: modes and progress ---------------------------------------------
@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_make_model_files_get_the_umask_mode_and_progress_is_printed(
    tmp_path: Path, capsys, mask: int, mode: int
) -> None:
    """Every file make-model writes has the mode ``open()`` gives under the umask (the
    safetensors weights were 0600 while the rest was 0644), and stderr shows the writing."""
    from mmserve.cli import main

    old = os.umask(mask)
    try:
        assert main(["make-model", str(tmp_path / "plain")]) == 0
        assert main(["make-model", str(tmp_path / "q"), "--quantization", "int8"]) == 0
    finally:
        os.umask(old)
    err = capsys.readouterr().err
    for d in (tmp_path / "plain", tmp_path / "q"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {mode}, modes
        assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temporaries left
    size = (tmp_path / "plain" / "model.safetensors").stat().st_size
    assert f"make-model: wrote model.safetensors ({size:,} bytes)" in err
    qsize = (tmp_path / "q" / "model.safetensors").stat().st_size
    assert f"make-model: wrote model.safetensors ({qsize:,} bytes)" in err
    assert re.search(
        r"make-model: writing model\.safetensors: [\d,]+ of [\d,]+ bytes \(100%\)", err
    )


def test_streamed_writes_log_progress_per_shard(tiny_dir: Path, tmp_path: Path, caplog) -> None:
    """The real-shape writer logs bytes and percent through each shard, at least every
    tenth of it, and the file's size when done; the files read back as written."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir)
    with caplog.at_level(logging.INFO, logger="mmserve.testing.weights"):
        mc.write_weights_streamed(
            tmp_path, LlavaForConditionalGeneration, config, 0, False, torch.float32, 1_500_000
        )
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 2
    text = [r.getMessage() for r in caplog.records]
    counts = []
    for shard in shards:
        pct = [
            int(m.group(1))
            for line in text
            if (m := re.match(rf"writing {shard.name}: [\d,]+ of [\d,]+ bytes \((\d+)%\)", line))
        ]
        assert pct[-1] == 100 and pct == sorted(pct), (shard.name, pct)
        counts.append(len(pct))
        assert f"wrote {shard.name} ({shard.stat().st_size:,} bytes)" in text
        assert stat.S_IMODE(shard.stat().st_mode) == 0o666 & ~_umask()
        assert load_file(shard)  # safetensors reads it
    assert max(counts) >= 5  # a shard of many tensors: a line every tenth or so


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_random_weights_mark_is_read_from_config_or_stamp(tmp_path: Path) -> None:
    from mmserve.testing.checkpoints import (
        RANDOM_WEIGHTS_KEY,
        STAMP_NAME,
        random_weights_checkpoint,
    )

    marked, stamped, other = (tmp_path / n for n in ("marked", "stamped", "other"))
    for d in (marked, stamped, other):
        d.mkdir()
    (marked / "config.json").write_text(json.dumps({RANDOM_WEIGHTS_KEY: True}))
    (stamped / "config.json").write_text("{}")
    (stamped / STAMP_NAME).write_text("x\n")
    (other / "config.json").write_text(json.dumps({RANDOM_WEIGHTS_KEY: "yes"}))
    assert random_weights_checkpoint(marked) and random_weights_checkpoint(stamped)
    assert not random_weights_checkpoint(other)
    assert not random_weights_checkpoint(tmp_path / "missing")
    assert not random_weights_checkpoint(None)
