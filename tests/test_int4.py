"""4-bit weights (``--quantization int4``; compressed-tensors pack-quantized, AWQ and GPTQ
checkpoints): each format's tensors unpack to exactly the reference dequantization; the
int4 linear against the dequantized fp32 linear; tiny engines of every format answer and
greedy-equal transformers run on the same dequantized weights; refusals name the field;
tensor-parallel shards split on group boundaries.

Tolerances (stated once): :class:`Int4Linear` computes ``(q - 8) * scale + offset`` with
``offset = (8 - zero) * scale`` rounded once, so against ``x @ ((q - zero) * scale)^T`` in
fp32 it is within ``1e-5 * max(|x| @ |W|^T)``; bf16 activations within ``2**-6`` of the
output's scale (bf16 rounding of the activations, scales and output). Whole models: the
greedy tokens equal transformers' on the dequantized weights (fp32) under the near-tie
rule of ``assert_same_generation`` (a position whose top two fp32 logits are within 1e-3
may differ, and then the comparison stops).
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.cli import main as cli_main
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model import int4, int4_formats, quant, quant_onednn
from mmserve.model.int4_loading import int4_slice
from mmserve.model.loader import load_model
from mmserve.testing.checkpoints import make_checkpoint
from tests.helpers import (
    assert_same_generation,
    check_against_reference,
    greedy,
    tp_engine,
    user,
    workload,
)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- reference packers: one value at a time, written from the formats' descriptions -------
def _word(vals: list[int]) -> int:
    """Eight 4-bit values, the first in the low bits, as a signed int32."""
    w = sum((v & 15) << (4 * j) for j, v in enumerate(vals))
    return w - (1 << 32) if w >= 1 << 31 else w


def _ref_ct(q, z, symmetric: bool) -> dict:
    out_f, in_f = q.shape
    t = {
        "weight_packed": torch.tensor(
            [
                [_word(q[o, 8 * j : 8 * j + 8].tolist()) for j in range(in_f // 8)]
                for o in range(out_f)
            ],
            dtype=torch.int32,
        )
    }
    if not symmetric:
        rows = -(-out_f // 8)
        zp = [
            [
                _word([int(z[8 * r + i, g]) if 8 * r + i < out_f else 8 for i in range(8)])
                for g in range(z.shape[1])
            ]
            for r in range(rows)
        ]
        t["weight_zero_point"] = torch.tensor(zp, dtype=torch.int32)
    return t


def _ref_awq(q, z) -> dict:
    order = int4_formats.AWQ_ORDER
    out_f, in_f = q.shape

    def words(m):  # m: [rows, out]
        return torch.tensor(
            [
                [_word([int(m[r, 8 * c + order[j]]) for j in range(8)]) for c in range(out_f // 8)]
                for r in range(m.shape[0])
            ],
            dtype=torch.int32,
        )

    return {"qweight": words(q.T), "qzeros": words(z.T)}


def _ref_gptq(q, z) -> dict:
    out_f, in_f = q.shape
    qw = [[_word(q[o, 8 * r : 8 * r + 8].tolist()) for o in range(out_f)] for r in range(in_f // 8)]
    qz = [
        [_word([int(z[8 * c + j, g]) - 1 for j in range(8)]) for c in range(out_f // 8)]
        for g in range(z.shape[1])
    ]
    return {
        "qweight": torch.tensor(qw, dtype=torch.int32),
        "qzeros": torch.tensor(qz, dtype=torch.int32),
    }


def _ref_dequant(q, s, z, group):
    """``(q - z) * s`` element by element (fp32), the reference dequantization."""
    out = torch.empty(q.shape)
    for o in range(q.shape[0]):
        for i in range(q.shape[1]):
            g = i // group
            out[o, i] = (float(q[o, i]) - float(z[o, g])) * float(s[o, g])
    return out


@st.composite
def _quantized(draw):
    group = draw(st.sampled_from(int4.GROUP_SIZES))
    out_f = 8 * draw(st.integers(1, 3))
    in_f = group * draw(st.integers(1, 2))
    symmetric = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    s = torch.rand(out_f, in_f // group, generator=g) + 0.01
    z = (
        torch.full_like(s, 8, dtype=torch.uint8)
        if symmetric
        else torch.randint(0, 16, s.shape, generator=g, dtype=torch.uint8)
    )
    return q, s, z, group, symmetric


@SETTINGS
@given(_quantized())
def test_each_format_unpacks_to_the_reference_dequantization(case) -> None:
    q, s, z, group, symmetric = case
    want = _ref_dequant(q, s, z, group)
    # compressed-tensors: the reference packing equals ours, and both unpack exactly
    ct = _ref_ct(q, z, symmetric)
    ours = int4_formats.pack_ct(q, s, z, symmetric)
    assert torch.equal(ours["weight_packed"], ct["weight_packed"])
    zp = ct.get("weight_zero_point")
    if zp is not None:
        assert torch.equal(ours["weight_zero_point"], zp)
    got = int4_formats.unpack_ct(ct["weight_packed"], s, zp, group)
    assert torch.equal(int4.dequantize_int4(*got, group), want)
    # AWQ (always zero points; AWQ's column order)
    awq = _ref_awq(q, z)
    assert torch.equal(int4_formats.pack_awq(q, s, z)["qweight"], awq["qweight"])
    got = int4_formats.unpack_awq(awq["qweight"], awq["qzeros"], s.T.contiguous(), group)
    assert torch.equal(int4.dequantize_int4(*got, group), want)
    # GPTQ v1 (zeros stored minus one) and v2
    gq = _ref_gptq(q, z)
    packed = int4_formats.pack_gptq(q, s, z, group)
    assert torch.equal(packed["qweight"], gq["qweight"]) and torch.equal(
        packed["qzeros"], gq["qzeros"]
    )
    got = int4_formats.unpack_gptq(
        gq["qweight"], gq["qzeros"], s.T.contiguous(), packed["g_idx"], group, True
    )
    assert torch.equal(int4.dequantize_int4(*got, group), want)
    v2 = int4_formats.pack_gptq(q, s, z, group, v1=False)
    got = int4_formats.unpack_gptq(
        v2["qweight"], v2["qzeros"], s.T.contiguous(), None, group, False
    )
    assert torch.equal(int4.dequantize_int4(*got, group), want)


@SETTINGS
@given(st.sampled_from(int4.GROUP_SIZES), st.booleans(), st.integers(0, 2**16))
def test_quantize_int4_error_is_half_a_step(group: int, symmetric: bool, seed: int) -> None:
    w = torch.randn(16, 2 * group, generator=torch.Generator().manual_seed(seed))
    q, s, z = int4.quantize_int4(w, group, symmetric)
    assert int(q.max()) <= 15 and (z == 8).all() == symmetric or not symmetric
    err = (int4.dequantize_int4(q, s, z, group) - w).abs()
    step = s.repeat_interleave(group, dim=1)
    assert bool((err <= step * 0.5 + 1e-6).all())


# ---- one linear ------------------------------------------------------------------------------
@pytest.mark.parametrize("out_f", [48, 40])  # 40: not a multiple of 16, the plain layout
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 8, 33, int4.CPU_KERNEL_MAX_ROWS + 1])
def test_int4_linear_equals_the_dequantized_fp32_linear(out_f, dtype, rows) -> None:
    g = torch.Generator().manual_seed(out_f + rows)
    w = torch.randn(out_f, 256, generator=g)
    q, s, z = int4.quantize_int4(w, 64, symmetric=False)
    bias = torch.randn(out_f, generator=g)
    lin = int4.Int4Linear.from_int(q, s, z, 64, bias).to(dtype=dtype)
    assert lin.layout == ("cpu" if out_f % 16 == 0 else "plain")
    x = torch.randn(rows, 256, generator=g)
    wd = int4.dequantize_int4(q, s, z, 64)
    want = x.to(dtype).float() @ wd.T + bias.to(dtype).float()
    got = lin(x.to(dtype))
    assert got.dtype == dtype and got.shape == (rows, out_f)
    scale = float((x.abs() @ wd.abs().T).max())
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    assert float((got.float() - want).abs().max()) <= tol * scale
    # the weight the module holds, read back, is the dequantized weight (bf16 scales: to
    # bf16's rounding)
    wtol = 1e-6 if dtype == torch.float32 else 2**-7
    assert torch.allclose(lin.dequantized(), wd, atol=wtol * float(wd.abs().max()))


def test_batched_rows_take_the_measured_paths(monkeypatch) -> None:
    """Above its measured row counts the CPU int4 layer dequantizes into the shared buffer
    (the kernel is not called) and int8 runs W8A8 in one call (oneDNN or ``_int_mm``),
    equal to its twin's exact integer arithmetic."""
    q, s, z = int4.quantize_int4(torch.randn(64, 128), 64, symmetric=False)
    lin = int4.Int4Linear.from_int(q, s, z, 64).to(dtype=torch.bfloat16)
    calls: list[int] = []
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu

    def counting(x, *a):
        calls.append(x.shape[0])
        return kernel(x, *a)

    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", counting)
    for rows in (int4.CPU_KERNEL_MAX_ROWS, int4.CPU_KERNEL_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 128).bfloat16()
        want = x.float() @ int4.dequantize_int4(q, s, z, 64).T
        got = lin(x).float()
        assert float((got - want).abs().max()) <= 2**-6 * float(want.abs().max())
    assert calls == [int4.CPU_KERNEL_MAX_ROWS]  # the others dequantized once each
    # int8: the weight-only kernel up to 4 rows, W8A8 above (oneDNN's on AVX-512 CPUs)
    w8, s8 = quant.quantize_per_channel(torch.randn(48, 64), "int8")
    layer = quant.QuantizedLinear(w8, s8, None)
    w8a8 = "onednn" if quant_onednn.available() else "int_mm"
    for rows, kernel_name in (
        (quant.INT8PACK_MAX_ROWS, "int8pack"),
        (8, w8a8),
        (200, w8a8),
    ):
        x = torch.randn(rows, 64).bfloat16()
        assert quant.kernel_for(w8, x) == kernel_name
        if kernel_name == w8a8:
            assert torch.equal(layer(x), quant.int8_w8a8_ref(x, w8, s8))


