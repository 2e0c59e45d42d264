"""Weight quantization (``--quantization int8|fp8``, compressed-tensors checkpoints):
each quantized linear against its dequantized weight, greedy tokens against transformers
run on the dequantized weights for every family, refusals, cache on = off.

Tolerances (stated once): a quantized linear equals ``x @ dequantized^T`` within 1e-5 of
the output's scale in fp32 (one matmul against another) and 2**-6 in bf16 (the output's
rounding plus the kernel's bf16 scales); the fp8 W8A8 path also quantizes activations per
token, which moves each output by at most ``2**-4 * (|x| @ |W|^T)`` (e4m3's half ulp).
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.config import EngineConfig
from mmserve.engine.scheduler import make_kv_tiers
from mmserve.frontend.frontend import Engine
from mmserve.model import quant
from mmserve.model.loader import load_model
from mmserve.testing.checkpoints import make_checkpoint
from tests.helpers import (
    TINY_FAMILIES,
    assert_same_generation,
    check_against_reference,
    greedy,
    run_workload,
    tp_engine,
    user,
    workload,
)

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- one linear --------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_error_is_half_a_step_per_channel(method: str) -> None:
    @SETTINGS
    @given(st.integers(1, 64), st.integers(1, 300), st.floats(1e-3, 1e3), st.integers(0, 2**31))
    def check(out: int, inp: int, mag: float, seed: int) -> None:
        w = torch.randn(out, inp, generator=_gen(seed)) * mag
        w[0] = 0.0  # an all-zero row gets scale 1, not a division by zero
        q, s = quant.quantize_per_channel(w, method)
        assert q.dtype == quant.STORAGE[method] and s.dtype == torch.float32 and s.shape == (out,)
        err = (quant.dequantize(q, s) - w).abs()
        if method == "int8":
            assert (q.float().abs() <= 127).all()
            assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()
        else:  # e4m3: 3 mantissa bits (relative half-ulp 2**-4), subnormal step 2**-9
            bound = torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10) * (1 + 1e-6)
            assert (err <= bound).all()
        assert torch.equal(quant.dequantize(q, s)[0], torch.zeros(inp))

    check()


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_linear_equals_its_dequantized_matmul(method: str, dtype) -> None:
    """Every kernel choice (int8: the CPU int8 kernel at <= 4 bf16 rows, the dequantized
    matmul above; fp8: the upcast matmul) against ``x @ (q * s)^T + b`` in fp32."""

    @SETTINGS
    @given(
        st.integers(1, 12),
        st.sampled_from([16, 40, 64, 96, 256]),  # 40: not the CPU int8 kernel's multiple
        st.sampled_from([32, 128, 200]),
        st.booleans(),
        st.integers(0, 2**31),
    )
    def check(rows: int, inp: int, out: int, bias: bool, seed: int) -> None:
        g = _gen(seed)
        w = torch.randn(out, inp, generator=g) / inp**0.5
        q, s = quant.quantize_per_channel(w, method)
        b = torch.randn(out, generator=g).to(dtype) if bias else None
        lin = quant.QuantizedLinear(q, s, b)
        x = torch.randn(rows, inp, generator=g).to(dtype)
        y = lin(x)
        assert y.shape == (rows, out) and y.dtype == dtype
        ref = torch.nn.functional.linear(x.float(), quant.dequantize(q, s))
        ref = ref if b is None else ref + b.float()
        scale = ref.abs().max().clamp(min=1.0)
        assert (y.float() - ref).abs().max() <= REL_TOL[dtype] * scale

    check()


def test_fp8_w8a8_twin_is_within_activation_rounding_of_the_dequantized_matmul() -> None:
    """The CPU twin of the CUDA fp8 path (``_scaled_mm`` on per-token e4m3 activations)."""

    @SETTINGS
    @given(st.integers(1, 9), st.sampled_from([16, 64, 128]), st.integers(0, 2**31))
    def check(rows: int, inp: int, seed: int) -> None:
        g = _gen(seed)
        w = torch.randn(48, inp, generator=g)
        q, s = quant.quantize_per_channel(w, "fp8")
        x = torch.randn(rows, inp, generator=g) * 3
        deq = quant.dequantize(q, s)
        y = quant.fp8_w8a8_ref(x, q, s)
        bound = 2**-4 * (x.abs() @ deq.abs().T) + 1e-5
        assert ((y - x @ deq.T).abs() <= bound).all()

    check()


def test_module_to_dtype_keeps_the_stored_weight_and_scales() -> None:
    q, s = quant.quantize_per_channel(torch.randn(8, 16), "fp8")
    lin = quant.QuantizedLinear(q, s, torch.zeros(8)).to(dtype=torch.bfloat16)
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale.dtype == torch.float32
    assert lin.bias.dtype == torch.bfloat16
    assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8))


# ---- whole models against transformers on the dequantized weights ------------------------
def _dequantized_reference(ref, method: str, head: bool):
    """A copy of transformers' ``(model, processor)`` whose decoder projections (and LM
    head when ``head``: untied from the embedding, as ours) are ``dequantize(quantize(w))``."""
    model, processor = ref
    model = copy.deepcopy(model)
    lm = model.model.language_model
    for name, mod in lm.named_modules():
        if name.rsplit(".", 1)[-1] in PROJ:
            mod.weight.data = quant.dequantize(*quant.quantize_per_channel(mod.weight, method))
    if head:
        w = quant.dequantize(*quant.quantize_per_channel(model.lm_head.weight, method))
        model.lm_head.weight = torch.nn.Parameter(w, requires_grad=False)
    return model.eval(), processor


@pytest.fixture(scope="module")
def int8_models(families):
    """family -> our model loaded with ``quantization="int8"`` (fp32 activations)."""
    return {f: load_model(families[f].model_dir, quantization="int8") for f in TINY_FAMILIES}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_int8_greedy_equals_transformers_on_dequantized_weights(
    families, int8_models, photos, family: str
) -> None:
    fam = families[family]
    model = int8_models[family]
    assert model.quantization == "int8"
    assert isinstance(model.decoder.layers[0].mlp.gate_up_proj, quant.QuantizedLinear)
    assert isinstance(model.decoder.lm_head, quant.QuantizedLinear)
    assert not isinstance(model.decoder.embed_tokens.weight, quant.QuantizedLinear)
    ref = _dequantized_reference(fam.ref, "int8", head=True)
    eng = Engine(EngineConfig(model_path=str(fam.model_dir)), model=model)
    img = eng.processor.prepare_image(photos["coffee.png"])
    check_against_reference(eng, ref, user(None, "What is in the cup?"), [img], "int8")
    check_against_reference(eng, ref, user("Name three colours."), [], "int8 text")


@pytest.mark.parametrize(("family", "method"), [("llava", "int8"), ("llava-onevision", "fp8")])
def test_compressed_tensors_checkpoint_loads_and_serves(
    families, photos, tmp_path, family: str, method: str
) -> None:
    """``make-model --quantization`` writes the layout; loading it serves the stored 8-bit
    weights (the LM head, which the recipe ignores, unquantized). fp8 runs the upcast twin
    on the CPU, where the engine refuses it: the decoder is checked directly."""
    fam = families[family]
    path = make_checkpoint(tmp_path / "q", "tiny", family=family, quantization=method)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    model = load_model(path)
    assert model.quantization == method
    attn = model.decoder.layers[1].self_attn
    assert attn.qkv_proj.weight.dtype == quant.STORAGE[method]
    assert not isinstance(model.decoder.lm_head, quant.QuantizedLinear)
    ref = _dequantized_reference(fam.ref, method, head=False)
    if method == "int8":
        eng = Engine(EngineConfig(model_path=str(path)), model=model)
        img = eng.processor.prepare_image(photos["cat.png"])
        check_against_reference(eng, ref, user(None, "Describe it."), [img], "compressed int8")
    else:
        with pytest.raises(quant.QuantizationError, match="int8"):
            Engine(EngineConfig(model_path=str(path)), model=model)
        # same weights as transformers' dequantized copy: logits of a prompt agree
        lm = ref[0].model.language_model
        ids = torch.tensor([[5, 17, 99, 3, 250]])
        want = ref[0].lm_head(lm(input_ids=ids).last_hidden_state)[0, -1]
        ours = _dense_logits(model.decoder, ids[0])
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def _dense_logits(decoder, ids: torch.Tensor) -> torch.Tensor:
    """Last-position logits of ``ids`` through our decoder (torch backend, a fresh pool)."""
    from mmserve.cache.kv_pool import KVPool
    from mmserve.kernels.metadata import build_metadata
    from mmserve.kernels.torch_backend import TorchAttentionBackend

    s = decoder.shape
    pool = KVPool(len(ids), 1, s.num_layers, s.num_kv_heads, s.head_dim, torch.float32, "cpu")
    backend = TorchAttentionBackend()
    backend.plan(build_metadata([list(range(len(ids)))], [0], [len(ids)], 1, "cpu"))
    embeds = decoder.embed_tokens(ids)
    rows = torch.tensor([len(ids) - 1])
    return decoder(embeds, torch.arange(len(ids)), backend, pool, rows)[0]


# ---- refusals ------------------------------------------------------------------------------
def test_refusals_name_the_flag_and_the_alternative(families, tmp_path) -> None:
    with pytest.raises(quant.QuantizationError, match=r"--quantization fp8.*--quantization int8"):
        quant.check_quantization("fp8", "cpu")
    with pytest.raises(ValueError, match="unknown quantization 'int3'.*none, int8, int4, fp8"):
        EngineConfig(quantization="int3").validate()
    # a checkpoint quantized another way: the method and what is supported
    d = tmp_path / "hqq"
    shutil.copytree(families["llava"].model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "hqq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(quant.QuantizationError, match=r"'hqq'.*compressed-tensors.*int8, int4"):
        load_model(d)
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "marlin-24",
        "config_groups": {},
    }
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(quant.QuantizationError, match="'marlin-24' is not supported"):
        load_model(d)
    q8 = make_checkpoint(tmp_path / "q8", "tiny", quantization="int8")
    with pytest.raises(
        quant.QuantizationError, match="conflicts.*already int8.*--quantization int8"
    ):
        load_model(q8, quantization="fp8")
    with pytest.raises(quant.QuantizationError, match="--quantization fp8.*int8"):
        Engine(EngineConfig(model_path=str(q8), quantization="fp8"))


# ---- cache on = off, and the tiers' namespace ------------------------------------------------
def test_cache_on_equals_off_with_int8(families, int8_models, photos) -> None:
    fam = families["llava-onevision"]
    model = int8_models["llava-onevision"]

    def make(**kw) -> Engine:
        return Engine(EngineConfig(model_path=str(fam.model_dir), **kw), model=model)

    eng0 = make()
    imgs = [eng0.processor.prepare_image(photos[n]) for n in ("cat.png", "coffee.png")]
    cases = workload(imgs)
    outs = []
    for cfg in ({"page_size": 16}, {"page_size": 16, "disable_radix_cache": True}):
        eng, res = run_workload(make, cases, **cfg)
        outs.append([r.output_ids for r in res])
    assert outs[0] == outs[1]


def test_kv_tier_namespace_includes_the_quantization(families, int8_models, tmp_path) -> None:
    fam = families["llava"]
    keys = []
    for model in (fam.loaded, int8_models["llava"]):
        cfg = EngineConfig(model_path=str(fam.model_dir), kv_host_bytes=1 << 20)
        eng = Engine(cfg, model=model)
        keys.append(make_kv_tiers(cfg, eng.model, eng.pool).chain.root)
    assert keys[0] != keys[1]


# ---- tensor parallelism ----------------------------------------------------------------------
@pytest.mark.parametrize("source", ["flag", "checkpoint"])
def test_tp2_equals_tp1_quantized(families, int8_models, photos, tmp_path, source: str) -> None:
    """Each rank holds its rows of the quantized column-parallel weights with their scales
    and its columns of o_proj/down_proj with the whole rows' scales: tp 2 gives tp 1's
    tokens, quantizing at load (OneVision: q/k/v biases, tied head) or from a
    compressed-tensors checkpoint."""
    if source == "flag":
        model_dir = families["llava-onevision"].model_dir
        one_model, kw = int8_models["llava-onevision"], {"quantization": "int8"}
    else:
        model_dir = make_checkpoint(tmp_path / "q", "tiny", quantization="int8")
        one_model, kw = load_model(model_dir), {}
    one = Engine(EngineConfig(model_path=str(model_dir)), model=one_model)
    imgs = [one.processor.prepare_image(photos[n]) for n in ("cat.png", "coffee.png")]

    def reqs(eng: Engine) -> list:
        return [
            eng.processor.make_request(messages=m, images=i, params=greedy(6))
            for m, i in workload(imgs)[:4]
        ]

    ref = one.generate(reqs(one))
    with tp_engine(model_dir, **kw) as two:
        assert two.model.quantization == "int8"
        res = two.generate(reqs(two))
        two.check_accounting()
    for a, b in zip(res, ref, strict=True):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "tp2 int8")
