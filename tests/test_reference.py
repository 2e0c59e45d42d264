"""Invariant 5 on LLaVA-1.5: greedy output equals transformers'
LlavaForConditionalGeneration.generate with the image anywhere in the prompt and in a
batch of different lengths. Text, two images and a chat, for every family, are in
tests/test_families.py."""

from __future__ import annotations

import pytest

from tests.helpers import (
    assert_same_generation,
    check_against_reference,
    greedy,
    reference_generate,
    user,
)

MAX_NEW = 8


@pytest.fixture(scope="module")
def imgs(make_engine, photos):
    eng = make_engine()
    return [
        eng.processor.prepare_image(photos[n]) for n in ("cat.png", "coffee.png", "astronaut.png")
    ]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_image_positions(make_engine, ref_model, imgs, where: str) -> None:
    parts = {
        "first": (None, "What animal is this?"),
        "middle": ("Look at this photo:", None, "What animal is this?"),
        "last": ("What animal is in the following photo?", None),
    }[where]
    check_against_reference(make_engine(), ref_model, user(*parts), imgs[:1], f"image {where}")


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
        ref_ids, ref_logits, ref_len = reference_generate(
            ref_model, text, [i.image for i in images], never, MAX_NEW
        )
        assert res.prompt_tokens == ref_len, f"batch #{k}"
        assert_same_generation(res.output_ids, ref_ids, res.logits, ref_logits, f"batch #{k}")
    assert eng.stats.prefill_steps >= 1
    eng.scheduler.check_accounting()