def test_scales_follow_the_module_dtype_and_the_packed_weight_does_not() -> None:
    q, s, z = int4.quantize_int4(torch.randn(32, 128), 128)
    lin = int4.Int4Linear.from_int(q, s, z, 128).to(dtype=torch.bfloat16)
    assert lin.weight.dtype == torch.uint8 and lin.scales_zeros.dtype == torch.bfloat16
    assert lin.weight.numel() == 32 * 128 // 2  # two values a byte


# ---- whole models ----------------------------------------------------------------------------
def _dequantized_reference(ref, group: int, symmetric: bool, head: bool):
    """transformers' model with its decoder projections (and LM head when ``head``,
    untied) replaced by ``dequantize_int4(quantize_int4(w))``."""
    model, processor = ref
    model = copy.deepcopy(model)

    def dq(w: torch.Tensor) -> torch.Tensor:
        gs = int4.group_size_for(w.shape[1], group)
        return int4.dequantize_int4(*int4.quantize_int4(w, gs, symmetric), gs)

    for name, mod in model.model.language_model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJ:
            mod.weight.data = dq(mod.weight.data)
    if head:
        model.lm_head.weight = torch.nn.Parameter(
            dq(model.lm_head.weight.data), requires_grad=False
        )
    return model.eval(), processor


