"""The engine core: mixed steps against separate steps, batched sampling against row by
row, and per-step work that does not grow with the answer."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.engine.sampling import (
    batch_logprobs,
    make_generator,
    sample_batch,
    sample_token,
    token_logprob,
)
from mmserve.types import SamplingParams
from tests.helpers import greedy, user


def _long_and_short(make_engine, photos, **cfg):
    """Short requests decode while longer ones (an image, a long text) arrive and prefill
    in chunks; returns the engine and each request's output ids."""
    eng = make_engine(**cfg)
    img = next(iter(photos.values()))
    proc = eng.processor
    short = [
        proc.make_request(messages=user(f"Say something {i}."), images=[], params=greedy(24))
        for i in range(3)
    ]
    cols = [eng.track(r) for r in short]
    for _ in range(3):  # the short ones are running before the long ones arrive
        eng.step()
    long = [
        proc.make_request(
            messages=user(None, "Describe the picture in detail."),
            images=[proc.prepare_image(img)],
            params=greedy(10),
        ),
        proc.make_request(messages=user("word " * 300), images=[], params=greedy(10)),
    ]
    cols += [eng.track(r) for r in long]
    while eng.has_work():
        eng.step()
    eng.scheduler.check_accounting()
    return eng, [c.result.output_ids for c in cols]


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_steps_equal_separate_steps(make_engine, photos, page_size) -> None:
    cfg = {"page_size": page_size, "max_num_batched_tokens": 128, "max_total_tokens": 8192}
    mixed, out_mixed = _long_and_short(make_engine, photos, **cfg)
    apart, out_apart = _long_and_short(make_engine, photos, disable_mixed_steps=True, **cfg)
    assert out_mixed == out_apart
    assert all(len(o) > 0 for o in out_mixed)
    # the long prompts were prefilled in chunks while the short ones kept decoding
    assert mixed.stats.mixed_steps >= 3
    assert apart.stats.mixed_steps == 0


def test_a_chunk_never_exceeds_the_step_budget_while_streams_decode(make_engine, photos) -> None:
    eng = make_engine(max_num_batched_tokens=64, max_prefill_tokens=300)
    seen = []  # (tokens in the forward, whether requests were decoding)
    real = eng.runner.prefill

    def spy(reqs, extends):
        seen.append((sum(extends), bool(eng.scheduler.running)))
        return real(reqs, extends)

    eng.runner.prefill = spy
    first = eng.processor.make_request(messages=user("hi"), images=[], params=greedy(40))
    col = eng.track(first)
    eng.step()  # prefilled alone: it decodes from now on
    cols = [
        eng.track(eng.processor.make_request(messages=user("word " * 200), params=greedy(4)))
        for _ in range(2)
    ]
    while eng.has_work():
        eng.step()
    assert col.finished and all(c.finished for c in cols)
    mixed = [n for n, decoding in seen if decoding]
    assert mixed and max(mixed) <= 64  # decode tokens plus chunks within the budget
    # with nothing decoding a step may prefill up to max_prefill_tokens
    assert seen[0][0] <= 300 and not seen[0][1]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    rows=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, 1.0, 1.7]),  # temperature
            st.sampled_from([-1, 1, 5, 50]),  # top_k
            st.sampled_from([1.0, 0.9, 0.3]),  # top_p
            st.sampled_from([None, 0, 3]),  # logprobs
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_batched_sampling_equals_row_by_row(seed: int, rows) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), 97, generator=g) * 3
    logits[:, :5] = float("-inf")  # never-sampled ids
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=seed + i, logprobs=lp)
        for i, (t, k, p, lp) in enumerate(rows)
    ]
    batch = sample_batch(logits, params, [make_generator(p, "cpu") for p in params])
    single = [sample_token(logits[i], p, make_generator(p, "cpu")) for i, p in enumerate(params)]
    assert batch == single
    lps = batch_logprobs(logits, batch, [p.logprobs for p in params])
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert lps[i] is None
            continue
        ref = token_logprob(logits[i], batch[i], p.logprobs)
        assert lps[i].token_id == ref.token_id
        assert lps[i].logprob == pytest.approx(ref.logprob, abs=1e-6)
        assert [t for t, _ in lps[i].top] == [t for t, _ in ref.top]


def _calls_in_one_step(eng) -> int:
    calls = 0

    def prof(frame, event, arg) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(prof)
    try:
        eng.step()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("page_size", [1, 16])
def test_per_step_work_does_not_grow_with_the_answer(make_engine, page_size) -> None:
    """A counting test: Python calls made by one decode step (engine, sampling, the
    delta, the front end's collector) at 40 output tokens and at 1,500."""
    eng = make_engine(page_size=page_size, max_total_tokens=4096)
    params = SamplingParams(max_tokens=1600, temperature=0.0, ignore_eos=True, logprobs=2)
    req = eng.processor.make_request(messages=user("Tell a story."), images=[], params=params)
    col = eng.track(req)
    (state,) = eng.live_requests()
    counts = {}
    while not col.finished:
        n = len(state.output_ids)
        if n in (40, 41, 42, 1500, 1501, 1502):
            counts[n] = _calls_in_one_step(eng)
        else:
            eng.step()
    early = [counts[n] for n in (40, 41, 42)]
    late = [counts[n] for n in (1500, 1501, 1502)]
    assert max(late) <= max(early) * 1.05 + 5, (early, late)
    assert len(col.result.output_ids) == 1600
