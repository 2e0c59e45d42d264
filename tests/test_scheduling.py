"""Scheduling policies, chunked prefill, retraction and the starvation guard (invariant 4)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.cache.radix_cache import RadixCache
from mmserve.engine.policy import order_waiting
from mmserve.types import BACKGROUND, INTERACTIVE, SamplingParams
from tests.helpers import QUESTIONS, assert_same_generation, greedy, run_workload, user, workload


@pytest.fixture(scope="module")
def imgs(make_engine, photos):
    eng = make_engine()
    return [eng.processor.prepare_image(b) for b in photos.values()]


@pytest.fixture(scope="module")
def baseline(make_engine, imgs):
    _, res = run_workload(make_engine, workload(imgs), disable_radix_cache=True)
    return res


def same(results, base, what: str) -> None:
    for k, (a, b) in enumerate(zip(results, base, strict=True)):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, f"{what} #{k}")


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs", "random"])
def test_every_policy_gives_the_same_outputs(make_engine, imgs, baseline, policy) -> None:
    eng, res = run_workload(make_engine, workload(imgs), policy=policy)
    same(res, baseline, policy)
    assert sum(r.cached_tokens for r in res) > 0


def test_chunked_prefill_same_outputs(make_engine, imgs, baseline) -> None:
    eng, res = run_workload(make_engine, workload(imgs), max_prefill_tokens=100, page_size=4)
    same(res, baseline, "chunked")
    # a 576-token image needs several 100-token chunks, so more prefill steps than requests
    assert eng.stats.prefill_steps > len(res)


def test_chunks_avoid_splitting_an_image_when_they_can(make_engine, imgs) -> None:
    eng = make_engine()
    msg = eng.processor.make_request(messages=user("Look:", None, "What?"), images=[imgs[0]])
    req = eng.request_state(msg)
    span = req.spans[0]
    assert span.start > 2
    # a budget that would end inside the image stops at its start instead
    assert eng.scheduler._chunk(req, 0, span.start + 10) == span.start
    # starting at the image, a budget smaller than the image must split it
    assert eng.scheduler._chunk(req, span.start, 100) == 100


def test_retraction_resumes_with_identical_output(make_engine, imgs) -> None:
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


def test_retraction_keeps_seeded_sampling(make_engine, imgs) -> None:
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


def _item(arrival: float, length: int, node=None, priority: int = 0):
    return (
        SimpleNamespace(arrival=arrival, priority=priority),
        SimpleNamespace(length=length, last_node=node),
    )


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


def test_unknown_policy_is_refused(make_engine) -> None:
    with pytest.raises(ValueError, match="unknown policy 'sjf'"):
        make_engine(policy="sjf")


def test_running_limit_queues_without_changing_outputs(make_engine, imgs, baseline) -> None:
    eng, res = run_workload(make_engine, workload(imgs), max_running_requests=2)
    same(res, baseline, "max_running_requests=2")
    # at most two decode together: (6 - 1) decode steps per pair of requests
    free, _ = run_workload(make_engine, workload(imgs))
    assert eng.stats.decode_steps == 5 * len(res) // 2 > free.stats.decode_steps


def test_interactive_requests_go_before_background_ones() -> None:
    # background requests with long matches arrived first; interactive ones still lead,
    # each class in the policy's order, and a starved background request leads them all
    items = [
        _item(0.0, 500, priority=BACKGROUND),
        _item(1.0, 900, priority=BACKGROUND),
        _item(2.0, 10, priority=INTERACTIVE),
        _item(3.0, 40, priority=INTERACTIVE),
    ]
    got = order_waiting(items, "lpm", 5.0, 100.0, random.Random(0), cache_on=True)
    assert [it[0].arrival for it in got] == [3.0, 2.0, 1.0, 0.0]
    got = order_waiting(items, "fcfs", 5.0, 100.0, random.Random(0), cache_on=True)
    assert [it[0].arrival for it in got] == [2.0, 3.0, 0.0, 1.0]
    got = order_waiting(items, "lpm", 5.5, 5.2, random.Random(0), cache_on=True)
    assert [it[0].arrival for it in got] == [0.0, 3.0, 2.0, 1.0]


def _tree_items(draw_items: list[tuple[int, int, int]]):
    """Waiting items over a small radix tree: ``(path, priority, arrival)`` each."""
    tree = RadixCache(1, lambda pages: None)
    paths = [[1, 2, 3], [1, 2, 4], [1, 5], [7, 8], []]
    for k, path in enumerate(paths[:-1]):
        tree.insert(path, list(range(10 * k, 10 * k + len(path))))
    items = []
    for path, priority, arrival in draw_items:
        m = tree.match_prefix(paths[path])
        r = SimpleNamespace(arrival=float(arrival), priority=priority)
        items.append((r, SimpleNamespace(length=m.length, last_node=m.last_node)))
    items.sort(key=lambda it: it[0].arrival)
    return items


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 50)),
        max_size=24,
    ),
    st.sampled_from(["lpm", "dfs-weight", "fcfs", "random"]),
    st.integers(1, 60),
    st.booleans(),
)
def test_order_waiting_priority_classes_property(raw, policy, max_wait, cache_on) -> None:
    items = _tree_items(raw)
    now = 50.0
    got = order_waiting(items, policy, now, float(max_wait), random.Random(1), cache_on)
    assert sorted(map(id, got)) == sorted(map(id, items))  # a permutation
    starved = [it for it in items if now - it[0].arrival > max_wait]
    # the starvation bound: every starved request first, oldest first, whatever its class
    assert got[: len(starved)] == starved
    rest = got[len(starved) :]
    prios = [it[0].priority for it in rest]
    assert prios == sorted(prios)  # smaller class first
    # inside each class: exactly the order the policy gives that class alone
    for p in set(prios):
        alone = [it for it in items if it[0].priority == p and it not in starved]
        want = order_waiting(alone, policy, now, float(max_wait), random.Random(1), cache_on)
        mine = [it for it in rest if it[0].priority == p]
        if policy == "random":  # one shared generator: the class's shuffle differs
            assert sorted(map(id, mine)) == sorted(map(id, want))
        else:
            assert mine == want


def test_interactive_request_is_admitted_before_waiting_background_ones(make_engine, imgs) -> None:
    eng = make_engine(max_running_requests=2)
    proc = eng.processor

    def msg(k: int, priority: int):
        m = proc.make_request(
            messages=user(None, QUESTIONS[k % 3] + f" {k}"), images=[imgs[k % 4]], params=greedy(6)
        )
        return dataclasses.replace(m, priority=priority)

    background = [msg(k, BACKGROUND) for k in range(6)]
    for m in background:
        eng.track(m)
    order: list[str] = []

    def step() -> None:
        eng.step()
        for r in eng.scheduler.active():
            if r.rid not in order:
                order.append(r.rid)

    while len(eng.scheduler.active()) < 2:
        step()
    assert len(order) == 2 and set(order) <= {m.rid for m in background}  # both slots taken
    late = msg(9, INTERACTIVE)  # arrives last, while four background requests wait
    col = eng.track(late)
    while eng.has_work():
        step()
    assert order[2] == late.rid, "the interactive request must take the first free slot"
    assert sorted(order[3:]) == sorted({m.rid for m in background} - set(order[:2]))
    assert col.result.finish_reason == "length"
    _, [ref] = run_workload(make_engine, [(user(None, QUESTIONS[0] + " 9"), [imgs[1]])])
    assert col.result.output_ids == ref.output_ids  # priority never changes an answer
    eng.scheduler.check_accounting()


def test_decode_retracts_background_before_interactive(make_engine, imgs) -> None:
    # the retraction setting of test_retraction_resumes_with_identical_output, with the
    # oldest half interactive: retraction takes background requests while any is active
    cases = [(user(None, QUESTIONS[k % 3] + f" {k}"), [imgs[k % 4]]) for k in range(12)]
    eng = make_engine(page_size=4, max_total_tokens=4 * 330, decode_reserve_ratio=0.0)
    msgs = []
    for k, (m, i) in enumerate(cases):
        r = eng.processor.make_request(messages=m, images=i, params=greedy(24))
        msgs.append(dataclasses.replace(r, priority=BACKGROUND if k % 2 else INTERACTIVE))
    cols = [eng.track(m) for m in msgs]
    retracted = []
    orig = eng.scheduler.retract

    def spy(req) -> None:
        retracted.append((req.priority, {r.priority for r in eng.scheduler.active()}))
        orig(req)

    eng.scheduler.retract = spy
    while eng.has_work():
        eng.step()
    assert retracted, "the setting must run out of pages"
    for priority, active in retracted:
        assert priority == max(active)  # never an interactive one while background runs
    assert all(c.result.finish_reason in ("length", "stop") for c in cols)
    eng.scheduler.check_accounting()


def test_background_prompts_prefill_in_small_chunks(make_engine, imgs) -> None:
    cases = [(user(None, QUESTIONS[k] + f" {k}"), [imgs[k]]) for k in range(3)]
    _, base = run_workload(make_engine, cases, max_tokens=6)
    eng = make_engine(background_prefill_tokens=100)
    msgs = []
    for k, (m, i) in enumerate(cases):
        r = eng.processor.make_request(messages=m, images=i, params=greedy(6))
        msgs.append(dataclasses.replace(r, priority=INTERACTIVE if k == 2 else BACKGROUND))
    cols = [eng.track(m) for m in msgs]
    chunks: dict[str, list[int]] = {}
    orig = eng.scheduler.schedule_prefill

    def spy(budget=None):
        batch = orig(budget)
        background = sum(n for r, n in batch if r.priority == BACKGROUND)
        assert background <= 100  # the step's background share, all requests together
        for r, n in batch:
            chunks.setdefault(r.rid, []).append(n)
        return batch

    eng.scheduler.schedule_prefill = spy
    while eng.has_work():
        eng.step()
    # each image prompt (over 500 tokens) goes in chunks of at most 100 tokens when it is
    # background work, in one piece when interactive
    for m in msgs[:2]:
        assert len(chunks[m.rid]) >= m.prompt_len // 100 and max(chunks[m.rid]) <= 100
    assert chunks[msgs[2].rid] == [msgs[2].prompt_len]
    for c, b in zip(cols, base, strict=True):
        assert c.result.output_ids == b.output_ids
    eng.scheduler.check_accounting()
