"""Host work per token in the engine (issue 41, part 4): a waiting request is matched
against the tree once, not once per step; no whole-sequence copies; a decode step's pages
come in one allocation. The outputs stay those of the unchanged engine (the equality
tests of test_scheduling.py and test_cache_equivalence.py cover them)."""

from __future__ import annotations

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
