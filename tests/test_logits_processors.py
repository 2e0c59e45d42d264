"""logit_bias, presence/frequency/repetition penalties and min_tokens.

Each processor against a brute-force reference on random batches (hypothesis), then
the engine on the tiny checkpoint: greedy tokens equal transformers' ``generate`` with
the same processors (``sequence_bias``, ``repetition_penalty``, ``min_new_tokens`` and
an OpenAI-style frequency/presence processor), forced tokens, min_tokens against EOS
and stop strings, the grammar, and the same outputs batched as alone.
"""

from __future__ import annotations

import json
import math
import pickle
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.engine.request import Request
from mmserve.engine.sampling import LogitsProcessors
from mmserve.frontend.detokenizer import first_stop
from mmserve.frontend.processor import RequestError
from mmserve.structured.spec import GuidedSpec
from mmserve.types import ParamError, SamplingParams
from tests.helpers import assert_same_generation, user

V = 40  # vocabulary of the unit tests
STOP = [2, 5]  # their end-of-sequence ids


# ---- brute-force references -----------------------------------------------------------


def reference_row(logits: list[float], p: SamplingParams, prompt: list[int], out: list[int]):
    """The definitions, one id at a time: bias, then repetition, then frequency/presence."""
    x = list(logits)
    for j, b in (p.logit_bias or {}).items():
        x[j] += b
    if p.repetition_penalty != 1.0:
        for j in {t for t in prompt + out if 0 <= t < len(x)}:
            x[j] = x[j] / p.repetition_penalty if x[j] > 0 else x[j] * p.repetition_penalty
    for j, c in Counter(out).items():
        x[j] -= p.frequency_penalty * c + p.presence_penalty
    return x


def reference_min_tokens(logits: list[float], p: SamplingParams, out: list[int]):
    x = list(logits)
    if len(out) < p.min_tokens and not p.ignore_eos:
        masked = [-math.inf if j in STOP else v for j, v in enumerate(x)]
        if any(v > -math.inf for v in masked):  # else only EOS is left: it stays
            x = masked
    return x


# ---- strategies -------------------------------------------------------------------------

finite = st.floats(-2.0, 2.0, allow_nan=False)
params_st = st.builds(
    SamplingParams,
    max_tokens=st.just(64),
    logit_bias=st.none()
    | st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100, allow_nan=False), max_size=8),
    presence_penalty=st.sampled_from([0.0]) | finite,
    frequency_penalty=st.sampled_from([0.0]) | finite,
    repetition_penalty=st.sampled_from([1.0]) | st.floats(0.05, 2.0),
    min_tokens=st.integers(0, 6),
    ignore_eos=st.booleans(),
)
# prompt ids: text ids and negative image pseudo-ids
prompt_st = st.lists(st.integers(-(2**62), V - 1), max_size=12)
# what each step appends to the output (more than one: jump-forward)
steps_st = st.lists(st.lists(st.integers(0, V - 1), max_size=3), min_size=1, max_size=5)


def random_logits(seed: int, b: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, V, generator=g) * 6
    x[:, 3] = float("-inf")  # a never-sampled id
    return x


