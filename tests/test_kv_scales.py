"""fp8 KV scales from a checkpoint: compressed-tensors ``kv_cache_scheme`` without quantized
weights (KV-only), weights-only and both; every documented scale-tensor naming found and
used by the pool's writes and the attention's reads; ``--kv-cache-dtype auto`` picking fp8
from a ``kv_cache_scheme``; and the start-up log naming where the scales come from
(tensor names, or 1.0 and why) and their range."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from mmserve.cache import kv_pool
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model import quant
from mmserve.model.kv_scales import NAMINGS, KVScales, find_kv_scales, kv_scale_plan
from mmserve.model.loader import load_model
from mmserve.model.weights import CheckpointError
from mmserve.testing.checkpoints import make_checkpoint
from tests.helpers import decoder_key_prefix, greedy, user

FP8 = torch.float8_e4m3fn
#: llm-compressor's KV-only calibration: dense weights, a kv_cache_scheme, no groups
KV_ONLY = {
    "quant_method": "compressed-tensors",
    "format": "dense",
    "quantization_status": "frozen",
    "config_groups": {},
    "kv_cache_scheme": {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    },
    "ignore": ["lm_head"],
}
ENGINE_LOG = "mmserve.engine.engine"


def _with(
    model_dir: Path,
    out: Path,
    tensors: dict[str, torch.Tensor] | None = None,
    quantization_config: dict | None = None,
) -> Path:
    """A copy of ``model_dir`` (weights linked) with ``tensors`` in one more safetensors
    file and config.json's ``quantization_config`` set (when given)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((model_dir / "config.json").read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg))
    if tensors:
        save_file(tensors, str(out / "kv-scales.safetensors"))
    return out


def _scales(pre: str, n: int, naming: str) -> tuple[dict, list[float], list[float]]:
    """Scale tensors of ``n`` layers in ``naming`` (a key of NAMINGS), and the k and v
    scales they stand for (distinct per layer)."""
    k = [0.5 + 0.25 * i for i in range(n)]
    v = [0.125 * (i + 1) for i in range(n)]
    if naming == "k_scale":
        t = {f"{pre}layers.{i}.self_attn.k_scale": torch.tensor(k[i]) for i in range(n)}
        t |= {f"{pre}layers.{i}.self_attn.v_scale": torch.tensor([v[i]]) for i in range(n)}
    elif naming == "kv_scale":
        t = {f"{pre}layers.{i}.self_attn.kv_scale": torch.tensor(k[i]) for i in range(n)}
        v = k
    else:
        t = {f"{pre}layers.{i}.self_attn.k_proj.k_scale": torch.tensor(k[i]) for i in range(n)}
        t |= {f"{pre}layers.{i}.self_attn.v_proj.v_scale": torch.tensor(v[i]) for i in range(n)}
    return t, k, v


def _spy_scales(monkeypatch: pytest.MonkeyPatch, eng: Engine) -> tuple[list, list]:
    """Record the scales each K/V write quantizes with (``quantize_kv``) and each layer's
    scales attention reads (``pool.scales``)."""
    writes: list[float] = []
    reads: list[tuple[int, float, float]] = []
    real_quantize, real_scales = kv_pool.quantize_kv, eng.pool.scales

    def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
        writes.append(scale)
        return real_quantize(x, scale)

    def scales(layer_id: int) -> tuple[float, float]:
        k, v = real_scales(layer_id)
        reads.append((layer_id, k, v))
        return k, v

    monkeypatch.setattr(kv_pool, "quantize_kv", quantize)
    monkeypatch.setattr(eng.pool, "scales", scales)
    return writes, reads


def _assert_used(eng: Engine, monkeypatch, k: list[float], v: list[float]) -> None:
    """The pool holds ``k``/``v``, and a request's K/V writes and attention use them."""
    assert eng.pool.dtype == FP8 and eng.pool.k_scales == k and eng.pool.v_scales == v
    writes, reads = _spy_scales(monkeypatch, eng)
    req = eng.processor.make_request(messages=user("Say something."), params=greedy(3))
    assert len(eng.generate([req])[0].output_ids) == 3
    assert set(writes) == set(k) | set(v)
    assert {(i, k[i], v[i]) for i in range(len(k))} == set(reads)


def _engine_log(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == ENGINE_LOG)