@pytest.mark.parametrize(
    ("family", "method", "group", "symmetric"),
    [
        ("llava", "flag", 128, False),  # --quantization int4: asymmetric, group 128, head too
        ("llava-onevision", "int4", 128, True),  # compressed-tensors W4A16, q/k/v biases
        ("llava", "int4", 32, False),  # compressed-tensors, asymmetric zero points
        ("llava-next", "awq", 64, False),
        ("llava", "gptq", 128, False),
        ("llava-onevision", "gptq", 32, True),
    ],
)
def test_int4_engines_answer_as_transformers_on_the_dequantized_weights(
    families, photos, tmp_path, family, method, group, symmetric
) -> None:
    fam = families[family]
    if method == "flag":
        path, model = fam.model_dir, load_model(fam.model_dir, quantization="int4")
        assert model.quantization_source == "--quantization int4, quantized at load"
    else:
        path = make_checkpoint(
            tmp_path / method,
            "tiny",
            family=family,
            quantization=method,
            group_size=group,
            symmetric=symmetric,
        )
        model = load_model(path)
        kind = json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
        assert model.quantization_source == f"the checkpoint's {kind} int4 weights"
    assert model.quantization == "int4"
    qkv = model.decoder.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, int4.Int4Linear) and qkv.group == group
    assert isinstance(model.decoder.lm_head, int4.Int4Linear) == (method == "flag")
    ref = _dequantized_reference(fam.ref, group, symmetric, head=method == "flag")
    eng = Engine(EngineConfig(model_path=str(path)), model=model)
    assert eng.describe()["quantization"] == "int4"
    weights = eng.describe()["weights"]
    assert weights.startswith(f"quantization int4 ({model.quantization_source}; groups of ")
    if method == "flag":  # the untied head is named as int4, with its real parameter count
        s = model.decoder.shape
        assert f"LM head untied (int4, {s.vocab_size * s.hidden_size:,} parameters" in weights
    img = eng.processor.prepare_image(photos["coffee.png"])
    check_against_reference(eng, ref, user(None, "What is in the cup?"), [img], f"int4 {method}")
    check_against_reference(eng, ref, user("Name three colours."), [], f"int4 {method} text")


