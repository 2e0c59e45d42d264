"""Per-token log-probabilities: the chosen token's, the top alternatives, and their limits."""

from __future__ import annotations

import pytest
import torch

from mmserve.types import SamplingParams
from tests.helpers import user


def test_greedy_logprobs_match_the_logits(make_engine) -> None:
    engine = make_engine(max_total_tokens=2048)
    params = SamplingParams(max_tokens=5, temperature=0.0, return_logits=True, logprobs=3)
    req = engine.processor.make_request(messages=user("Count to five."), params=params)
    (res,) = engine.generate([req])
    assert len(res.logprobs) == res.completion_tokens == 5
    for tok, lp, logits in zip(res.output_ids, res.logprobs, res.logits, strict=True):
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-5)
        assert len(lp.top) == 3
        # greedy: the chosen token is the most likely one
        assert lp.top[0] == (tok, pytest.approx(lp.logprob, abs=1e-6))
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert sum(torch.tensor([v for _, v in lp.top]).exp().tolist()) <= 1.0 + 1e-5


def test_sampled_logprobs_are_of_the_unscaled_distribution(make_engine) -> None:
    engine = make_engine(max_total_tokens=2048)
    params = SamplingParams(max_tokens=3, temperature=1.5, seed=7, return_logits=True, logprobs=0)
    (res,) = engine.generate([engine.processor.make_request(messages=user("Hi"), params=params)])
    for tok, lp, logits in zip(res.output_ids, res.logprobs, res.logits, strict=True):
        assert lp.top == []
        assert lp.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[tok]), abs=1e-5)


def test_logprobs_off_by_default_and_bounded(make_engine) -> None:
    engine = make_engine(max_total_tokens=2048)
    (res,) = engine.generate([engine.processor.make_request(messages=user("Hi"))])
    assert res.logprobs is None
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=21).validate()
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=-1).validate()


def test_any_integer_seed_is_accepted(make_engine) -> None:
    engine = make_engine(max_total_tokens=2048)
    outs = []
    for seed in (-1, 2**64 - 1, 2**70 - 1):
        p = SamplingParams(max_tokens=3, temperature=1.0, seed=seed)
        (res,) = engine.generate([engine.processor.make_request(messages=user("Hi"), params=p)])
        outs.append(res.output_ids)
    # -1 and 2**64-1 are the same 64-bit seed, as are 2**70-1 and 2**64-1
    assert outs[0] == outs[1] == outs[2]
