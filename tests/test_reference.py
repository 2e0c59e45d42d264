"""Invariant 5: greedy output equals transformers' LlavaForConditionalGeneration.generate."""

from __future__ import annotations

import pytest

from tests.comparator import assert_same_generation, reference_generate
from tests.conftest import greedy, user

MAX_NEW = 8


def reference(ref_model, text: str, images: list, never: list[int], max_new: int = MAX_NEW):  # noqa: ANN001, ANN201
    return reference_generate(ref_model, text, images, never, max_new)


def check(engine, ref_model, messages, images, what: str) -> None:  # noqa: ANN001
    text = engine.processor.prompts.render_chat(messages)
    req = engine.processor.make_request(messages=messages, images=images, params=greedy(MAX_NEW))
    (res,) = engine.generate([req])
    never = engine.model.never_sample_ids
    ref_ids, ref_logits, ref_len = reference(ref_model, text, [i.image for i in images], never)
    assert res.prompt_tokens == ref_len, f"{what}: prompt length {res.prompt_tokens} vs {ref_len}"
    assert_same_generation(res.output_ids, ref_ids, res.logits, ref_logits, what)


@pytest.fixture(scope="module")
def imgs(make_engine, photos):  # noqa: ANN001, ANN201
    eng = make_engine()
    return [
        eng.processor.prepare_image(photos[n]) for n in ("cat.png", "coffee.png", "astronaut.png")
    ]


def test_text_only(make_engine, ref_model) -> None:
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colours of a sunset."},
    ]
    check(make_engine(), ref_model, msgs, [], "text only")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_image_positions(make_engine, ref_model, imgs, where: str) -> None:
    parts = {
        "first": (None, "What animal is this?"),
        "middle": ("Look at this photo:", None, "What animal is this?"),
        "last": ("What animal is in the following photo?", None),
    }[where]
    check(make_engine(), ref_model, user(*parts), imgs[:1], f"image {where}")


def test_two_images(make_engine, ref_model, imgs) -> None:
    msgs = user(None, "and", None, "Which photo is brighter?")
    check(make_engine(), ref_model, msgs, imgs[:2], "two images")


def test_multi_turn_chat(make_engine, ref_model, imgs) -> None:
    msgs = user(None, "What is in the cup?") + [
        {"role": "assistant", "content": "Coffee with milk foam."},
        {"role": "user", "content": "What colour is the saucer?"},
    ]
    check(make_engine(), ref_model, msgs, imgs[1:2], "multi-turn")


def test_batch_of_different_lengths(make_engine, ref_model, imgs) -> None:
    eng = make_engine()
    cases = [
        (user("Hi."), []),
        (user(None, "Describe the photo in detail, please."), imgs[:1]),
        (user("Compare", None, "with", None), imgs[1:3]),
        (user("Write one long sentence about the sea, the sky and the boats."), []),
    ]
    reqs = [
        eng.processor.make_request(messages=m, images=i, params=greedy(MAX_NEW)) for m, i in cases
    ]
    results = eng.generate(reqs)
    never = eng.model.never_sample_ids
    for k, ((msgs, images), res) in enumerate(zip(cases, results, strict=True)):
        text = eng.processor.prompts.render_chat(msgs)
        ref_ids, ref_logits, _ = reference(ref_model, text, [i.image for i in images], never)
        assert_same_generation(res.output_ids, ref_ids, res.logits, ref_logits, f"batch #{k}")
    assert eng.stats.prefill_steps >= 1
    eng.scheduler.check_accounting()
