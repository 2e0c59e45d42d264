"""Mixed steps (decode + prefill chunks in one batch) against separate steps."""

from __future__ import annotations

import pytest

from tests.conftest import greedy, user


def _long_and_short(make_engine, photos, **cfg):  # noqa: ANN001, ANN201
    """Short requests decode while longer ones (an image, a long text) arrive and prefill
    in chunks; returns the engine and each request's output ids."""
    eng = make_engine(**cfg)
    img = next(iter(photos.values()))
    proc = eng.processor
    short = [
        proc.make_request(messages=user(f"Say something {i}."), images=[], params=greedy(24))
        for i in range(3)
    ]
    for r in short:
        eng.add_request(r)
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
    for r in long:
        eng.add_request(r)
    while eng.has_work():
        eng.step()
    eng.scheduler.check_accounting()
    return eng, [r.output_ids for r in short + long]


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_steps_equal_separate_steps(make_engine, photos, page_size) -> None:  # noqa: ANN001
    cfg = {"page_size": page_size, "max_num_batched_tokens": 128, "max_total_tokens": 8192}
    mixed, out_mixed = _long_and_short(make_engine, photos, **cfg)
    apart, out_apart = _long_and_short(make_engine, photos, disable_mixed_steps=True, **cfg)
    assert out_mixed == out_apart
    assert all(len(o) > 0 for o in out_mixed)
    # the long prompts were prefilled in chunks while the short ones kept decoding
    assert mixed.stats.mixed_steps >= 3
    assert apart.stats.mixed_steps == 0


def test_a_chunk_never_exceeds_the_step_budget(make_engine, photos) -> None:  # noqa: ANN001
    eng = make_engine(max_num_batched_tokens=64)
    seen = []
    real = eng.runner.prefill

    def spy(reqs, extends):  # noqa: ANN001, ANN202
        seen.append(sum(extends))
        return real(reqs, extends)

    eng.runner.prefill = spy
    reqs = [
        eng.processor.make_request(messages=user("word " * 200), images=[], params=greedy(4))
        for _ in range(2)
    ]
    eng.generate(reqs)
    assert seen and max(seen) <= 64
