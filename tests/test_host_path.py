"""Host work per token in the engine (issue 41, part 4): a waiting request is matched
against the tree once, not once per step; no whole-sequence copies; a decode step's pages
come in one allocation. The outputs stay those of the unchanged engine (the equality
tests of test_scheduling.py and test_cache_equivalence.py cover them)."""

from __future__ import annotations

import time

from mmserve.engine.request import Request
from mmserve.types import SamplingParams
from tests.helpers import user


def _blocked_engine(make_engine, waiting: int = 6):
    """An engine whose running request leaves too few pages for any waiting one, so that
    every step tries (and fails) to admit the queue."""
    eng = make_engine(max_total_tokens=400, decode_reserve_ratio=0.0)
    long_prompt = " ".join(["word"] * 150)
    assert 250 < len(eng.model.tokenizer.encode(long_prompt)) < 390
    run = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng.add_request(eng.processor.make_request(prompt=f"run {long_prompt}", params=run))
    while eng.scheduler.waiting:
        eng.step()
    for i in range(waiting):
        msg = eng.processor.make_request(
            prompt=f"{i} {long_prompt}", params=SamplingParams(max_tokens=4, temperature=0.0)
        )
        eng.add_request(msg)
    return eng


def test_a_waiting_request_is_matched_once_not_once_per_step(make_engine) -> None:
    eng = _blocked_engine(make_engine)
    calls = []
    match = eng.tree.match_prefix
    eng.tree.match_prefix = lambda key: calls.append(len(key)) or match(key)
    steps = 0
    for _ in range(12):  # decode-only steps: the tree does not change
        assert eng.step(), "the running request decodes"
        assert len(eng.scheduler.waiting) == 6, "nothing fits: the queue stays"
        steps += 1
    # one lookup per waiting request in all (today: one per waiting request per step)
    assert len(calls) <= 6, (len(calls), steps)
    assert eng.scheduler.kv.matches <= 2 * 6


def test_a_carried_match_is_looked_up_again_after_the_tree_changed(make_engine) -> None:
    eng = make_engine()
    req = eng.request_state(
        eng.processor.make_request(messages=user("hello there"), params=SamplingParams())
    )
    kv = eng.scheduler.kv
    first = kv.match(req)
    assert kv.match(req) is first  # carried
    # another request with the same prompt runs and finishes: its KV enters the tree
    eng.generate([eng.processor.make_request(messages=user("hello there"))])
    again = kv.match(req)
    assert again is not first and again.length > first.length
    kv.forget(req)
    assert kv.match(req) is not again  # forgotten: looked up anew


def test_matching_and_inserting_copy_no_whole_sequence(make_engine, monkeypatch) -> None:
    def no_copies(self: Request) -> list[int]:
        raise AssertionError("all_ids() copies the whole sequence")

    monkeypatch.setattr(Request, "all_ids", no_copies)
    eng = make_engine(page_size=4)

    def asks() -> list:
        return [
            eng.processor.make_request(
                messages=user(f"question {i}"), params=SamplingParams(max_tokens=6)
            )
            for i in range(4)
        ]

    first = eng.generate(asks())
    again = eng.generate(asks())  # hits the first four's prefixes
    assert [r.output_ids for r in again] == [r.output_ids for r in first]
    assert all(r.cached_tokens > 0 for r in again)
    eng.check_accounting()


def test_a_decode_step_allocates_its_pages_at_once(make_engine) -> None:
    eng = make_engine()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i in range(8):
        eng.add_request(eng.processor.make_request(prompt=f"count {i}", params=params))
    while eng.scheduler.waiting:
        eng.step()
    allocs = []
    kv = eng.scheduler.kv
    allocate = kv.allocate
    kv.allocate = lambda n: allocs.append(n) or allocate(n)
    eng.step()  # one decode step, page size 1: a page per running request
    assert allocs == [8]


class SlowSource:
    """A feature source that takes ``seconds`` to answer (a remote encoder's fetch),
    giving ``features`` by key (None: not there, the tower runs)."""

    def __init__(self, seconds: float, features: dict) -> None:
        self.seconds, self.features = seconds, features
        self.calls: list[list[bytes]] = []
        self.answered: float | None = None

    def __call__(self, items: list) -> list:
        self.calls.append([im.key for im in items])
        time.sleep(self.seconds)
        self.answered = time.perf_counter()
        return [self.features.get(im.key) for im in items]


def test_a_slow_feature_fetch_does_not_stall_other_requests(make_engine, photos) -> None:
    data = photos["astronaut.png"]
    # the features an encoder would give: this model's tower's, for the same image
    ref = make_engine()
    ask = user("What is this?", None)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    ref_img = ref.processor.prepare_image(data)
    want = ref.generate([ref.processor.make_request(messages=ask, images=[ref_img], params=greedy)])
    feats = ref.embedding_cache.peek(ref_img.key)
    assert feats is not None and want[0].vision_tower_runs == 1
    eng = make_engine()
    img = eng.processor.prepare_image(data)
    assert img.key == ref_img.key
    source = SlowSource(1.5, {img.key: feats})
    eng.set_feature_source(source)
    text = eng.processor.make_request(
        prompt="count", params=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    )
    image = eng.processor.make_request(messages=ask, images=[img], params=greedy)
    eng.add_request(image)
    eng.add_request(text)
    times: dict[str, list[float]] = {text.rid: [], image.rid: []}
    done: dict[str, object] = {}
    t0 = time.perf_counter()
    while eng.has_work() and time.perf_counter() - t0 < 60:
        for req in eng.step():
            times[req.rid].append(time.perf_counter())
            if req.finished:
                done[req.rid] = req
    assert source.answered is not None and len(source.calls) == 1
    # the text request decoded all its tokens while the fetch was in flight
    assert len(times[text.rid]) == 30
    assert times[text.rid][-1] < source.answered
    # the image request waited ("loading"), then ran on the fetched features: no tower
    img_req = done[image.rid]
    assert times[image.rid][0] > source.answered
    assert img_req.output_ids == want[0].output_ids
    assert img_req.vision_tower_runs == 0 and eng.remote_feature_images == 1
    eng.check_accounting()
    eng.close()


def test_a_fetch_that_gives_nothing_runs_the_tower(make_engine, photos) -> None:
    eng = make_engine()
    img = eng.processor.prepare_image(photos["astronaut.png"])
    source = SlowSource(0.2, {})
    eng.set_feature_source(source)
    msg = eng.processor.make_request(messages=user("What?", None), images=[img])
    res = eng.generate([msg])[0]
    assert len(source.calls) == 1 and res.vision_tower_runs == 1
    assert eng.remote_feature_images == 0
    eng.close()
