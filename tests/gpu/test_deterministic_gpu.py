"""GPU check of ``--deterministic`` (issue 46) on CUDA, bf16.

The mode runs the torch backend (fixed key blocks) and the fixed splits of the
row-parallel linears; FlashInfer is refused under it, so "auto" resolves to torch. The
CPU suite (tests/test_deterministic.py) asserts bit-identity across cache states,
chunkings, batches, TP and replicas. On CUDA the claim is not made: cuBLAS picks its
GEMM kernels by the number of rows, so a row's bits may follow the batch. The second
test records whether it holds on the machine the GPU check ran on (XPASS: it held;
XFAIL: it did not), without failing the check either way.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import QUESTIONS, cuda_engine, greedy, needs_cuda, user


def _answers(eng, cases) -> list[tuple[list[int], list[float], bytes]]:
    """Greedy ``(ids, logprobs, logits bytes)`` of ``cases`` (``(messages, images)``) in
    one batch."""
    reqs = [
        eng.processor.make_request(messages=m, images=i, params=greedy(5, logprobs=0))
        for m, i in cases
    ]
    return [
        (
            list(r.output_ids),
            [t.logprob for t in r.logprobs],
            torch.stack(list(r.logits)).cpu().numpy().tobytes(),
        )
        for r in eng.generate(reqs)
    ]


@needs_cuda
def test_auto_runs_the_torch_backend_and_flashinfer_is_refused(model_dir) -> None:
    eng = cuda_engine(model_dir, dtype="bfloat16", deterministic=True)
    assert eng.runner.backend.name == "torch" and eng.runner.backend.deterministic
    with pytest.raises(ValueError, match="cannot run --deterministic"):
        cuda_engine(model_dir, dtype="bfloat16", deterministic=True, attention_backend="flashinfer")


@needs_cuda
@pytest.mark.xfail(
    reason="not claimed on CUDA: cuBLAS picks GEMM kernels by row count", strict=False
)
def test_cuda_bf16_cache_chunks_and_batches_change_no_bit(model_dir, photos) -> None:
    def make(**kw):
        return cuda_engine(model_dir, dtype="bfloat16", deterministic=True, **kw)

    eng = make(disable_radix_cache=True, page_size=1)
    img = eng.processor.prepare_image(next(iter(photos.values())))
    target = (user(None, QUESTIONS[1]), [img])
    other = (user(None, QUESTIONS[0]), [img])
    (base,) = _answers(eng, [target])
    for cfg in ({"page_size": 1, "max_prefill_tokens": 37}, {"page_size": 16}):
        warm = make(**cfg)
        _answers(warm, [other])  # the picture's prefix cached by another question
        assert _answers(warm, [target]) == [base], cfg
        assert _answers(warm, [other, target])[-1] == base, cfg  # in a batch of two
