"""Loading with ``--quantization int8``: the start-up log names the quantization, the
weight bytes and the untied LM head (exact values); quantizing slice by slice while
loading gives the whole-matrix result; and loading int8 peaks at most where bf16 does."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model import loader, quant
from mmserve.model.loader import load_model
from tests.helpers import load_peak_rss

ENGINE_LOG = "mmserve.engine.engine"


def _bytes_by_dtype(model) -> dict[str, int]:
    """Bytes of the model's distinct tensors (decoder + vision) per dtype name."""
    seen: dict[int, torch.Tensor] = {}
    for m in (model.decoder, model.vision):
        for t in [*m.parameters(), *m.buffers()]:
            seen[id(t)] = t
    out: dict[str, int] = {}
    for t in seen.values():
        name = str(t.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out


def test_int8_log_names_the_quantization_weight_bytes_and_untied_head(families, caplog) -> None:
    fam = families["llava-onevision"]  # a tied checkpoint, as OneVision-0.5B
    assert json.loads((fam.model_dir / "config.json").read_text())["tie_word_embeddings"]
    model = load_model(fam.model_dir, dtype=torch.bfloat16, quantization="int8")
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        eng = Engine(EngineConfig(model_path=str(fam.model_dir), dtype="bfloat16"), model=model)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    assert len(lines) == 1
    line = lines[0]
    shape = model.decoder.shape
    head = shape.vocab_size * shape.hidden_size
    by = _bytes_by_dtype(model)
    total = sum(by.values())
    # the int8 bytes are the decoder's linears and the head's copy, nothing else
    linear = sum(
        m.weight.numel() for m in model.decoder.modules() if isinstance(m, quant.QuantizedLinear)
    )
    assert by["int8"] == linear and head < linear
    assert line.startswith(
        "weights: quantization int8 (--quantization int8, quantized at load; per output channel)"
        f"; weight bytes {total:,} = {total / 1e6:,.1f} MB ("
    )
    for dtype, n in by.items():
        assert f"{dtype} {n:,}" in line
    assert line.endswith(
        "; LM head untied: the checkpoint ties it to the token embedding, and quantizing made "
        f"a separate int8 copy ({head:,} parameters, {head + 4 * shape.vocab_size:,} bytes)"
    )
    d = eng.describe()
    assert d["quantization"] == "int8" and d["weight_bytes"] == total
    # the unquantized model: tied, and no quantization
    plain = Engine(EngineConfig(model_path=str(fam.model_dir)), model=fam.loaded).describe()
    assert plain["weights"].startswith("quantization none; weight bytes ")
    assert plain["weights"].endswith("; LM head tied to the token embedding (float32)")


def test_startup_summary_carries_the_weights_and_kv_scales(families) -> None:
    from api.cli import LaunchSettings
    from api.settings import ServerSettings
    from api.startup import startup_summary

    fam = families["llava"]
    model = load_model(fam.model_dir, quantization="int8")
    eng = Engine(EngineConfig(model_path=str(fam.model_dir), kv_cache_dtype="fp8"), model=model)
    first, pool, *_ = startup_summary(eng, LaunchSettings(port=8123), ServerSettings())
    assert "; weights: quantization int8 (--quantization int8, quantized at load" in first
    assert "LM head untied (int8, " in first
    assert "; KV scales: --kv-cache-dtype fp8; scales 1.0 defaults for every layer" in pool


def test_slices_quantize_as_the_whole_matrix(families, monkeypatch) -> None:
    fam = families["llava"]
    whole = load_model(fam.model_dir, quantization="int8")
    monkeypatch.setattr(loader, "QUANTIZE_CHUNK_BYTES", 3 * 4 * 128)  # 3 rows at a time
    sliced = load_model(fam.model_dir, quantization="int8")
    for name, m in whole.decoder.named_modules():
        if isinstance(m, quant.QuantizedLinear):
            other = sliced.decoder.get_submodule(name)
            assert torch.equal(m.weight, other.weight), name
            assert torch.equal(m.weight_scale, other.weight_scale), name
    # and as quant.quantize_per_channel of the fused fp32 matrix
    w = torch.cat(
        [fam.ref[0].model.language_model.layers[0].mlp.gate_proj.weight,
         fam.ref[0].model.language_model.layers[0].mlp.up_proj.weight]
    )  # fmt: skip
    q, sc = quant.quantize_per_channel(w, "int8")
    gate_up = sliced.decoder.layers[0].mlp.gate_up_proj
    assert torch.equal(gate_up.weight, q) and torch.equal(gate_up.weight_scale, sc)


def _big_head_checkpoint(model_dir: Path, out: Path, vocab: int) -> Path:
    """The tiny checkpoint with a ``vocab``-row embedding and LM head (fp32, untied), so
    that one matrix dominates the model, as OneVision-0.5B's 151,646 x 896 head."""
    import transformers
    from transformers import AutoConfig

    from mmserve.testing.weights import write_weights_streamed

    out.mkdir()
    for f in model_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(cfg))
    config = AutoConfig.from_pretrained(out)
    model_cls = getattr(transformers, config.architectures[0])
    write_weights_streamed(out, model_cls, config, 0, False, torch.float32)
    return out


def test_int8_load_peaks_at_most_where_bf16_does(model_dir, tmp_path: Path) -> None:
    """Peak resident memory while loading (each load in a fresh interpreter), bf16 against
    int8, on a checkpoint whose 131,072 x 128 fp32 head and embedding (67 MB each) dwarf
    the rest: quantizing whole fp32 matrices (read, abs, divide, round) peaked 4x the head
    above bf16."""
    ckpt = _big_head_checkpoint(model_dir, tmp_path / "big", 131072)
    bf16 = load_peak_rss(ckpt, "none")
    int8 = load_peak_rss(ckpt, "int8")
    head_bf16 = 131072 * 128 * 2
    assert bf16["delta"] > 2 * head_bf16  # the measure sees the model (embedding + head)
    assert int8["delta"] <= bf16["delta"] * 1.05, (int8, bf16)


def test_quantize_rows_into_equals_quantize_per_channel() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 48, generator=gen) * torch.logspace(-3, 2, 37)[:, None]
    w[5] = 0.0  # an all-zero row: scale 1
    for method in ("int8", "fp8"):
        for dtype in (torch.float32, torch.bfloat16):
            x = w.to(dtype)
            want_q, want_s = quant.quantize_per_channel(x, method)
            q = torch.empty_like(want_q)
            s = torch.empty(37)
            quant.quantize_rows_into(x.clone(), method, q, s)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (method, dtype)
            assert torch.equal(s, want_s), (method, dtype)
