"""Sampling values at the edge of fp32 (found by the HTTP fuzzer) never break the engine."""

from __future__ import annotations

import pytest

from mmserve.types import SamplingParams
from tests.helpers import user


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1e-300},
        {"temperature": 1e-6},
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 1.0, "top_p": 5e-324},
        {"temperature": 2.0, "top_p": 1e-8},
        {"temperature": 2.0, "top_k": 1},
    ],
)
def test_degenerate_sampling_is_greedy(make_engine, kw) -> None:
    engine = make_engine(max_total_tokens=2048)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    (ref,) = engine.generate([engine.processor.make_request(messages=user("Hi"), params=greedy)])
    params = SamplingParams(max_tokens=4, seed=3, **kw)
    (res,) = engine.generate([engine.processor.make_request(messages=user("Hi"), params=params)])
    assert res.finish_reason == "length"
    assert res.output_ids == ref.output_ids
    assert engine.scheduler.check_accounting()["running"] == 0
