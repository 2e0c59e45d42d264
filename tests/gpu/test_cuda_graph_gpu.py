"""GPU checks of CUDA-graph decode (skipped without CUDA / flashinfer, as
tests/gpu/test_flashinfer.py, whose environment test fails a GPU check that lacks them).

* FlashInfer's CUDA-graph decode wrapper at OneVision-0.5B's heads (14 / 2: the
  tensor-core decode), captured over an all-padding batch as the runner does, then
  re-planned for a real batch and replayed: equal to the torch backend in fp32, K/V
  written to the real slots and the scratch page only;
* graphs are captured at start-up for every bucket, and decode batches replay them;
* greedy tokens with graphs equal those of eager decode (bf16, FlashInfer, page sizes 1
  and 16) across bucket boundaries (5 requests of different lengths: buckets 8, 4, 2, 1),
  the logits within the bf16 bound while both runs agree, a divergence only at a near tie;
* a replayed padded batch writes K/V only into its requests' new slots and the scratch
  page, and its logits equal the same step run eagerly;
* the padded twin with the torch backend on CUDA (fp32) gives eager's tokens.
"""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels.flashinfer_backend import FlashInferAttentionBackend
from mmserve.kernels.metadata import PaddedDecodeBuffers
from mmserve.kernels.torch_backend import TorchAttentionBackend
from tests.helpers import (
    BF16_LOGIT_RTOL,
    QUESTIONS,
    assert_same_generation,
    cuda_engine,
    greedy,
    needs_cuda,
    needs_flashinfer,
    random_batch,
    user,
)


def generate(eng, photos: dict[str, bytes], n: int = 5) -> list:
    """``n`` requests, ``4 + 3k`` tokens each (the batch shrinks through the buckets)."""
    img = eng.processor.prepare_image(photos["cat.png"])
    msgs = [
        eng.processor.make_request(
            messages=user(*([None] if k % 2 else []), f"{QUESTIONS[k % len(QUESTIONS)]} ({k})"),
            images=[img] if k % 2 else [],
            params=greedy(4 + 3 * k, ignore_eos=True),
        )
        for k in range(n)
    ]
    return eng.generate(msgs)


@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_captured_tensor_core_decode_matches_torch(page_size: int) -> None:
    dtype, bucket = torch.bfloat16, 8
    pool, meta, q, k, v = random_batch(page_size, "decode", 14, 2, dtype, device="cuda", seed=11)
    ref_pool = type(pool)(pool.num_pages, page_size, pool.num_layers, 2, 64, torch.float32, "cuda")
    for d, src in zip(
        ref_pool.k_buffers + ref_pool.v_buffers, pool.k_buffers + pool.v_buffers, strict=True
    ):
        d.copy_(src.float())
    indptr = meta.kv_indptr.tolist()
    tables = [meta.kv_indices[indptr[i] : indptr[i + 1]].tolist() for i in range(4)]
    bufs = PaddedDecodeBuffers(bucket, max(map(len, tables)), page_size, pool.scratch_page, "cuda")
    fi = FlashInferAttentionBackend(14, 2, 64, "cuda", dtype)
    assert fi._tensor_cores  # the path OneVision-0.5B decodes on
    qs = torch.zeros(bucket, 14, 64, dtype=dtype, device="cuda")
    ks = torch.zeros(bucket, 2, 64, dtype=dtype, device="cuda")
    vs = torch.zeros_like(ks)
    # capture over an all-padding batch, as DecodeGraphRunner.capture does
    fi.plan_padded(bufs.fill([], [], [], bucket))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fi.forward(qs, ks, vs, 0, pool)  # warm-up: FlashInfer's JIT build, lazy state
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fi.forward(qs, ks, vs, 0, pool)
    # the real batch: refill, re-plan, replay
    for b in pool.k_buffers + pool.v_buffers:  # undo the padding rows' writes
        b[pool.scratch_page].zero_()
    before = pool.k_buffers[0].clone()
    fi.plan_padded(bufs.fill(tables, meta.seq_lens, [0] * 4, bucket))
    qs[:4], ks[:4], vs[:4] = q, k, v
    graph.replay()
    torch.cuda.synchronize()
    ref = TorchAttentionBackend()
    ref.plan(meta)
    want = ref.forward(q.float(), k.float(), v.float(), 0, ref_pool)
    torch.testing.assert_close(out[:4].float(), want, atol=2e-2, rtol=2e-2)
    real = pool.k_buffers[0][: pool.num_pages]
    assert torch.equal(real, ref_pool.k_buffers[0][: pool.num_pages].to(dtype))
    changed = (real != before[: pool.num_pages]).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= set(meta.kv_indices.tolist())


