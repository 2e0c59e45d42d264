"""Invariant 4 and the radix cache seen from the engine: hits, misses, no leaks."""

from __future__ import annotations

import pytest

from tests.helpers import QUESTIONS, assert_same_generation, greedy, run_workload, user, workload


@pytest.fixture(scope="module")
def imgs(make_engine, photos):
    eng = make_engine()
    return [eng.processor.prepare_image(b) for b in photos.values()]


@pytest.mark.parametrize(
    "cfg",
    [
        {"disable_radix_cache": True, "page_size": 1},
        {"page_size": 16},
        {"disable_radix_cache": True, "page_size": 16},
        {"page_size": 1, "policy": "fcfs"},
    ],
)
def test_cache_and_page_size_do_not_change_outputs(make_engine, imgs, cfg) -> None:
    cases = workload(imgs)
    _, base = run_workload(make_engine, cases, page_size=1)
    _, other = run_workload(make_engine, cases, **cfg)
    for k, (a, b) in enumerate(zip(other, base, strict=True)):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, f"{cfg} #{k}")
    if not cfg.get("disable_radix_cache"):
        assert sum(r.cached_tokens for r in other) > 0
    else:
        assert all(r.cached_tokens == 0 for r in other)


def test_followup_questions_hit_the_image(make_engine, imgs) -> None:
    eng = make_engine(page_size=1)
    img = imgs[0]
    results = []
    for q in QUESTIONS:  # one after another, as a user would ask
        req = eng.processor.make_request(messages=user(None, q), images=[img], params=greedy(4))
        results.append(eng.generate([req])[0])
    start = req.spans[0].start
    shared = start + 576  # text before the image, then the image
    assert results[0].cached_tokens == 0 and results[0].vision_tower_runs == 1
    for r in results[1:]:
        assert r.cached_tokens >= shared
        assert r.images_needing_vision == 0 and r.vision_tower_runs == 0
    assert eng.runner.vision_tower_images == 1


def test_same_instant_questions_prefill_the_image_once(make_engine, imgs) -> None:
    eng = make_engine(page_size=1)
    reqs = [
        eng.processor.make_request(messages=user(None, q), images=[imgs[1]], params=greedy(4))
        for q in QUESTIONS
    ]
    res = eng.generate(reqs)
    shared = reqs[0].spans[0].end
    assert sorted(r.cached_tokens >= shared for r in res) == [False, True, True]
    assert eng.runner.vision_tower_images == 1


def test_page_size_16_match_ends_inside_image(make_engine, imgs) -> None:
    cases = [(user(None, q), [imgs[2]]) for q in QUESTIONS[:2]]
    _, base = run_workload(make_engine, cases, disable_radix_cache=True)
    eng = make_engine(page_size=16, vision_cache_bytes=0)
    first = eng.generate(
        [eng.processor.make_request(messages=cases[0][0], images=cases[0][1], params=greedy(6))]
    )[0]
    req = eng.processor.make_request(messages=cases[1][0], images=cases[1][1], params=greedy(6))
    second = eng.generate([req])[0]
    span = req.spans[0]
    assert second.cached_tokens % 16 == 0
    assert span.start < second.cached_tokens < span.end, "match should end inside the image"
    assert second.vision_tower_runs == 1  # the tail of the image needs features again
    for a, b in zip([first, second], base, strict=True):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "P=16")


def test_eviction_cut_inside_image(make_engine, imgs) -> None:
    msgs = user(None, QUESTIONS[0])
    _, (base,) = run_workload(make_engine, [(msgs, [imgs[0]])], disable_radix_cache=True)
    eng = make_engine(page_size=1)
    req = eng.processor.make_request(messages=msgs, images=[imgs[0]], params=greedy(6))
    eng.generate([req])
    cut = req.spans[0].start + 300
    # touch the first `cut` tokens so the tail node is the least recently used leaf
    eng.tree.match_prefix(req.input_ids[:cut])
    eng.tree.evict(eng.tree.total_size() - cut)
    assert eng.tree.total_size() == cut
    again = eng.processor.make_request(messages=msgs, images=[imgs[0]], params=greedy(6))
    (res,) = eng.generate([again])
    assert res.cached_tokens == cut
    assert res.images_needing_vision == 1 and res.vision_tower_runs == 0  # embedding cache
    assert_same_generation(res.output_ids, base.output_ids, res.logits, base.logits, "cut")
    eng.scheduler.check_accounting()


def test_small_pool_completes_50_requests_without_leaks(make_engine, imgs) -> None:
    cases = []
    for k in range(50):
        img = imgs[k % len(imgs)]
        cases.append((user(None, QUESTIONS[k % 3] + f" ({k % 7})"), [img]))
    _, base = run_workload(
        make_engine, cases, max_tokens=4, disable_radix_cache=True, max_total_tokens=32768
    )
    # room for about three requests at a time
    eng, res = run_workload(make_engine, cases, max_tokens=4, page_size=4, max_total_tokens=4 * 460)
    for k, (a, b) in enumerate(zip(res, base, strict=True)):
        assert a.finish_reason in ("length", "stop")
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, f"small #{k}")
    acc = eng.scheduler.check_accounting()
    assert acc["running"] == 0 and acc["free"] + acc["tree"] == acc["total"]
    eng.tree.reset()
    assert eng.pool.allocator.num_free == eng.pool.num_pages
