"""Memory of the decode graphs and the KV tiers (issue 48.7): every CUDA-graph bucket
writes its logits into one shared buffer of the largest bucket's rows (checked on the CPU
twin, which runs the same buffers), and pages loaded from the disk tier are stacked into
one host buffer, page-locked on CUDA (a stand-in for pinning on the CPU), never pinned
one by one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmserve.cache.kv_pool import KVPool
from mmserve.cache.kv_tiers import KVTiers, kv_namespace
from mmserve.cache.kv_tiers import tiers as tiers_mod
from tests.helpers import greedy, user


def test_graph_buckets_share_one_logits_buffer(make_engine) -> None:
    eng = make_engine(page_size=4, cuda_graph_twin=True, cuda_graph_max_bs=16)
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.max_bs == 16
    vocab = eng.model.decoder.shape.vocab_size
    assert graphs.logits.shape == (16, vocab) and graphs.logits.dtype == torch.float32
    for k in range(5):
        req = eng.processor.make_request(
            messages=user(f"Count to {k + 3}."), images=[], params=greedy(6)
        )
        eng.add_request(req)
    while len(eng.scheduler.running) < 5:
        eng.step()
    reqs = list(eng.scheduler.running)
    eng.scheduler.prepare_decode()
    first = eng.runner.decode(reqs[:1])  # bucket 1
    kept = first.clone()
    eng.runner.decode(reqs[:3])  # bucket 4
    eng.runner.decode(reqs)  # bucket 8
    assert sorted(graphs.outputs) == [1, 4, 8]
    base = graphs.logits.untyped_storage().data_ptr()
    for bucket, out in graphs.outputs.items():
        assert out.shape == (bucket, vocab)
        assert out.data_ptr() == graphs.logits.data_ptr()  # its leading rows
        assert out.untyped_storage().data_ptr() == base  # no buffer of its own
    assert torch.equal(first, kept)  # a result is a copy: later buckets do not touch it
    # the shared buffer's values are the ones eager decode computes
    padded = eng.runner.decode(reqs[:3])
    eng.runner.graphs = None
    torch.testing.assert_close(padded, eng.runner.decode(reqs[:3]), rtol=1e-4, atol=1e-4)


def _tiers(tmp_path: Path) -> tuple[KVTiers, KVPool]:
    pool = KVPool(8, 2, 1, 1, 2)
    ns = kv_namespace(b"s" * 16, torch.float32, 2, ("NHD", 1, 1, 2))
    return KVTiers(pool, ns, disk_dir=str(tmp_path)), pool


def test_disk_pages_stack_into_one_pinned_buffer(tmp_path: Path, monkeypatch) -> None:
    tiers, pool = _tiers(tmp_path)
    tiers.pin = True  # as on CUDA
    made: list[tuple[torch.Tensor, bool]] = []
    pins: list[int] = []

    def host_buffer(shape, dtype, pin):  # the stand-in for page-locked memory
        t = torch.empty(tuple(shape), dtype=dtype)
        made.append((t, pin))
        return t

    monkeypatch.setattr(tiers_mod, "host_buffer", host_buffer)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pins.append(1) or self)
    keys = [k.to_bytes(16, "little") for k in range(3)]
    pages = [torch.full(tiers.page_shape, float(k + 1)) for k in range(3)]
    for k, p in zip(keys, pages, strict=True):
        tiers.disk.write(k, p)
    tiers.disk.flush()
    assert tiers.start_load("r", keys, [])
    for _ in range(2000):  # the loader thread's read, bounded to ~20 s
        if tiers.poll() or not tiers.pending():
            break
        tiers.wait(0.01)
    taken = tiers.take(keys)
    assert len(taken) == 3 and pins == []  # never pinned page by page
    made.clear()
    out = tiers.stack_pages(taken)
    assert len(made) == 1 and made[0][1] is True and out is made[0][0]
    assert out.shape == (3, *tiers.page_shape) and torch.equal(out, torch.stack(pages))
    # the pool takes them from that buffer
    pool.write_pages([0, 1, 2], out)
    assert torch.equal(pool.read_pages([0, 1, 2]), torch.stack(pages))
    tiers.close()


def test_stacking_without_cuda_is_not_pinned(tmp_path: Path) -> None:
    tiers, _ = _tiers(tmp_path)
    assert tiers.pin is False  # a CPU pool
    out = tiers.stack_pages([torch.zeros(tiers.page_shape), torch.ones(tiers.page_shape)])
    assert out.shape == (2, *tiers.page_shape) and not out.is_pinned()
    assert torch.equal(out[1], torch.ones(tiers.page_shape))
    tiers.close()