@settings(max_examples=60, deadline=None)
@given(
    batch=st.lists(st.tuples(params_st, prompt_st), min_size=1, max_size=4),
    steps=steps_st,
    as_tensor=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_processors_equal_the_definitions(batch, steps, as_tensor, seed) -> None:
    proc = LogitsProcessors(V, STOP, "cpu")
    reqs = [Request(list(prompt), [], p) for p, prompt in batch]
    for k, r in enumerate(reqs):
        if k % 2:
            r.grammar = SimpleNamespace()  # constrained (the matcher itself is not read)
    only_stop = torch.full((V,), float("-inf"))
    only_stop[STOP] = 0.0

    def grammar(rows, s: int):
        """Every other step, a constrained row's grammar allows only end of sequence."""
        for k, r in enumerate(reqs):
            if r.grammar is not None and s % 2:
                rows[k] = rows[k] + only_stop
        return rows

    def process(rs, rows, s: int):
        rows = proc.apply(rs, rows)
        rows = rows if rs is not reqs else grammar(rows, s)
        return proc.apply_min_tokens(rs, rows)

    for s, chunk in enumerate(steps):
        for k, r in enumerate(reqs):
            r.output_ids.extend(chunk[k % 2 :])  # rows get different outputs
        logits = random_logits(seed + s, len(reqs))
        rows = logits.clone() if as_tensor else list(logits.clone())
        got = process(reqs, rows, s)
        for k, r in enumerate(reqs):
            want = reference_row(logits[k].tolist(), r.params, r.input_ids, r.output_ids)
            if r.grammar is not None and s % 2:
                want = [v if j in STOP else -math.inf for j, v in enumerate(want)]
            want = reference_min_tokens(want, r.params, r.output_ids)
            torch.testing.assert_close(got[k], torch.tensor(want), rtol=1e-5, atol=1e-4)
            if not r.params.has_logits_processors():
                assert r.processor_state is None
                if r.grammar is None:
                    assert torch.equal(got[k], logits[k])
            # the same row alone (state already up to date: nothing is counted twice)
            if r.grammar is None or not s % 2:
                alone = process([r], logits[k : k + 1].clone(), s)
                assert torch.equal(alone[0], got[k])
    for r in reqs:  # incremental counts equal a recount of the whole output
        st = r.processor_state
        if st is not None and st.ids is not None:
            assert st.counts(V).tolist() == [float(Counter(r.output_ids)[j]) for j in range(V)]
            assert len(set(st.ids.tolist())) == len(st.ids)  # each id once


def test_rows_without_processors_are_the_same_object() -> None:
    proc = LogitsProcessors(V, STOP, "cpu")
    rows = random_logits(0, 2)
    reqs = [Request([1, 2], [], SamplingParams()), Request([7], [], SamplingParams(seed=3))]
    assert proc.apply(reqs, rows) is rows
    assert proc.apply_min_tokens(reqs, rows) is rows
    assert all(r.processor_state is None for r in reqs)


def test_min_tokens_yields_to_a_row_that_allows_only_eos() -> None:
    proc = LogitsProcessors(V, STOP, "cpu")
    row = torch.full((1, V), float("-inf"))
    row[0, 2] = 1.5  # the grammar allows end of sequence only
    req = Request([1], [], SamplingParams(max_tokens=8, min_tokens=4))
    req.grammar = SimpleNamespace()  # constrained (the matcher itself is not read)
    assert torch.equal(proc.apply_min_tokens([req], row.clone())[0], row[0])
    row[0, 9] = -50.0  # something else is allowed: EOS is held back
    out = proc.apply_min_tokens([req], row.clone())[0]
    assert out[2] == float("-inf") and out[9] == -50.0


# ---- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_out_of_range_parameters_are_named(kw: dict, param: str) -> None:
    with pytest.raises(ParamError) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == param and str(e.value).startswith(param)


def test_edges_of_the_ranges_are_accepted() -> None:
    SamplingParams(
        max_tokens=8,
        min_tokens=8,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        logit_bias={0: -100.0, V - 1: 100},
    ).validate(vocab_size=V)
    SamplingParams(repetition_penalty=1e-3, presence_penalty=2, frequency_penalty=-2).validate()
    with pytest.raises(ParamError, match="outside the vocabulary"):
        SamplingParams(logit_bias={V: 1.0}).validate(vocab_size=V)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text("ab ", max_size=14),
    stops=st.lists(st.text("ab", min_size=1, max_size=3), min_size=1, max_size=3),
    floor=st.integers(0, 16),
)
def test_first_stop_after_a_floor(text: str, stops: list[str], floor: int) -> None:
    starts = [
        i for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > floor
    ]
    assert first_stop(text, stops, floor) == (min(starts) if starts else None)


# ---- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=4096)


def generate(engine, text: str = "The end.", images=(), **kw):
    kw.setdefault("max_tokens", 10)
    kw.setdefault("temperature", 0.0)
    msgs = user(*([None] * len(images)), text)
    req = engine.processor.make_request(
        messages=msgs, images=list(images), params=SamplingParams(**kw)
    )
    (res,) = engine.generate([req])
    assert engine.check_accounting()["running"] == 0
    return res


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bias_against_all_but_one_id_forces_it(engine, temperature: float) -> None:
    keep = 1234
    bias = {i: -100.0 for i in range(engine.processor.vocab_size) if i != keep}
    plain = generate(engine, temperature=temperature, seed=1)
    assert set(plain.output_ids) != {keep}
    res = generate(engine, temperature=temperature, seed=1, logit_bias=bias)
    assert res.output_ids == [keep] * 10 and res.finish_reason == "length"