def test_make_model_cli_writes_each_format_and_it_loads(tmp_path) -> None:
    for method, extra in (
        ("int4", ["--asymmetric"]),
        ("awq", []),
        ("gptq", ["--group-size", "64"]),
    ):
        out = tmp_path / method
        assert cli_main(["make-model", str(out), "--quantization", method, *extra]) == 0
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        model = load_model(out)
        assert model.quantization == "int4"
        lin = model.decoder.layers[1].mlp.down_proj
        assert isinstance(lin, int4.Int4Linear)
        assert lin.group == (64 if method == "gptq" else 128)
        if method == "int4":
            assert qc["format"] == "pack-quantized"
            assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is False


# ---- refusals --------------------------------------------------------------------------------
def _pack_quantized(input_activations: dict | None = None, **weights) -> dict:
    """A compressed-tensors W4A16 ``quantization_config`` (groups of 128) with ``weights``
    fields added and, if given, ``input_activations``."""
    group: dict = {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
    }
    group["weights"].update(weights)
    if input_activations is not None:
        group["input_activations"] = input_activations
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
    }


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
            r"gptq quantization_config desc_act=True",
        ),
        (
            {"quant_method": "gptq", "bits": 8, "group_size": 128},
            r"gptq quantization_config bits=8",
        ),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, r"group_size=-1"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            r"checkpoint_format='marlin'",
        ),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            r"awq quantization_config version='gemv'",
        ),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
            r"zero_point=False",
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 256}, r"group_size=256"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}
                },
            },
            r"config_groups.group_0.weights.strategy='channel'",
        ),
        (_pack_quantized(input_activations={"num_bits": 8}), r"input_activations"),
        (
            _pack_quantized(actorder="group"),
            r"config_groups.group_0.weights.actorder='group'",
        ),
        ({"quant_method": "bitsandbytes"}, r"'bitsandbytes'.*pack-quantized.*AWQ.*GPTQ"),
    ],
)
def test_unsupported_4bit_layouts_are_refused_by_field_and_value(
    families, tmp_path, qc, match
) -> None:
    d = tmp_path / "m"
    shutil.copytree(families["llava"].model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(quant.QuantizationError, match=match):
        load_model(d)


def test_act_order_g_idx_is_refused(tmp_path) -> None:
    q, s, z = int4.quantize_int4(torch.randn(8, 64), 32, symmetric=False)
    t = int4_formats.pack_gptq(q, s, z, 32)
    perm = t["g_idx"].flip(0)
    with pytest.raises(int4_formats.Int4FormatError, match="g_idx.*act-order"):
        int4_formats.unpack_gptq(t["qweight"], t["qzeros"], t["scales"], perm, 32, True)


def test_conflicting_flag_is_refused(tmp_path) -> None:
    path = make_checkpoint(tmp_path / "g", "tiny", quantization="gptq")
    with pytest.raises(
        quant.QuantizationError, match="--quantization int8 conflicts.*already int4"
    ):
        load_model(path, quantization="int8")
    assert load_model(path, quantization="int4").quantization == "int4"


# ---- namespaces and tensor parallelism -------------------------------------------------------
def test_kv_tier_namespace_includes_int4(families) -> None:
    from mmserve.engine.scheduler import make_kv_tiers

    fam = families["llava"]
    roots = []
    for model in (fam.loaded, load_model(fam.model_dir, quantization="int4")):
        cfg = EngineConfig(model_path=str(fam.model_dir), kv_host_bytes=1 << 20)
        eng = Engine(cfg, model=model)
        roots.append(make_kv_tiers(cfg, eng.model, eng.pool).chain.root)
    assert roots[0] != roots[1]


def test_a_column_shard_inside_a_group_regroups_exactly() -> None:
    """A rank's input columns that split a group keep that group's scale and zero in
    smaller groups: the slice's weight equals the whole weight's columns bit for bit; a
    split no group of 32 fits is refused, naming the module, span and group."""
    q, s, z = int4.quantize_int4(torch.randn(16, 256), 64, symmetric=False)
    whole = int4.dequantize_int4(q, s, z, 64)
    (rq, rs, rz), g = int4_slice((q, s, z), "col", (128, 256), 64, "layers.0.mlp.down_proj")
    assert g == 64 and torch.equal(rq, q[:, 128:]) and torch.equal(rs, s[:, 2:])
    assert torch.equal(rz, z[:, 2:])
    (rq, rs, rz), g = int4_slice((q, s, z), "col", (96, 192), 64, "layers.0.mlp.down_proj")
    assert g == 32 and rs.shape == (16, 3)
    assert torch.equal(int4.dequantize_int4(rq, rs, rz, 32), whole[:, 96:192])
    with pytest.raises(
        quant.QuantizationError,
        match=r"down_proj's 256 input features at \[48, 112\).*groups of 64",
    ):
        int4_slice((q, s, z), "col", (48, 112), 64, "layers.0.mlp.down_proj")


@pytest.mark.parametrize("at_load", [False, True], ids=["checkpoint-group32", "at-load-group128"])
def test_tp2_equals_tp1_int4(families, photos, tmp_path, at_load: bool) -> None:
    """o_proj's 128 input features split 64 + 64: a compressed-tensors asymmetric group-32
    checkpoint (two groups a rank), or ``--quantization int4`` at load in groups of 128
    (each rank holds its half of a group in groups of 64 with the group's numbers):
    tp 2 gives tp 1's tokens."""
    if at_load:
        path, kw = families["llava"].model_dir, {"quantization": "int4"}
    else:
        path = make_checkpoint(
            tmp_path / "q", "tiny", quantization="int4", group_size=32, symmetric=False
        )
        kw = {}
    one = Engine(EngineConfig(model_path=str(path)), model=load_model(path, **kw))
    imgs = [one.processor.prepare_image(photos[n]) for n in ("cat.png", "coffee.png")]

    def reqs(eng: Engine) -> list:
        return [
            eng.processor.make_request(messages=m, images=i, params=greedy(6))
            for m, i in workload(imgs)[:3]
        ]

    ref = one.generate(reqs(one))
    with tp_engine(path, **kw) as two:
        assert two.model.quantization == "int4"
        res = two.generate(reqs(two))
    for a, b in zip(res, ref, strict=True):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "tp2 int4")


