"""Liveness: every request ends with no other traffic, whatever state it is in.

A request between prefill chunks once stopped the engine loop (it was neither
waiting nor running), so a lone long prompt hung until another request came.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.frontend.async_engine import AsyncEngine
from mmserve.types import SamplingParams
from tests.helpers import user

WORDS = "red green blue cat dog sky tree house water light dark small big".split()


@pytest.fixture(scope="module")
def imgs(make_engine, photos):
    eng = make_engine()
    return [eng.processor.prepare_image(b) for b in list(photos.values())[:2]]


def _case(data, imgs):
    n_words = data.draw(st.integers(1, 160), label="words")
    text = " ".join(WORDS[(i * 7 + n_words) % len(WORDS)] for i in range(n_words))
    n_img = data.draw(st.integers(0, 2), label="images")
    parts = [None] * n_img + [text]
    return user(*parts), [imgs[k % len(imgs)] for k in range(n_img)]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_lone_requests_and_bursts_always_finish(make_engine, imgs, data) -> None:
    page_size = data.draw(st.sampled_from([1, 4, 16]), label="page_size")
    cfg = {
        "page_size": page_size,
        "max_prefill_tokens": data.draw(st.integers(16, 700), label="prefill budget"),
        "max_total_tokens": page_size
        * data.draw(st.integers(1400 // page_size, 4000 // page_size)),
        "max_running_requests": data.draw(st.integers(1, 4), label="running limit"),
        "disable_radix_cache": data.draw(st.booleans(), label="cache off"),
        "decode_reserve_ratio": data.draw(st.sampled_from([0.0, 0.6, 1.0])),
    }
    eng = make_engine(**cfg)
    n = data.draw(st.integers(1, 4), label="burst size")
    reqs = []
    for _ in range(n):
        msgs, images = _case(data, imgs)
        params = SamplingParams(max_tokens=data.draw(st.integers(1, 6)), ignore_eos=True)
        reqs.append(eng.processor.make_request(messages=msgs, images=images, params=params))
    cols = [eng.track(r) for r in reqs]
    # drive the engine as the server loop does: step while it says there is work
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        assert steps < 2000, f"engine never went idle: {cfg}"
    assert all(c.finished for c in cols), (cfg, [c.result for c in cols])
    assert [c.result.finish_reason for c in cols] == ["length"] * n
    assert [len(c.result.output_ids) for c in cols] == [r.params.max_tokens for r in reqs]
    acc = eng.scheduler.check_accounting()
    assert acc["running"] == 0
    assert not eng.live_requests()


def test_generate_finishes_a_prompt_longer_than_the_budget(make_engine, imgs) -> None:
    eng = make_engine(max_prefill_tokens=200)
    req = eng.processor.make_request(
        messages=user(None, "What is it?"), images=imgs[:1], params=SamplingParams(max_tokens=4)
    )
    assert req.prompt_len > 2 * 200
    (res,) = eng.generate([req])
    assert res.finish_reason in ("stop", "length")
    assert res.completion_tokens >= 1
    assert eng.stats.prefill_steps >= 3


def test_async_engine_finishes_a_lone_chunked_request(make_engine, imgs) -> None:
    eng = make_engine(max_prefill_tokens=200)
    aeng = AsyncEngine(eng)
    aeng.start()
    try:
        req = eng.processor.make_request(
            messages=user(None, None, None, None, "Compare them."),
            images=[imgs[k % 2] for k in range(4)],
            params=SamplingParams(max_tokens=4, ignore_eos=True),
        )
        res = asyncio.run(asyncio.wait_for(aeng.generate(req), timeout=60))
    finally:
        aeng.stop()
    assert res.finish_reason == "length"
    assert res.completion_tokens == 4
    eng.scheduler.check_accounting()