@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_decode_matches_eager_bf16(model_dir, photos, page_size: int) -> None:
    runs = {}
    for graphs in (True, False):
        eng = cuda_engine(
            model_dir, dtype="bfloat16", page_size=page_size, disable_cuda_graph=not graphs
        )
        assert eng.runner.backend.name == "flashinfer"
        if graphs:
            g = eng.runner.graphs
            assert g is not None and sorted(g.graphs) == g.buckets and g.capture_seconds > 0
        else:
            assert eng.runner.graphs is None
        runs[graphs] = generate(eng, photos)
        if graphs:
            assert eng.runner.graphs.replays > 0
        eng.check_accounting()
    for a, b in zip(runs[True], runs[False], strict=True):
        assert len(a.output_ids) == len(b.output_ids)
        for step in range(len(a.output_ids)):
            la, lb = a.logits[step], b.logits[step]
            fin = torch.isfinite(lb)
            bound = BF16_LOGIT_RTOL * lb[fin].abs().max().item()
            diff = (la[fin] - lb[fin]).abs().max().item()
            assert diff <= bound, f"{a.rid} step {step}: logits differ by {diff} > {bound}"
            if a.output_ids[step] != b.output_ids[step]:
                top2 = torch.topk(lb, 2).values
                assert (top2[0] - top2[1]).item() <= 2 * bound, f"{a.rid} step {step}: not a tie"
                break


@needs_flashinfer
def test_replayed_padding_rows_write_only_the_scratch_page(model_dir, photos) -> None:
    eng = cuda_engine(model_dir, dtype="bfloat16", page_size=4)
    pool, graphs = eng.pool, eng.runner.graphs
    assert graphs is not None and graphs.graphs
    for k in range(3):  # bucket 4: one padding row
        eng.add_request(
            eng.processor.make_request(messages=user(f"{QUESTIONS[k]} {k}"), params=greedy(8))
        )
    while len(eng.scheduler.running) < 3:
        eng.step()
    reqs = list(eng.scheduler.running)
    eng.scheduler.prepare_decode()
    before = [b.clone() for b in pool.k_buffers]
    replays = graphs.replays
    padded = eng.runner.decode(reqs)
    assert graphs.replays == replays + 1
    P = pool.page_size
    new = {r.pages.tensor().tolist()[r.computed_len // P] * P + r.computed_len % P for r in reqs}
    scratch = set(range(pool.scratch_page * P, pool.scratch_page * P + P))
    for b, a in zip(before, pool.k_buffers, strict=True):
        flat_a, flat_b = a.view(-1, *a.shape[2:]), b.view(-1, *b.shape[2:])
        changed = set(torch.nonzero((flat_a != flat_b).any(-1).any(-1)).flatten().tolist())
        assert changed - scratch == new
    eng.runner.graphs = None
    eager = eng.runner.decode(reqs)
    # never-sampled ids are -inf in both (-inf - -inf is nan): compare the finite logits
    finite = eager.isfinite()
    assert torch.equal(finite, padded.isfinite())
    bound = BF16_LOGIT_RTOL * eager[finite].abs().max().item()
    assert (padded[finite] - eager[finite]).abs().max().item() <= bound


@needs_cuda
def test_padded_twin_with_the_torch_backend_on_cuda(model_dir, photos) -> None:
    runs = []
    for twin in (False, True):
        eng = cuda_engine(
            model_dir, dtype="float32", attention_backend="torch", cuda_graph_twin=twin
        )
        assert (eng.runner.graphs is not None) == twin
        runs.append(generate(eng, photos))
        if twin:
            assert eng.runner.graphs.graphs == {} and eng.runner.graphs.replays > 0
    for k, (a, b) in enumerate(zip(runs[1], runs[0], strict=True)):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, f"twin #{k}")