# ---- KV-only, weights-only, both ---------------------------------------------------------
def test_kv_only_checkpoint_loads_and_auto_serves_fp8_with_its_scales(
    model_dir, tmp_path: Path, caplog, monkeypatch
) -> None:
    pre = decoder_key_prefix(model_dir)
    n = 2  # the tiny decoder's layers
    tensors, k, v = _scales(pre, n, "k_scale")
    ckpt = _with(model_dir, tmp_path / "kv", tensors, KV_ONLY)
    model = load_model(ckpt)  # refused before: "format 'dense' is not supported"
    assert model.quantization == "none" and model.decoder.shape.num_layers == n
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        eng = Engine(EngineConfig(model_path=str(ckpt), page_size=4), model=model)
    _assert_used(eng, monkeypatch, k, v)
    text = _engine_log(caplog)
    assert "KV scales: --kv-cache-dtype auto: the checkpoint's kv_cache_scheme is fp8" in text
    assert f"2 x {pre}layers.N.self_attn.k_scale, 2 x {pre}layers.N.self_attn.v_scale" in text
    assert "range k_scale min 0.5 max 0.75, v_scale min 0.125 max 0.25" in text
    assert eng.describe()["kv_dtype"] == "fp8_e4m3"
    assert "k_scale min 0.5 max 0.75" in eng.describe()["kv_scales"]
    # the explicit flag: the same pool
    fp8 = Engine(EngineConfig(model_path=str(ckpt), kv_cache_dtype="fp8_e4m3"), model=model)
    assert fp8.pool.k_scales == k and fp8.pool.v_scales == v


def test_weights_only_checkpoint_keeps_auto_kv_and_fp8_says_why_scales_are_1(
    tmp_path: Path, caplog
) -> None:
    path = make_checkpoint(tmp_path / "w8", "tiny", quantization="int8")
    model = load_model(path)
    assert model.quantization == "int8"
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        auto = Engine(EngineConfig(model_path=str(path)), model=model)
        fp8 = Engine(EngineConfig(model_path=str(path), kv_cache_dtype="fp8_e4m3"), model=model)
    assert auto.pool.dtype != FP8 and fp8.pool.dtype == FP8
    assert fp8.pool.k_scales == [1.0, 1.0] and fp8.pool.v_scales == [1.0, 1.0]
    text = _engine_log(caplog)
    assert "KV scales: none (K/V in the model's dtype)" in text
    assert (
        "KV scales: --kv-cache-dtype fp8_e4m3; scales 1.0 defaults for every layer: the "
        "checkpoint has no KV scale tensors (layers.N.self_attn.k_scale/v_scale, "
        "self_attn.kv_scale, k_proj.k_scale/v_proj.v_scale); range k_scale min 1 max 1, "
        "v_scale min 1 max 1"
    ) in text


def test_quantized_weights_and_kv_scheme_both_served(tmp_path: Path, caplog, monkeypatch) -> None:
    w8 = make_checkpoint(tmp_path / "w8", "tiny", quantization="int8")
    qc = json.loads((w8 / "config.json").read_text())["quantization_config"]
    qc["kv_cache_scheme"] = KV_ONLY["kv_cache_scheme"]
    pre = decoder_key_prefix(w8)
    tensors, k, v = _scales(pre, 2, "k_scale")
    ckpt = _with(w8, tmp_path / "both", tensors, qc)
    model = load_model(ckpt)
    assert model.quantization == "int8"
    assert model.decoder.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        eng = Engine(EngineConfig(model_path=str(ckpt)), model=model)
    _assert_used(eng, monkeypatch, k, v)
    text = _engine_log(caplog)
    assert "the checkpoint's compressed-tensors int8 weights" in text
    assert "kv_cache_scheme is fp8" in text and "k_scale min 0.5 max 0.75" in text


# ---- each documented naming --------------------------------------------------------------
@pytest.mark.parametrize("naming", list(NAMINGS))
def test_each_documented_naming_is_found_and_used(
    model_dir, loaded, tmp_path: Path, caplog, monkeypatch, naming: str
) -> None:
    pre = decoder_key_prefix(model_dir)
    tensors, k, v = _scales(pre, 2, naming)
    ckpt = _with(model_dir, tmp_path / naming, tensors)
    found = find_kv_scales(ckpt, 2)
    assert found is not None and (found.k, found.v) == (k, v)
    assert found.namings == [naming] and set(found.keys) == set(tensors)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        eng = Engine(
            EngineConfig(model_path=str(ckpt), kv_cache_dtype="fp8_e4m3", page_size=4),
            model=loaded,
        )
    _assert_used(eng, monkeypatch, k, v)
    text = _engine_log(caplog)
    assert NAMINGS[naming] in text
    assert f"{NAMINGS[naming]}): {', '.join(found.keys)}; range" in text  # every name
    for key in tensors:
        pattern = key.replace("layers.0.", "layers.N.").replace("layers.1.", "layers.N.")
        assert f"2 x {pattern}" in text
    assert f"k_scale min {min(k):g} max {max(k):g}, v_scale min {min(v):g} max {max(v):g}" in text