def test_the_shared_buffer_made_under_inference_mode_serves_calls_outside_it() -> None:
    """The per-thread dequantization buffer first made inside ``torch.inference_mode()``
    (the engine, a benchmark) does not break a later call outside it (a test, a tool)."""
    q, s, z = int4.quantize_int4(torch.randn(64, 128), 64, symmetric=False)
    lin = int4.Int4Linear.from_int(q, s, z, 64).to(dtype=torch.bfloat16)
    x = torch.randn(int4.CPU_KERNEL_MAX_ROWS + 1, 128).bfloat16()
    int4._BUFFERS.clear()
    with torch.inference_mode():
        inside = lin(x)
    outside = lin(x)
    assert torch.equal(outside, inside) and not outside.is_inference()


@pytest.mark.parametrize("kind", ["awq", "gptq", "compressed-tensors"])
def test_quantization_flag_may_name_the_checkpoints_format(families, tmp_path, kind) -> None:
    """vLLM's ``--quantization awq`` (``gptq``, ``compressed-tensors``) serves a checkpoint
    in that format with its own weights, and is refused, naming both, for a checkpoint
    in another format or an unquantized one."""
    made = "int4" if kind == "compressed-tensors" else kind
    path = make_checkpoint(tmp_path / kind, "tiny", quantization=made)
    assert load_model(path, quantization=kind).quantization == "int4"
    other = "gptq" if kind == "awq" else "awq"
    with pytest.raises(quant.QuantizationError, match=f"--quantization {other}.*{kind!r}"):
        load_model(path, quantization=other)
    with pytest.raises(quant.QuantizationError, match=f"--quantization {kind}.*no quantized"):
        load_model(families["llava"].model_dir, quantization=kind)
    assert EngineConfig(model_path=str(path), quantization=kind).quantization == kind
