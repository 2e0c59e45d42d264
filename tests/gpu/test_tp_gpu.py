"""Tensor parallelism on two CUDA devices (NCCL), run by ``scripts/gpu_check.sh``'s
``--tp 2`` phase when the machine has two GPUs (skipped with the reason otherwise).

* fp32 with the torch backend: greedy tokens with ``tp=2`` equal ``tp=1`` on CUDA and
  logits agree within ``1e-4`` of the largest |logit| (the CPU test's rule);
* bf16 with ``attention_backend="auto"`` (FlashInfer when importable): the first
  step's logits agree with ``tp=1`` within ``BF16_LOGIT_RTOL`` and every request ends
  without error.
"""

from __future__ import annotations

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from tests.helpers import BF16_LOGIT_RTOL, greedy, tp_engine

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA devices ({torch.cuda.device_count()} visible)",
)
PROMPTS = ["Once upon a time", "The capital of France is", "List three colours:"]


def _run(eng: Engine) -> list:
    reqs = [eng.processor.make_request(prompt=p, params=greedy(12)) for p in PROMPTS]
    return eng.generate(reqs)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    return ((a[finite] - b[finite]).abs().max() / b[finite].abs().max().clamp(min=1)).item()


@pytest.mark.parametrize("dtype,backend", [("float32", "torch"), ("bfloat16", "auto")])
def test_tp2_on_two_gpus_equals_tp1(small_model_dir, dtype: str, backend: str) -> None:
    cfg = {"device": "cuda", "dtype": dtype, "attention_backend": backend}
    one = Engine(EngineConfig(model_path=str(small_model_dir), **cfg))
    ref = _run(one)
    del one
    torch.cuda.empty_cache()
    with tp_engine(small_model_dir, **cfg) as two:
        res = _run(two)
        assert two.fatal_error() is None
    for a, b in zip(res, ref, strict=True):
        assert a.finish_reason != "error", a.error
        if dtype == "float32":
            assert a.output_ids == b.output_ids
            assert max(_max_rel(x, y) for x, y in zip(a.logits, b.logits, strict=True)) <= 1e-4
        else:
            assert _max_rel(a.logits[0], b.logits[0]) <= BF16_LOGIT_RTOL
