"""CUDA-graph decode's padded path, run on the CPU without capture (the CPU twin,
``EngineConfig.cuda_graph_twin``): the same static buffers and buckets a captured graph
replays. Its tokens equal eager decode's across bucket boundaries, retraction,
structured output, seeded sampling and n > 1, and its padding rows write only the
pool's scratch page. FlashInfer's CUDA-graph wrappers are exercised against a stand-in
that keeps their contract (tests/helpers.py ``FakeFlashInfer``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.config import EngineConfig
from mmserve.engine.cuda_graph import (
    DecodeGraphRunner,
    capture_sizes,
    default_max_bs,
    graph_mode,
)
from mmserve.kernels import flashinfer_backend as fb
from mmserve.kernels.metadata import PaddedDecodeBuffers, build_metadata
from mmserve.kernels.torch_backend import TorchAttentionBackend
from mmserve.structured.spec import GuidedSpec
from mmserve.types import SamplingParams
from tests.helpers import (
    QUESTIONS,
    FakeFlashInfer,
    assert_same_generation,
    greedy,
    run_workload,
    user,
    workload,
)

TWIN = {"cuda_graph_twin": True}


@pytest.fixture(scope="module")
def imgs(make_engine, photos):
    eng = make_engine()
    return [eng.processor.prepare_image(b) for b in photos.values()]


def same(results, base, what: str) -> None:
    assert len(results) == len(base)
    for k, (a, b) in enumerate(zip(results, base, strict=True)):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, f"{what} #{k}")


def test_buckets_and_default_largest_bucket() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    big = capture_sizes(600)
    assert big[-5:] == [496, 512, 544, 576, 600] and big == sorted(set(big))
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_sizes(0)
    gib = 2**30
    got = [default_max_bs("cuda", m * gib) for m in (16, 24, 40, 80, 141, 192)]
    assert got == [8, 24, 32, 256, 256, 512]
    assert default_max_bs("cpu") == 160


def test_graph_mode_decisions() -> None:
    backend = TorchAttentionBackend()
    assert graph_mode(EngineConfig(), backend)[0] == 0  # CPU, no twin: eager
    assert graph_mode(EngineConfig(**TWIN), backend)[:2] == (64, False)  # max_running caps
    cfg = EngineConfig(cuda_graph_max_bs=12, **TWIN)
    assert graph_mode(cfg, backend)[:2] == (12, False)
    assert graph_mode(EngineConfig(disable_cuda_graph=True, **TWIN), backend)[0] == 0
    assert graph_mode(EngineConfig(tp=2, **TWIN), backend)[0] == 0
    # CUDA with a backend whose kernels cannot be captured: eager unless the twin
    assert graph_mode(EngineConfig(device="cuda"), backend)[0] == 0
    capturable = SimpleNamespace(name="flashinfer", captures_graphs=True)
    cuda = EngineConfig(device="cuda", cuda_graph_max_bs=48)
    assert graph_mode(cuda, capturable)[:2] == (48, True)
    assert graph_mode(dataclasses.replace(cuda, max_running_requests=20), capturable)[0] == 20
    assert graph_mode(dataclasses.replace(cuda, disable_cuda_graph=True), capturable)[0] == 0
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=-1).validate()


def test_padded_buffers_layout() -> None:
    bufs = PaddedDecodeBuffers(max_bs=8, max_pages=5, page_size=4, scratch_page=99)
    meta = bufs.fill([[7, 3], [5], [2, 6, 9]], [6, 1, 12], [11, 12, 13], bucket=4)
    assert meta.kv_indptr.tolist() == [0, 2, 3, 6, 7]
    assert meta.kv_indices.tolist() == [7, 3, 5, 2, 6, 9, 99]
    assert meta.kv_last_page_len.tolist() == [2, 1, 4, 1]
    assert meta.positions.tolist() == [5, 0, 11, 0]
    # the new token's slot: last page * P + (seq - 1) % P; padding on the scratch page
    assert meta.out_cache_loc.tolist() == [3 * 4 + 1, 5 * 4, 9 * 4 + 3, 99 * 4]
    assert bufs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert meta.seq_lens == [6, 1, 12, 1] and meta.is_decode and meta.batch_size == 4
    with pytest.raises(ValueError, match="pages"):
        bufs.fill([[1]], [9], [0], bucket=1)  # 9 tokens need 3 pages
    with pytest.raises(ValueError, match="bucket"):
        bufs.fill([[1]] * 3, [1] * 3, [0] * 3, bucket=2)


def test_padding_rows_write_only_the_scratch_page(make_engine, imgs) -> None:
    eng = make_engine(page_size=4, **TWIN)
    pool, graphs = eng.pool, eng.runner.graphs
    assert graphs is not None and graphs.graphs == {}  # nothing captured on the CPU
    for k in range(3):  # 3 requests: bucket 4, one padding row
        msg = eng.processor.make_request(
            messages=user(None, QUESTIONS[k]), images=[imgs[k]], params=greedy(8)
        )
        eng.add_request(msg)
    while len(eng.scheduler.running) < 3:
        eng.step()
    reqs = list(eng.scheduler.running)
    eng.scheduler.prepare_decode()
    before_k = [b.clone() for b in pool.k_buffers]
    padded = eng.runner.decode(reqs)
    P = pool.page_size
    new = {r.pages.tensor().tolist()[r.computed_len // P] * P + r.computed_len % P for r in reqs}
    for layer, (b, a) in enumerate(zip(before_k, pool.k_buffers, strict=True)):
        changed = set(
            torch.nonzero((a.view(-1, *a.shape[2:]) != b.view(-1, *b.shape[2:])).any(-1).any(-1))
            .flatten()
            .tolist()
        )
        scratch = set(range(pool.scratch_page * P, pool.scratch_page * P + P))
        assert changed - scratch == new, f"layer {layer}"
        assert changed & scratch, "the padding row wrote nothing"
    assert all(pool.scratch_page not in r.pages.tensor().tolist() for r in reqs)
    assert pool.scratch_page == pool.num_pages  # past the allocator's range
    # the same step eagerly: the same K/V slots, the same logits
    eng.runner.graphs = None
    eager = eng.runner.decode(reqs)
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    assert padded.shape == (3, eager.shape[1])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 16),
    st.lists(st.integers(1, 40), min_size=1, max_size=6),
    st.integers(0, 3),
    st.randoms(use_true_random=False),
)
def test_padded_rows_equal_build_metadata(page_size, seqs, extra, rnd) -> None:
    # the real rows of a padded batch are build_metadata's decode batch, row for row
    max_pages = -(-40 // page_size)
    pages = list(range(len(seqs) * max_pages))
    rnd.shuffle(pages)
    tables = [pages[i * max_pages : (i + 1) * max_pages] for i in range(len(seqs))]
    bucket = len(seqs) + extra
    bufs = PaddedDecodeBuffers(10, max_pages, page_size, scratch_page=999)
    ids = [rnd.randrange(100) for _ in seqs]
    got = bufs.fill(tables, seqs, ids, bucket)
    want = build_metadata(tables, [s - 1 for s in seqs], [1] * len(seqs), page_size)
    n = len(seqs)
    assert torch.equal(got.kv_indptr[: n + 1], want.kv_indptr)
    assert torch.equal(got.kv_indices[: int(want.kv_indptr[-1])], want.kv_indices)
    assert torch.equal(got.kv_last_page_len[:n], want.kv_last_page_len)
    assert torch.equal(got.out_cache_loc[:n], want.out_cache_loc)
    assert torch.equal(got.positions[:n], want.positions)
    assert got.seq_lens[:n] == want.seq_lens and bufs.input_ids[:n].tolist() == ids
    # padding rows: one token each, on the scratch page
    assert got.kv_indices[int(want.kv_indptr[-1]) :].tolist() == [999] * extra
    assert got.out_cache_loc[n:].tolist() == [999 * page_size] * extra
    assert torch.equal(
        got.kv_indptr[n:] - got.kv_indptr[n], torch.arange(extra + 1, dtype=torch.int32)
    )
    assert got.host_pages[0].tolist() == got.kv_indptr.tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_tokens_equal_eager_across_buckets(make_engine, imgs, page_size) -> None:
    # 11 requests of different lengths: the batch shrinks through buckets 16, 8, 4, 2, 1
    cases = workload(imgs) + [
        (user(None, QUESTIONS[k % 3] + f" {k}"), [imgs[k % 4]]) for k in range(3)
    ]
    results = []
    for cfg in ({}, TWIN):
        eng = make_engine(page_size=page_size, **cfg)
        msgs = [
            eng.processor.make_request(
                messages=m, images=i, params=greedy(3 + 2 * k, ignore_eos=True)
            )
            for k, (m, i) in enumerate(cases)
        ]
        results.append(eng.generate(msgs))
        eng.scheduler.check_accounting()
    assert set(eng.runner.graphs.replays_by_bucket) >= {1, 2, 4, 8, 16}
    same(results[1], results[0], "twin")
    assert [len(r.output_ids) for r in results[1]] == [3 + 2 * k for k in range(len(cases))]


def test_retraction_with_the_twin(make_engine, imgs) -> None:
    cases = [(user(None, QUESTIONS[k % 3] + f" {k}"), [imgs[k % 4]]) for k in range(12)]
    _, base = run_workload(make_engine, cases, max_tokens=24, disable_radix_cache=True)
    tight = {"page_size": 4, "max_total_tokens": 4 * 330, "decode_reserve_ratio": 0.0}
    eng, res = run_workload(make_engine, cases, max_tokens=24, **tight, **TWIN)
    assert eng.scheduler.retractions > 0 and eng.runner.graphs.replays > 0
    same(res, base, "retracted twin")


def test_seeded_sampling_and_n_copies_with_the_twin(make_engine, imgs) -> None:
    # n = 3 choices as the API makes them: one prompt, seeds seed, seed + 1, seed + 2
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    outs = []
    for cfg in ({}, TWIN):
        eng = make_engine(**cfg)
        msgs = [
            eng.processor.make_request(
                messages=user(None, QUESTIONS[q]),
                images=[imgs[q]],
                params=dataclasses.replace(params, seed=params.seed + i),
            )
            for q in range(2)
            for i in range(3)
        ]
        outs.append([r.output_ids for r in eng.generate(msgs)])
    assert eng.runner.graphs.replays > 0
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs[1][:3]}) > 1  # the copies' seeds differ


def test_structured_output_with_the_twin(make_engine, imgs) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["color", "count"],
    }
    specs = [GuidedSpec.json_schema(schema), GuidedSpec.choice(["yes", "no", "a red rocket"])]
    outs = []
    for cfg in ({}, TWIN):
        eng = make_engine(max_total_tokens=16384, **cfg)
        msgs = [
            eng.processor.make_request(
                messages=user(None, QUESTIONS[k % 3]),
                images=[imgs[k % 3]],
                params=SamplingParams(max_tokens=60, guided=spec, temperature=t, seed=k),
            )
            for k, (spec, t) in enumerate((s, t) for s in specs for t in (0.0, 1.0))
        ]
        outs.append([(r.output_ids, r.finish_reason) for r in eng.generate(msgs)])
    assert eng.runner.graphs.replays > 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", ["llava-next", "llava-onevision"])
def test_other_families_with_the_twin(families, photos, family: str) -> None:
    # LLaVA-1.5 is covered above; NeXT and OneVision (tiles, newline ids) take the same path
    fam = families[family]
    outs = []
    for cfg in ({}, TWIN):
        eng = fam.make_engine(**cfg)
        img = eng.processor.prepare_image(photos["cat.png"])
        msgs = [
            eng.processor.make_request(
                messages=user(*([None] if k % 2 else []), f"{QUESTIONS[k % 3]} {k}"),
                images=[img] if k % 2 else [],
                params=greedy(3 + 2 * k, ignore_eos=True),
            )
            for k in range(5)
        ]
        outs.append(eng.generate(msgs))
    assert eng.runner.graphs.replays > 0
    same(outs[1], outs[0], f"{family} twin")


def test_flashinfer_graph_wrappers_on_a_stand_in(make_engine, imgs, monkeypatch) -> None:
    # FlashInferAttentionBackend.plan_padded against FlashInfer's CUDA-graph contract
    # (tests/helpers.py FakeFlashInfer): one wrapper per bucket over the runner's fixed
    # buffers, planned from host copies, run from those buffers only
    fake = FakeFlashInfer()
    monkeypatch.setattr(fb, "import_flashinfer", lambda: fake)
    monkeypatch.setattr(fb, "SUPPORTED_DTYPES", (torch.float32,))
    eng = make_engine(page_size=4)
    shape = eng.model.decoder.shape
    fi = fb.FlashInferAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, "cpu", torch.float32, 1024
    )
    runner = DecodeGraphRunner(
        eng.model.decoder, fi, eng.pool, eng.runner.logit_mask, 8, 4096, capture=False
    )
    for k in range(5):
        msg = eng.processor.make_request(
            messages=user(None, f"{QUESTIONS[k % 3]} {k}"), images=[imgs[k % 3]], params=greedy(4)
        )
        eng.add_request(msg)
    while len(eng.scheduler.running) < 5:
        eng.step()
    reqs = list(eng.scheduler.running)
    eng.scheduler.prepare_decode()
    for batch in (reqs[:3], reqs, reqs[:3]):  # buckets 4, 8, 4 again (re-planned)
        args = ([r.pages for r in batch], [r.computed_len + 1 for r in batch])
        got = runner.run(*args, [r.output_ids[-1] for r in batch])
        want = eng.runner.decode(batch)  # eager, torch backend: rewrites the same slots
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    wrappers = [w for w, _, _ in fake.plans]
    assert wrappers[0] is wrappers[2] and wrappers[0] is not wrappers[1]
    assert sorted(fi._graph_decode) == [4, 8]
    b = runner.buffers  # the wrappers' fixed inputs are the runner's static buffers
    for w in wrappers[:2]:
        assert w.indptr.data_ptr() == b.kv_indptr.data_ptr()
        assert w.indices.data_ptr() == b.kv_indices.data_ptr()
        assert len(w.indices) == len(b.kv_indices) and len(w.indptr) == len(w.last) + 1