def test_scales_in_the_transformers5_layout_are_found(model_dir, tmp_path: Path) -> None:
    n = 2
    tensors = {
        f"model.language_model.layers.{i}.self_attn.k_scale": torch.tensor(2.0) for i in range(n)
    }
    tensors |= {
        f"model.language_model.layers.{i}.self_attn.v_scale": torch.tensor(3.0) for i in range(n)
    }
    tensors["model.vision_tower.layers.0.self_attn.k_scale"] = torch.tensor(9.0)  # not ours
    found = find_kv_scales(_with(model_dir, tmp_path / "t5", tensors), n)
    assert found is not None and (found.k, found.v) == ([2.0, 2.0], [3.0, 3.0])
    assert "vision" not in " ".join(found.keys)
    # many layers: the patterns, then the first and last layer's names
    many = KVScales(
        [1.0] * 24,
        [2.0] * 24,
        [f"m.layers.{i}.self_attn.{w}_scale" for i in range(24) for w in "kv"],
        ["k_scale"],
    )
    assert many.describe().startswith(
        "read from the checkpoint: 24 x m.layers.N.self_attn.k_scale, 24 x "
        "m.layers.N.self_attn.v_scale (self_attn.k_scale / self_attn.v_scale (compressed-tensors "
        "kv_cache_scheme, vLLM)): m.layers.0.self_attn.k_scale, m.layers.0.self_attn.v_scale, "
        "..., m.layers.23.self_attn.k_scale, m.layers.23.self_attn.v_scale; range k_scale min 1 "
        "max 1, v_scale min 2 max 2"
    )


# ---- the log when scales are not what they seem -------------------------------------------
def test_scales_ignored_by_auto_kv_are_said_to_be_unused(
    model_dir, loaded, tmp_path, caplog
) -> None:
    tensors, _, _ = _scales(decoder_key_prefix(model_dir), 2, "kv_scale")
    ckpt = _with(model_dir, tmp_path / "unused", tensors)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        eng = Engine(EngineConfig(model_path=str(ckpt)), model=loaded)
    assert eng.pool.dtype != FP8
    assert "KV scales: not used: the checkpoint has KV scales (2 x " in _engine_log(caplog)
    assert "--kv-cache-dtype auto keeps K/V in the model's dtype" in _engine_log(caplog)


def test_a_kv_scheme_without_scale_tensors_warns_and_uses_1(model_dir, tmp_path, caplog) -> None:
    ckpt = _with(model_dir, tmp_path / "noscales", None, KV_ONLY)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        eng = Engine(EngineConfig(model_path=str(ckpt)), model=load_model(ckpt))
    assert eng.pool.dtype == FP8 and eng.pool.k_scales == [1.0, 1.0]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == ENGINE_LOG]
    assert len(warned) == 1
    assert (
        "scales 1.0 defaults for every layer: the checkpoint's kv_cache_scheme declares "
        "static fp8 scales, but none of its tensors is named" in warned[0].getMessage()
    )


def test_auto_keeps_the_model_dtype_where_fp8_kv_cannot_run() -> None:
    plan = kv_scale_plan(
        "auto", None, 2, KV_ONLY["kv_cache_scheme"], "fp8 KV is not supported with --tp > 1 yet"
    )
    assert not plan.fp8 and plan.level == logging.WARNING
    assert (
        "kv_cache_scheme asks for fp8 K/V, but fp8 KV is not supported with --tp > 1" in plan.source
    )
    plan = kv_scale_plan("fp8", None, 3, None)
    assert plan.fp8 and plan.scales is None
    assert "1.0 defaults for every layer: the model was given in-process" in plan.source


# ---- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "found"),
    [
        ({"num_bits": 4, "type": "int"}, "4-bit int"),
        ({"strategy": "attn_head"}, "strategy 'attn_head'"),
        ({"dynamic": True}, "dynamic True"),
    ],
)
def test_a_kv_scheme_that_cannot_be_served_is_refused(
    model_dir, tmp_path, change: dict, found: str
) -> None:
    qc = json.loads(json.dumps(KV_ONLY))
    qc["kv_cache_scheme"] |= change
    ckpt = _with(model_dir, tmp_path / "bad", None, qc)
    with pytest.raises(quant.QuantizationError, match=f"kv_cache_scheme .*{found}.*8-bit float"):
        load_model(ckpt)


def test_kv_only_groups_that_quantize_nothing_are_refused() -> None:
    qc = json.loads(json.dumps(KV_ONLY))
    qc["config_groups"] = {"group_0": {"targets": ["Linear"], "input_activations": {"num_bits": 8}}}
    with pytest.raises(quant.QuantizationError, match="quantize no weights"):
        quant.checkpoint_method(qc)
    assert quant.checkpoint_method(KV_ONLY) == "none"
    assert quant.checkpoint_method(KV_ONLY | {"format": None}) == "none"


def test_unreadable_scales_do_not_stop_a_model_served_without_fp8(
    model_dir, loaded, tmp_path, caplog
) -> None:
    pre = decoder_key_prefix(model_dir)
    per_head = {f"{pre}layers.{i}.self_attn.k_scale": torch.ones(4) for i in range(2)}
    ckpt = _with(model_dir, tmp_path / "heads", per_head)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        eng = Engine(EngineConfig(model_path=str(ckpt)), model=loaded)
    assert eng.pool.dtype != FP8
    assert "not used (K/V in the model's dtype), and unreadable: " in _engine_log(caplog)
    assert "per-head KV scales are not supported" in _engine_log(caplog)
    with pytest.raises(CheckpointError, match="per-head KV scales are not supported"):
        Engine(EngineConfig(model_path=str(ckpt), kv_cache_dtype="fp8"), model=loaded)
