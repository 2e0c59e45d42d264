"""Incremental text equals one-shot decoding; stop strings across token boundaries."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from mmserve.frontend.detokenizer import IncrementalDetokenizer, TextStream, first_stop
from tests.helpers import TINY_FAMILIES


def special_ids(tok) -> set[int]:
    return set(tok.all_special_ids)


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tok(request, families):
    """Each family's tiny tokenizer (SentencePiece, SentencePiece + byte fallback, BPE)."""
    return AutoTokenizer.from_pretrained(families[request.param].model_dir)


def _ids(tok) -> st.SearchStrategy[list[int]]:
    """Random ids, heavy on byte-fallback and special tokens and on multi-byte text."""
    vocab = tok.get_vocab()
    byte_ids = sorted(i for t, i in vocab.items() if t.startswith("<0x") and len(t) == 6)
    special = sorted(tok.all_special_ids)
    # characters whose tokens split a UTF-8 sequence (CJK, emoji, accents)
    multibyte = sorted({i for s in ("北京在线", "🙂🎉", "café ñ", "Ωμέγα") for i in tok.encode(s)})
    pools = [st.integers(0, len(tok) - 1), st.sampled_from(special), st.sampled_from(multibyte)]
    if byte_ids:
        pools.append(st.sampled_from(byte_ids))
    return st.lists(st.one_of(pools), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_incremental_text_equals_one_shot_decode(tok, data) -> None:
    ids = data.draw(_ids(tok), label="ids")
    step = data.draw(st.integers(1, 4), label="ids per push")
    dt = IncrementalDetokenizer(tok)
    pieces = [dt.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    text = "".join(pieces) + dt.flush()
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert dt.text == text
    # no piece shown before the end holds a character that later decoding changes
    shown = "".join(pieces)
    assert text.startswith(shown)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_strings_match_one_shot_cut(tok, data) -> None:
    ids = data.draw(_ids(tok), label="ids")
    full = tok.decode(ids, skip_special_tokens=True)
    # stops taken from the text itself, so they often straddle token boundaries
    stops = []
    for _ in range(data.draw(st.integers(1, 3), label="stops")):
        if len(full) >= 1:
            a = data.draw(st.integers(0, len(full) - 1))
            b = data.draw(st.integers(a + 1, min(len(full), a + 6)))
            stops.append(full[a:b].replace("\ufffd", "") or "zz")
        else:
            stops.append("zz")
    stream = TextStream(tok, stops)
    shown = ""
    used = 0
    for tok_id in ids:
        shown += stream.push([tok_id])
        used += 1
        if stream.stopped:
            break
    shown += stream.finish()
    # the reference: decode the ids up to the one that stopped it, cut at the earliest stop
    ref = tok.decode(ids[:used], skip_special_tokens=True)
    cut = first_stop(ref, stops)
    if stream.stopped:
        assert cut is not None
        assert shown == ref[:cut] == stream.text
        # no earlier token already completed a stop string (unless its text was not
        # settled yet: an open run of byte-fallback tokens)
        before = tok.decode(ids[: used - 1], skip_special_tokens=True)
        byte_run = tok.convert_ids_to_tokens(ids[used - 2]).startswith("<0x") if used > 1 else 0
        held = byte_run or ids[used - 2] in special_ids(tok) or before.endswith("\ufffd")
        assert first_stop(before, stops) is None or held
    else:
        assert shown == full
        assert used == len(ids)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streamed_text_never_shows_part_of_a_stop(tok, data) -> None:
    ids = data.draw(_ids(tok), label="ids")
    full = tok.decode(ids, skip_special_tokens=True)
    if len(full) < 2:
        return
    a = data.draw(st.integers(0, len(full) - 2))
    stop = full[a : a + data.draw(st.integers(2, 5))]
    stream = TextStream(tok, [stop])
    shown = ""
    for tok_id in ids:
        shown += stream.push([tok_id])
        # what is on screen ends before any stop string starts
        assert first_stop(shown, [stop]) is None
        if stream.stopped:
            break
    shown += stream.finish()
    assert stop not in shown


def test_min_tokens_delays_stop_strings(tok) -> None:
    ids = tok.encode("hello world hello world", add_special_tokens=False)
    stream = TextStream(tok, ["hello"], min_tokens=len(ids))
    text = "".join(stream.push([i]) for i in ids) + stream.finish()
    assert not stream.stopped and "hello" in text
    stream = TextStream(tok, ["hello"])
    stream.push(ids)
    assert stream.stopped and stream.text == ""


def test_push_cost_does_not_grow_with_the_answer(tok) -> None:
    """A counting test: the ids a push decodes (those kept since the piece before last,
    as ``DecodeStream`` keeps them) stay few however long the answer is."""
    dt = IncrementalDetokenizer(tok)
    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 200, add_special_tokens=False)
    kept = []
    for i in ids:
        dt.push([i])
        kept.append(len(dt._window) + len(dt._held))
    assert len(ids) > 1000
    assert max(kept[-50:]) <= max(max(kept[:50]), 8), kept


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_ends_the_ids_at_the_token_completing_it(tok, data) -> None:
    """``num_tokens`` after a stop is the fewest ids whose one-shot text already holds
    the answer and its stop string, also where that text was held back (a byte run)
    and the stop was found with later tokens, or only at :meth:`TextStream.finish`."""
    ids = data.draw(_ids(tok), label="ids")
    full = tok.decode(ids, skip_special_tokens=True)
    if len(full) < 2:
        return
    a = data.draw(st.integers(0, len(full) - 2))
    stop = full[a : a + data.draw(st.integers(1, 4))]
    stream = TextStream(tok, [stop])
    for tok_id in ids:
        stream.push([tok_id])
        if stream.stopped:
            break
    stream.finish()
    assert stream.stopped  # the stop is in the text of all the ids
    k = stream.num_tokens
    want = stream.text + stop
    assert tok.decode(ids[:k], skip_special_tokens=True).startswith(want)
    assert not tok.decode(ids[: k - 1], skip_special_tokens=True).startswith(want)
