"""Scheduling policies, chunked prefill, retraction and the starvation guard (invariant 4)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from mmserve.cache.radix_cache import RadixCache
from mmserve.engine.policy import order_waiting
from mmserve.engine.request import SamplingParams
from tests.helpers import QUESTIONS, assert_same_generation, run_workload, user, workload


@pytest.fixture(scope="module")
def imgs(make_engine, photos):  # noqa: ANN001, ANN201
    eng = make_engine()
    return [eng.processor.prepare_image(b) for b in photos.values()]


@pytest.fixture(scope="module")
def baseline(make_engine, imgs):  # noqa: ANN001, ANN201
    _, res = run_workload(make_engine, workload(imgs), disable_radix_cache=True)
    return res


def same(results, base, what: str) -> None:  # noqa: ANN001
    for k, (a, b) in enumerate(zip(results, base, strict=True)):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, f"{what} #{k}")


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs", "random"])
def test_every_policy_gives_the_same_outputs(make_engine, imgs, baseline, policy) -> None:  # noqa: ANN001
    eng, res = run_workload(make_engine, workload(imgs), policy=policy)
    same(res, baseline, policy)
    assert sum(r.cached_tokens for r in res) > 0


def test_chunked_prefill_same_outputs(make_engine, imgs, baseline) -> None:  # noqa: ANN001
    eng, res = run_workload(make_engine, workload(imgs), max_prefill_tokens=100, page_size=4)
    same(res, baseline, "chunked")
    # a 576-token image needs several 100-token chunks, so more prefill steps than requests
    assert eng.stats.prefill_steps > len(res)


def test_chunks_avoid_splitting_an_image_when_they_can(make_engine, imgs) -> None:  # noqa: ANN001
    eng = make_engine()
    msg = eng.processor.make_request(messages=user("Look:", None, "What?"), images=[imgs[0]])
    req = eng.request_state(msg)
    span = req.spans[0]
    assert span.start > 2
    # a budget that would end inside the image stops at its start instead
    assert eng.scheduler._chunk(req, 0, span.start + 10) == span.start
    # starting at the image, a budget smaller than the image must split it
    assert eng.scheduler._chunk(req, span.start, 100) == 100


def test_retraction_resumes_with_identical_output(make_engine, imgs) -> None:  # noqa: ANN001
    cases = [(user(None, QUESTIONS[k % 3] + f" {k}"), [imgs[k % 4]]) for k in range(12)]
    _, base = run_workload(make_engine, cases, max_tokens=24, disable_radix_cache=True)
    # reserve nothing for decode and leave little room: decode must run out and retract
    eng, res = run_workload(
        make_engine,
        cases,
        max_tokens=24,
        page_size=4,
        max_total_tokens=4 * 330,
        decode_reserve_ratio=0.0,
    )
    assert eng.scheduler.retractions > 0
    same(res, base, "retracted")
    assert all(r.finish_reason in ("length", "stop") for r in res)
    acc = eng.scheduler.check_accounting()
    assert acc["running"] == 0


def test_retraction_keeps_seeded_sampling(make_engine, imgs) -> None:  # noqa: ANN001
    def params(k: int) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=k, ignore_eos=True)

    outs = []
    for cfg in ({}, {"page_size": 4, "max_total_tokens": 4 * 330, "decode_reserve_ratio": 0.0}):
        eng = make_engine(**cfg)
        reqs = [
            eng.processor.make_request(
                messages=user(None, QUESTIONS[k % 3] + f" {k}"),
                images=[imgs[k % 4]],
                params=params(k),
            )
            for k in range(12)
        ]
        outs.append([r.output_ids for r in eng.generate(reqs)])
        if cfg:
            assert eng.scheduler.retractions > 0
    assert outs[0] == outs[1]


def _item(arrival: float, length: int, node=None):  # noqa: ANN001, ANN202
    return (SimpleNamespace(arrival=arrival), SimpleNamespace(length=length, last_node=node))


def test_lpm_orders_by_match_and_starved_go_first() -> None:
    items = [_item(0.0, 10), _item(1.0, 500), _item(2.0, 500), _item(3.0, 0)]
    rng = random.Random(0)
    got = order_waiting(items, "lpm", now=5.0, max_wait=100.0, rng=rng, cache_on=True)
    assert [it[0].arrival for it in got] == [1.0, 2.0, 0.0, 3.0]
    # waited 4.5 s > 4 s: the first two arrivals jump the queue in arrival order
    got = order_waiting(items, "lpm", now=4.5, max_wait=4.0, rng=rng, cache_on=True)
    assert [it[0].arrival for it in got] == [0.0, 1.0, 2.0, 3.0]
    # cache off: cache-aware policies are FCFS
    got = order_waiting(items, "lpm", now=5.0, max_wait=100.0, rng=rng, cache_on=False)
    assert [it[0].arrival for it in got] == [0.0, 1.0, 2.0, 3.0]


def test_dfs_weight_visits_heavier_subtrees_first() -> None:
    tree = RadixCache(1, lambda pages: None)
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([1, 2, 4], [3, 4, 5])
    tree.insert([7, 8], [6, 7])
    a = tree.match_prefix([1, 2, 3]).last_node
    b = tree.match_prefix([1, 2, 4]).last_node
    c = tree.match_prefix([7, 8]).last_node
    root = tree.root
    # subtree [1, 2] holds 3 waiting requests (a, b, b), [7, 8] one, the root one;
    # children come before a node's own requests (post-order)
    items = [
        _item(0.0, 2, c),
        _item(1.0, 3, a),
        _item(2.0, 3, b),
        _item(3.0, 3, b),
        _item(4.0, 0, root),
    ]
    got = order_waiting(items, "dfs-weight", 5.0, 100.0, random.Random(0), cache_on=True)
    arrivals = [it[0].arrival for it in got]
    assert arrivals[:2] == [2.0, 3.0]  # node b (weight 2) before node a (weight 1)
    assert arrivals[2:4] == [1.0, 0.0]  # then a, then the lighter [7, 8] subtree
    assert arrivals[4] == 4.0  # requests matching only the root come last


def test_random_policy_is_a_seeded_permutation() -> None:
    items = [_item(float(k), 0) for k in range(8)]
    one = order_waiting(items, "random", 0.0, 100.0, random.Random(3), cache_on=True)
    two = order_waiting(items, "random", 0.0, 100.0, random.Random(3), cache_on=True)
    assert [i[0].arrival for i in one] == [i[0].arrival for i in two]
    assert sorted(i[0].arrival for i in one) == [float(k) for k in range(8)]
    assert [i[0].arrival for i in one] != [float(k) for k in range(8)]


def test_unknown_policy_is_refused(make_engine) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="unknown policy 'sjf'"):
        make_engine(policy="sjf")


def test_running_limit_queues_without_changing_outputs(make_engine, imgs, baseline) -> None:  # noqa: ANN001
    eng, res = run_workload(make_engine, workload(imgs), max_running_requests=2)
    same(res, baseline, "max_running_requests=2")
    # at most two decode together: (6 - 1) decode steps per pair of requests
    free, _ = run_workload(make_engine, workload(imgs))
    assert eng.stats.decode_steps == 5 * len(res) // 2 > free.stats.decode_steps
