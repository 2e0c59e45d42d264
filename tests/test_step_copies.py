"""Host-to-device copies per eager step (issue 48.6): a step's page table, positions, K/V
slots, token ids and logit rows are built on the host in one buffer and copied once, so
an eager decode, prefill or mixed step makes one copy whatever its number of requests,
and the planners get host copies of indptr / last-page lengths (no copy back).

The copies are counted two ways: on the "meta" device (every tensor crossing from the
CPU to it is a host-to-device copy: ``Tensor.to``, ``copy_`` and ``torch.tensor(...,
device=)`` are watched), and through the engine on the CPU, where every step's copy
goes through :func:`mmserve.kernels.metadata.to_device`.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mmserve.engine.model_runner import ModelRunner
from mmserve.kernels import flashinfer_backend as fb
from mmserve.kernels import metadata
from mmserve.kernels.metadata import build_metadata
from tests.helpers import FakeFlashInfer, greedy, user


@pytest.fixture
def crossings(monkeypatch) -> list[str]:
    """Records every CPU -> other-device transfer (what was called)."""
    seen: list[str] = []
    to, copy_, tensor = torch.Tensor.to, torch.Tensor.copy_, torch.tensor

    def watched_to(self, *a, **kw):
        dev = torch._C._nn._parse_to(*a, **kw)[0]
        if dev is not None and dev.type != self.device.type and self.device.type == "cpu":
            seen.append("to")
        return to(self, *a, **kw)

    def watched_copy(self, src, non_blocking=False):
        if src.device.type == "cpu" and self.device.type != "cpu":
            seen.append("copy_")
        return copy_(self, src, non_blocking)

    def watched_tensor(data, *a, device=None, **kw):
        if device is not None and torch.device(device).type != "cpu":
            seen.append("tensor")
        return tensor(data, *a, device=device, **kw)

    monkeypatch.setattr(torch.Tensor, "to", watched_to)
    monkeypatch.setattr(torch.Tensor, "copy_", watched_copy)
    monkeypatch.setattr(torch, "tensor", watched_tensor)
    return seen


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_build_metadata_copies_once(crossings, n: int, kind: str) -> None:
    P = 4
    extend = {"decode": [1] * n, "prefill": [7] * n, "mixed": [1, 9] * (n // 2) or [5]}[kind]
    prefix = [i % 5 * 3 for i in range(len(extend))]
    tables = [list(range(10 * i, 10 * i + 8)) for i in range(len(extend))]
    ids = list(range(sum(extend)))
    meta = build_metadata(tables, prefix, extend, P, "meta", ids)
    assert crossings == ["to"]
    for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
              meta.out_cache_loc, meta.positions, meta.logit_rows, meta.input_ids):  # fmt: skip
        assert t is not None and t.device.type == "meta"
    # the host copies hold the same values the CPU build puts on its device
    ref = build_metadata(tables, prefix, extend, P, "cpu", ids)
    assert meta.host_pages is not None and meta.host_qo_indptr is not None
    assert meta.host_pages[0].device.type == "cpu"
    assert torch.equal(meta.host_pages[0], ref.kv_indptr)
    assert torch.equal(meta.host_pages[1], ref.kv_last_page_len)
    assert torch.equal(meta.host_qo_indptr, ref.qo_indptr)
    assert torch.equal(ref.logit_rows, ref.qo_indptr[1:].long() - 1)
    assert torch.equal(ref.input_ids, torch.tensor(ids))


def test_flashinfer_plans_from_host_copies(monkeypatch, crossings) -> None:
    """The FlashInfer backend hands its wrappers the host indptr / last-page lengths
    (FlashInfer reads them on the host: device ones would be copied back)."""
    fake = FakeFlashInfer()
    plans: list[tuple[str, ...]] = []

    class Prefill(fake.BatchPrefillWithPagedKVCacheWrapper):
        def plan(self, qo, indptr, indices, last, *a, **kw) -> None:
            plans.append(tuple(t.device.type for t in (qo, indptr, indices, last)))

    fake.BatchPrefillWithPagedKVCacheWrapper = Prefill
    monkeypatch.setattr(fb, "import_flashinfer", lambda: fake)
    monkeypatch.setattr(fb, "SUPPORTED_DTYPES", (torch.float32,))
    fi = fb.FlashInferAttentionBackend(4, 2, 8, "meta", torch.float32, 1024)
    fi.plan(build_metadata([[1, 2], [3]], [0, 0], [1, 1], 4, "meta", [5, 6]))
    assert fake.plans[-1][1:] == ("cpu", "cpu")  # decode: indptr, last_page_len
    fi.plan(build_metadata([[1, 2], [3]], [0, 0], [5, 2], 4, "meta", [0] * 7))
    assert plans == [("cpu", "cpu", "meta", "cpu")]
    assert crossings == ["to", "to"]  # one per step, FlashInfer's planning none


@pytest.mark.parametrize("n", [1, 4, 16])
def test_engine_steps_copy_once(make_engine, monkeypatch, n: int) -> None:
    """Eager decode, prefill and mixed steps of ``n`` requests (then ``n`` more arriving
    while they decode): one copy per forward, and no ``torch.tensor(device=...)`` in the
    runner or the metadata builder."""
    copies: list[int] = []
    forwards: list[tuple[bool, bool]] = []  # (has decode rows, has prefill chunks)
    real_copy, real_run, real_tensor = metadata.to_device, ModelRunner._run, torch.tensor

    def to_device(host, device):
        copies.append(1)
        return real_copy(host, device)

    def run(self, meta, embeds):
        forwards.append((1 in meta.extend_lens, any(e > 1 for e in meta.extend_lens)))
        return real_run(self, meta, embeds)

    def tensor(data, *a, device=None, **kw):
        caller = sys._getframe(1).f_globals["__name__"]
        if caller in ("mmserve.engine.model_runner", "mmserve.kernels.metadata"):
            assert device is None, f"{caller} made a tensor on the device from Python data"
        return real_tensor(data, *a, device=device, **kw)

    eng = make_engine(max_running_requests=32)
    monkeypatch.setattr(metadata, "to_device", to_device)
    monkeypatch.setattr(ModelRunner, "_run", run)

    def add(k: int) -> None:
        for i in range(n):
            eng.add_request(
                eng.processor.make_request(
                    messages=user(f"Tell me {k} {i}."), images=[], params=greedy(6)
                )
            )

    def step() -> None:
        copies.clear()
        forwards.clear()
        with monkeypatch.context() as m:
            m.setattr(torch, "tensor", tensor)
            eng.step()
        assert len(copies) == len(forwards) <= 1  # one forward per step here
        kinds.update(forwards)

    kinds: set[tuple[bool, bool]] = set()
    add(0)
    for _ in range(3):
        step()
    add(1)
    for _ in range(40):
        if not eng.has_work():
            break
        step()
    assert kinds == {(True, False), (False, True), (True, True)}  # decode, prefill, mixed