def test_positive_bias_wins_under_greedy_and_logprobs_include_it(engine) -> None:
    res = generate(engine, logit_bias={77: 100.0}, logprobs=2, return_logits=True)
    assert res.output_ids == [77] * 10
    for lp, row in zip(res.logprobs, res.logits, strict=True):
        assert lp.token_id == 77 and lp.logprob == pytest.approx(0.0, abs=1e-6)
        assert lp.logprob == pytest.approx(float(torch.log_softmax(row, -1)[77]), abs=1e-6)


def test_frequency_penalty_changes_repeated_tokens(engine) -> None:
    plain = generate(engine, max_tokens=16)
    repeats = max(Counter(plain.output_ids).values())
    assert repeats >= 3  # the prompt makes the tiny model repeat itself
    res = generate(engine, max_tokens=16, frequency_penalty=2.0)
    assert res.output_ids != plain.output_ids
    assert max(Counter(res.output_ids).values()) < repeats


def test_min_tokens_holds_back_an_early_eos(engine) -> None:
    eos = engine.model.eos_token_ids[0]
    res = generate(engine, logit_bias={eos: 100.0})
    assert res.output_ids == [eos] and res.finish_reason == "stop"
    for m in (1, 4, 10):
        res = generate(engine, logit_bias={eos: 100.0}, min_tokens=m)
        assert eos not in res.output_ids[:m]
        if m < 10:
            assert res.output_ids[m:] == [eos] and res.finish_reason == "stop"
        else:
            assert res.completion_tokens == 10 and res.finish_reason == "length"
    # with ignore_eos the EOS id ends nothing, so min_tokens holds nothing back
    res = generate(engine, logit_bias={eos: 100.0}, min_tokens=4, ignore_eos=True)
    assert res.output_ids == [eos] * 10


def test_min_tokens_defers_stop_strings(engine) -> None:
    plain = generate(engine, max_tokens=12)
    tok = engine.model.tokenizer
    stop = tok.decode(plain.output_ids[:1], skip_special_tokens=True).strip()
    assert stop
    assert generate(engine, max_tokens=12, stop=[stop]).text == plain.text[: plain.text.find(stop)]
    for m in (2, 5):
        res = generate(engine, max_tokens=12, stop=[stop], min_tokens=m)
        floor = len(tok.decode(plain.output_ids[: m - 1], skip_special_tokens=True))
        starts = [
            i
            for i in range(len(plain.text))
            if plain.text.startswith(stop, i) and i + len(stop) > floor
        ]
        want = plain.text[: min(starts)] if starts else plain.text
        assert res.text == want
        assert len(res.output_ids) >= m


