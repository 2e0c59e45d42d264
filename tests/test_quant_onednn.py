"""The CPU's int8 W8A8 matmul through oneDNN (issue 49 part 2: quantized matmuls that
scale with the batch): above the weight-only kernel's rows an int8 linear runs oneDNN's
prepacked u8 x s8 product on AVX-512 CPUs, with the bits of the W8A8 reference, and
``torch._int_mm`` where oneDNN is not chosen.
"""

from __future__ import annotations

import pytest
import torch

from mmserve.model import quant, quant_onednn


def _layer(out_f: int, in_f: int, seed: int) -> quant.QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    q, s = quant.quantize_per_channel(torch.randn(out_f, in_f, generator=g) * 0.02, "int8")
    return quant.QuantizedLinear(q, s, None)


@pytest.mark.parametrize(("out_f", "in_f", "rows"), [(48, 64, 5), (1152, 896, 8), (896, 4864, 33)])
def test_onednn_w8a8_has_the_reference_bits(out_f: int, in_f: int, rows: int) -> None:
    """Above ``INT8PACK_MAX_ROWS`` bf16 rows the CPU runs oneDNN, whose output equals
    ``int8_w8a8_ref`` (and so the CUDA / ``_int_mm`` path) bit for bit, including large
    activations and 4864-long sums; the weight is prepacked once, at construction (load),
    kept through a dtype move and made again when the weight is replaced or changed. A
    CPU without oneDNN's path (AVX2) runs ``torch._int_mm`` with those bits, no copy."""
    lin = _layer(out_f, in_f, seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = (torch.randn(rows, in_f, generator=g) * 30).bfloat16()
    if not quant_onednn.available():
        assert quant.kernel_for(lin.weight, x) == "int_mm" and lin._onednn is None
        assert torch.equal(lin(x), quant.int8_w8a8_ref(x, lin.weight, lin.weight_scale))
        return
    assert quant.kernel_for(lin.weight, x) == "onednn"
    packed = lin._onednn
    assert packed is not None  # made at load, before any call
    y = lin(x)
    assert lin._onednn is packed
    want = quant.int8_w8a8_ref(x, lin.weight, lin.weight_scale)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    xq, xs = quant.quantize_per_token_int8(x)
    via_int_mm = (torch._int_mm(xq, lin.weight.T).float() * xs * lin.weight_scale).bfloat16()
    assert torch.equal(y, via_int_mm)
    assert torch.equal(lin(x), y) and lin._onednn is packed  # reused, same bits
    lin.to(torch.bfloat16)  # the int8 weight keeps its storage: the copy stays
    assert lin._onednn is packed and torch.equal(lin(x), y)
    lin.load_state_dict({"weight": lin.weight.neg()}, strict=False, assign=True)
    assert torch.equal(lin(x), quant.int8_w8a8_ref(x, lin.weight, lin.weight_scale))
    assert torch.equal(lin(x), -y) and lin._onednn is not packed  # packed again
    lin.weight.mul_(-1)  # an in-place change (its version counter) is seen too
    assert torch.equal(lin(x), y)
    lin.to("meta")  # off the CPU: the copy is dropped
    assert lin._onednn is None


def test_batch_rows_up_to_the_threshold_stay_weight_only() -> None:
    """1-4 rows keep torch's weight-only int8 kernel (no activation quantization)."""
    lin = _layer(1152, 896, seed=1)
    for rows in range(1, quant.INT8PACK_MAX_ROWS + 1):
        x = torch.randn(rows, 896).bfloat16()
        assert quant.kernel_for(lin.weight, x) == "int8pack"
        want = torch.ops.aten._weight_int8pack_mm(x, lin.weight, lin.weight_scale.bfloat16())
        assert torch.equal(lin(x), want)
    # made at load all the same where oneDNN runs: prefill needs it
    assert (lin._onednn is not None) == quant_onednn.available()


def test_without_onednn_the_cpu_runs_int_mm(monkeypatch) -> None:
    """Where oneDNN is not chosen (another CPU capability, or a build without it) the
    same rows run ``torch._int_mm`` with the same bits."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert quant_onednn._probe() is False
    monkeypatch.setattr(quant_onednn, "_AVAILABLE", False)
    lin = _layer(1152, 896, seed=2)  # no oneDNN copy either
    x = (torch.randn(8, 896) * 4).bfloat16()
    assert quant.kernel_for(lin.weight, x) == "int_mm"
    assert torch.equal(lin(x), quant.int8_w8a8_ref(x, lin.weight, lin.weight_scale))
    assert lin._onednn is None


def test_the_onednn_copy_can_be_turned_off(model_dir) -> None:
    """``disable_int8_onednn`` (``--disable-int8-onednn``): the engine's int8 linears keep no
    prepacked copy (int8 at half of bf16's weight bytes) and run ``torch._int_mm`` above
    4 rows, with the same answers as the default."""
    from mmserve.config import EngineConfig
    from mmserve.frontend.frontend import Engine
    from tests.helpers import greedy, user

    def answer(on: bool) -> tuple[list[list[int]], list]:
        cfg = EngineConfig(
            model_path=str(model_dir),
            quantization="int8",
            disable_int8_onednn=not on,
            dtype="bfloat16",
        )
        eng = Engine(cfg)
        lins = [m for m in eng.model.decoder.modules() if isinstance(m, quant.QuantizedLinear)]
        reqs = [
            eng.processor.make_request(messages=user(f"Tell me about cat {k}."), params=greedy(6))
            for k in range(6)  # a batch of 6 rows: oneDNN where it runs
        ]
        return [r.output_ids for r in eng.generate(reqs)], [m._onednn for m in lins]

    try:
        off_ids, off_copies = answer(False)
        assert off_copies and all(c is None for c in off_copies)
        on_ids, on_copies = answer(True)
        assert all((c is not None) == quant_onednn.available() for c in on_copies)
        assert on_ids == off_ids
    finally:
        quant_onednn.enable(True)
