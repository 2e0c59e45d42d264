"""Checkpoint loading: clear errors naming what is missing; both weight-name layouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve.model.loader import CheckpointError, load_model


@pytest.fixture()
def copy_dir(model_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(model_dir, dst)
    return dst


@pytest.mark.parametrize(
    "names, words",
    [
        (["config.json"], "config.json is missing"),
        (["tokenizer.json"], "tokenizer is missing \\(no tokenizer.json or tokenizer.model\\)"),
        (
            ["preprocessor_config.json", "processor_config.json"],
            "image processor config is missing \\(no preprocessor_config.json",
        ),
        (["model.safetensors"], "no \\*.safetensors weights"),
    ],
)
def test_missing_file_is_named(copy_dir: Path, names: list[str], words: str) -> None:
    for name in names:
        (copy_dir / name).unlink()
    with pytest.raises(CheckpointError, match=words):
        load_model(copy_dir)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_unsupported_architecture(copy_dir: Path) -> None:
    cfg = json.loads((copy_dir / "config.json").read_text())
    cfg["model_type"] = "qwen2_vl"
    (copy_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture 'qwen2_vl'"):
        load_model(copy_dir)


def test_missing_tensor_is_named(copy_dir: Path) -> None:
    w = load_file(str(copy_dir / "model.safetensors"))
    victim = next(k for k in w if k.endswith("layers.1.mlp.up_proj.weight"))
    del w[victim]
    save_file(w, str(copy_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_model(copy_dir)


def release_name(k: str) -> str:
    """llava-hf release layout: CLIP weights under ``vision_tower.vision_model.``."""
    if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + k.removeprefix("vision_tower.")
    return k


def in_memory_name(k: str) -> str:
    """transformers 5 module names: ``model.language_model.*``, ``lm_head.weight``."""
    if k == "language_model.lm_head.weight":
        return "lm_head.weight"
    if k.startswith("language_model.model."):
        return "model.language_model." + k.removeprefix("language_model.model.")
    return "model." + k


@pytest.mark.parametrize("rename", [release_name, in_memory_name])
def test_both_name_layouts_load_the_same_weights(copy_dir: Path, loaded, rename) -> None:
    w = load_file(str(copy_dir / "model.safetensors"))
    renamed = {rename(k): t for k, t in w.items()}
    assert renamed.keys() != w.keys()
    save_file(renamed, str(copy_dir / "model.safetensors"))
    other = load_model(copy_dir)
    for a, b in [(other.decoder, loaded.decoder), (other.vision, loaded.vision)]:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_truncated_weights_are_a_checkpoint_error(copy_dir: Path) -> None:
    f = copy_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated|bytes"):
        load_model(copy_dir)
    f.write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_model(copy_dir)


def test_loaded_weights_equal_the_file_and_own_their_memory(copy_dir: Path) -> None:
    """Each tensor is read into memory of its own (no file mapping): rewriting the file
    afterwards changes nothing, and bf16 loading casts what the file holds."""
    # (safetensors' load_file maps the file: a rewrite would pull its pages away)
    want = {k: v.clone() for k, v in load_file(copy_dir / "model.safetensors").items()}
    model = load_model(copy_dir, dtype=torch.bfloat16)
    (copy_dir / "model.safetensors").write_bytes(b"")
    got = model.decoder.layers[0].self_attn.qkv_proj.weight
    pre = "language_model.model.layers.0.self_attn."
    ref = torch.cat([want[f"{pre}{p}_proj.weight"] for p in "qkv"])  # fused: q, k, v rows
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref.to(torch.bfloat16))
    got = model.decoder.layers[0].mlp.gate_up_proj.weight
    pre = "language_model.model.layers.0.mlp."
    ref = torch.cat([want[f"{pre}{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(got, ref.to(torch.bfloat16))
    assert torch.equal(
        model.decoder.embed_tokens.weight,
        want["language_model.model.embed_tokens.weight"].to(torch.bfloat16),
    )