class FrequencyPresence:
    """transformers logits processor with OpenAI's frequency and presence penalties."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.f, self.p = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for j, c in Counter(input_ids[0, self.prompt_len :].tolist()).items():
            scores[0, j] -= self.f * c + self.p
        return scores


def hf_generate(ref_model, engine, messages, images, p: SamplingParams):
    """Greedy ids and processed scores of transformers' ``generate`` with ``p``'s processors."""
    from transformers import LogitsProcessorList

    model, processor = ref_model
    text = engine.processor.prompts.render_chat(messages)
    inputs = processor(images=[i.image for i in images] or None, text=text, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=p.max_tokens,
            do_sample=False,
            suppress_tokens=engine.model.never_sample_ids,
            repetition_penalty=p.repetition_penalty,
            sequence_bias={(k,): v for k, v in (p.logit_bias or {}).items()} or None,
            min_new_tokens=p.min_tokens or None,
            eos_token_id=engine.model.eos_token_ids,
            logits_processor=LogitsProcessorList(
                [FrequencyPresence(n, p.frequency_penalty, p.presence_penalty)]
            ),
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, n:].tolist(), [s[0].float() for s in out.scores]


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "gentle repetition": dict(repetition_penalty=0.7),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "negative presence": dict(presence_penalty=-1.0, frequency_penalty=-0.5),
    "bias": dict(logit_bias={788: -5.0, 1667: 6.0, 830: 3.0}),
    "all and min_tokens": dict(
        logit_bias={2: 12.0, 969: -3.0},
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        min_tokens=6,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("with_image", [False, True])
def test_greedy_equals_transformers_with_the_same_processors(
    engine, ref_model, photos, case: str, with_image: bool
) -> None:
    images = [engine.processor.prepare_image(photos["cat.png"])] if with_image else []
    msgs = user(*([None] * len(images)), "The end.")
    p = SamplingParams(max_tokens=14, temperature=0.0, return_logits=True, **CASES[case])
    req = engine.processor.make_request(messages=msgs, images=images, params=p)
    (res,) = engine.generate([req])
    ids, scores = hf_generate(ref_model, engine, msgs, images, p)
    assert_same_generation(res.output_ids, ids, res.logits, scores, case)


def test_batched_equals_alone(engine, photos) -> None:
    cat = engine.processor.prepare_image(photos["cat.png"])
    eos = engine.model.eos_token_ids[0]
    cases = [
        ("The end.", [], dict(frequency_penalty=1.0, presence_penalty=0.5)),
        ("The end.", [cat], dict(repetition_penalty=1.5, temperature=0.8, seed=4)),
        ("Hi", [], dict(logit_bias={eos: 9.0, 17: 4.0}, min_tokens=3, temperature=1.0, seed=9)),
        ("Tell me a story.", [], {}),
        ("Hi", [cat], dict(temperature=1.2, seed=2, top_k=20)),
    ]

    def make(text, images, kw):
        kw = {"max_tokens": 9, "temperature": 0.0, **kw}
        msgs = user(*([None] * len(images)), text)
        return engine.processor.make_request(
            messages=msgs, images=images, params=SamplingParams(**kw)
        )

    together = engine.generate([make(*c) for c in cases])
    for case, res in zip(cases, together, strict=True):
        (alone,) = engine.generate([make(*case)])
        assert alone.output_ids == res.output_ids, case
    assert engine.check_accounting()["running"] == 0


def test_grammar_and_processors(engine) -> None:
    choices = ["cat", "dog"]
    tok = engine.model.tokenizer
    plain = generate(engine, guided=GuidedSpec("choice", json.dumps(choices)), max_tokens=8)
    assert plain.text in choices
    other = choices[1 - choices.index(plain.text)]
    first = tok.encode(other, add_special_tokens=False)[0]
    # bias comes before the grammar mask: it picks among what the grammar allows ...
    res = generate(
        engine, guided=GuidedSpec("choice", json.dumps(choices)), logit_bias={first: 100.0}
    )
    assert res.text == other
    # ... and never brings back what it forbids
    res = generate(
        engine, guided=GuidedSpec("choice", json.dumps(choices)), logit_bias={1234: 100.0}
    )
    assert res.text in choices and 1234 not in res.output_ids
    # min_tokens beyond the grammar's end yields to it: the request ends, it never hangs
    res = generate(
        engine, guided=GuidedSpec("choice", json.dumps(choices)), min_tokens=6, max_tokens=8
    )
    assert res.text in choices and res.finish_reason == "stop"


def test_penalties_survive_retraction(make_engine) -> None:
    """A retracted request resumes with the same output: its counts are kept."""
    kw = dict(max_tokens=40, temperature=0.0, frequency_penalty=0.7, repetition_penalty=1.2)

    def run(eng):
        reqs = [
            eng.processor.make_request(messages=user(t), params=SamplingParams(**kw))
            for t in ("The end.", "Tell me a story.", "Count to five.", "Hi") * 2
        ]
        return [r.output_ids for r in eng.generate(reqs)], eng

    ref, _ = run(make_engine(max_total_tokens=4096))
    # reserve nothing for decode and leave little room: decode must run out and retract
    small, eng = run(make_engine(max_total_tokens=160, page_size=4, decode_reserve_ratio=0.0))
    assert eng.scheduler.retractions > 0
    assert small == ref


def test_front_end_checks_and_replicas_carry_the_fields(engine, model_dir) -> None:
    from mmserve.config import EngineConfig
    from mmserve.fleet.protocol import ReplicaRequest
    from mmserve.frontend.frontend import FrontEnd, load_frontend_model

    front = FrontEnd(EngineConfig(model_path=str(model_dir)), load_frontend_model(model_dir))
    vocab = engine.processor.vocab_size
    with pytest.raises(RequestError) as e:
        front.processor.make_request(
            messages=user("Hi"), params=SamplingParams(logit_bias={vocab: 1.0})
        )
    assert e.value.param == "logit_bias" and str(vocab) in str(e.value)
    p = SamplingParams(
        max_tokens=7,
        logit_bias={5: -3.5},
        presence_penalty=0.25,
        frequency_penalty=-1.0,
        repetition_penalty=1.5,
        min_tokens=2,
    )
    req = front.processor.make_request(messages=user("Hi"), params=p)
    back = pickle.loads(pickle.dumps(ReplicaRequest(req.rid, req.input_ids, [], req.params)))
    assert back.params == p
