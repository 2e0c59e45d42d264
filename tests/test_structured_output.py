"""Structured output on the engine: 20 JSON schemas, regex, choice and grammar outputs
validate; jump-forward (re-tokenized boundary, extend steps, logprobs), the radix cache
on and off, retraction while jumping, the grammar cache, keyword refusals, install pins."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from mmserve.structured.compile import GrammarCache
from mmserve.structured.spec import (
    ENFORCED_KEYWORDS,
    XGRAMMAR_VERSION,
    GrammarError,
    GuidedSpec,
    check_spec,
)
from mmserve.types import SamplingParams
from tests.helpers import user

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ["astronaut.png", "cat.png", "rocket.jpg"]
FORMATS = jsonschema.FormatChecker()

#: Twenty varied schemas, each bounding its output's size.
SCHEMAS = [
    # 0 flat object, bounded string and integer
    {
        "type": "object",
        "properties": {
            "caption": {"type": "string", "maxLength": 20},
            "objects": {"type": "integer", "minimum": 0, "maximum": 50},
        },
        "required": ["caption", "objects"],
    },
    # 1 enum + boolean
    {
        "type": "object",
        "properties": {
            "scene": {"enum": ["indoor", "outdoor", "unknown"]},
            "has_people": {"type": "boolean"},
        },
        "required": ["scene", "has_people"],
    },
    # 2 number with range
    {
        "type": "object",
        "properties": {
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "temperature_c": {"type": "number", "minimum": -40, "maximum": 60},
        },
        "required": ["confidence", "temperature_c"],
    },
    # 3 array of enums with bounds
    {
        "type": "object",
        "properties": {
            "colours": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "black", "white"]},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["colours"],
    },
    # 4 nested object
    {
        "type": "object",
        "properties": {
            "subject": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age_years": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age_years"],
            },
            "location": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 15},
                    "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                },
                "required": ["city", "country_code"],
            },
        },
        "required": ["subject", "location"],
    },
    # 5 pattern strings
    {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        },
        "required": ["date", "code"],
    },
    # 6 array of objects
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "label": {"type": "string", "maxLength": 8},
                        "count": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["label", "count"],
                },
            }
        },
        "required": ["items"],
    },
    # 7 long fixed keys
    {
        "type": "object",
        "properties": {
            "a_detailed_description_of_the_main_subject": {"type": "string", "maxLength": 10},
            "the_dominant_colour_of_the_background_area": {"enum": ["light", "dark"]},
            "estimated_number_of_people_in_the_picture": {
                "type": "integer",
                "minimum": 0,
                "maximum": 9,
            },
        },
        "required": [
            "a_detailed_description_of_the_main_subject",
            "the_dominant_colour_of_the_background_area",
            "estimated_number_of_people_in_the_picture",
        ],
    },
    # 8 top-level array
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 5,
    },
    # 9 anyOf
    {
        "type": "object",
        "properties": {
            "answer": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 99},
                    {"type": "string", "maxLength": 6},
                    {"type": "null"},
                ]
            }
        },
        "required": ["answer"],
    },
    # 10 const and enum of mixed types
    {
        "type": "object",
        "properties": {"version": {"const": 2}, "mode": {"enum": ["a", 1, None, True]}},
        "required": ["version", "mode"],
    },
    # 11 $defs / $ref
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 336},
                    "y": {"type": "integer", "minimum": 0, "maximum": 336},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {
            "top_left": {"$ref": "#/$defs/point"},
            "bottom_right": {"$ref": "#/$defs/point"},
        },
        "required": ["top_left", "bottom_right"],
    },
    # 12 tuple (prefixItems)
    {
        "type": "array",
        "prefixItems": [
            {"type": "string", "maxLength": 5},
            {"type": "number", "minimum": 0, "maximum": 10},
            {"type": "boolean"},
        ],
        "items": False,
        "minItems": 3,
    },
    # 13 exclusive bounds, integer type list
    {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 3},
        },
        "required": ["score", "ratio", "maybe"],
    },
    # 14 minLength + maxLength, optional property
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 2, "maxLength": 10},
            "subtitle": {"type": "string", "maxLength": 5},
        },
        "required": ["title"],
    },
    # 15 deeply nested arrays
    {
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": [0, 1]}},
            }
        },
        "required": ["grid"],
    },
    # 16 uuid format and enum of strings with quotes
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "quote": {"enum": ['say "hi"', "back\\slash"]},
        },
        "required": ["id", "quote"],
    },
    # 17 boolean-only and null
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "nothing": {"type": "null"},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["ok", "nothing", "flags"],
    },
    # 18 annotations (title/description/default) are accepted
    {
        "title": "Photo",
        "description": "facts about a photo",
        "type": "object",
        "properties": {
            "kind": {
                "description": "what it is",
                "enum": ["cat", "rocket", "other"],
                "default": "other",
            },
            "width_px": {"type": "integer", "minimum": 1, "maximum": 4096, "examples": [336]},
        },
        "required": ["kind", "width_px"],
    },
    # 19 additionalProperties false, nested optional object
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "meta": {
                "type": "object",
                "properties": {
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 6},
                        "maxItems": 2,
                    },
                    "lang": {"enum": ["en", "fr", "de"]},
                },
                "required": ["tags", "lang"],
                "additionalProperties": False,
            }
        },
        "required": ["meta"],
    },
]


#: A schema whose keys are long and fixed: most of its output is forced text.
LONG_KEYS = SCHEMAS[7]


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=16384)


@pytest.fixture(scope="module")
def images(engine, photos):
    return [engine.processor.prepare_image(photos[name]) for name in IMAGES]


def ask(engine, image, spec: GuidedSpec, question: str = "Describe the photo as JSON.", **kw):
    kw.setdefault("max_tokens", 400)
    params = SamplingParams(guided=spec, **kw)
    return engine.processor.make_request(
        messages=user(None, question), images=[image], params=params
    )


def validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


def test_twenty_schemas_validate_greedy_and_sampled(engine, images) -> None:
    reqs, which = [], []
    for si, schema in enumerate(SCHEMAS):
        for ii, image in enumerate(images):
            for temperature in (0.0, 1.0):
                spec = GuidedSpec.json_schema(schema)
                reqs.append(ask(engine, image, spec, temperature=temperature, seed=si * 7 + ii))
                which.append(si)
    jumps = engine.guided.stats.jumps
    results = engine.generate(reqs)
    for si, r in zip(which, results, strict=True):
        validate(r.text, SCHEMAS[si])
        assert r.finish_reason == "stop", (si, r.text)
        assert r.text == engine.model.tokenizer.decode(r.output_ids, skip_special_tokens=True)
    assert engine.guided.stats.jumps > jumps
    engine.check_accounting()


REGEXES = [r"[A-Z][a-z]{2,6}", r"(yes|no|maybe)", r"[0-9]{3}-[0-9]{4}", r"\w{1,8}@[a-z]{2,5}\.com"]
CHOICES = [["cat", "dog", "rocket ship"], ['say "hi"', "back\\slash", "tab\tand\nnewline"]]
GRAMMAR = """root ::= "The answer is " answer "."
answer ::= "yes" | "no" | [0-9] [0-9]?"""


def test_regex_choice_and_grammar_outputs_match(engine, images) -> None:
    cases = [(GuidedSpec("regex", rx), lambda t, rx=rx: re.fullmatch(rx, t)) for rx in REGEXES]
    cases += [(GuidedSpec.choice(c), lambda t, c=c: t in c) for c in CHOICES]
    grammar_re = r"The answer is (yes|no|[0-9][0-9]?)\."
    cases.append((GuidedSpec("grammar", GRAMMAR), lambda t: re.fullmatch(grammar_re, t)))
    reqs, checks = [], []
    for spec, check in cases:
        for ii, image in enumerate(images[:2]):
            for temperature in (0.0, 1.0):
                reqs.append(ask(engine, image, spec, "Answer.", temperature=temperature, seed=ii))
                checks.append(check)
    for r, check in zip(engine.generate(reqs), checks, strict=True):
        assert check(r.text), r.text
        assert r.finish_reason == "stop"


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_on_and_off_give_the_same_constrained_outputs(
    make_engine, photos, page_size: int
) -> None:
    outs = {}
    for off in (False, True):
        eng = make_engine(max_total_tokens=16384, disable_radix_cache=off, page_size=page_size)
        image = eng.processor.prepare_image(photos["cat.png"])
        reqs = [
            ask(eng, image, GuidedSpec.json_schema(SCHEMAS[si]), q, temperature=0.0)
            for si in (0, 4, 7, 11)
            for q in ("Describe it.", "What is this?")
        ]
        outs[off] = [r.output_ids for r in eng.generate(reqs)]
        eng.check_accounting()
    assert outs[False] == outs[True]


def test_jump_forward_saves_decode_steps_on_long_keys(make_engine, photos) -> None:
    steps, texts = {}, {}
    for disabled in (True, False):
        eng = make_engine(max_total_tokens=16384, disable_jump_forward=disabled)
        image = eng.processor.prepare_image(photos["cat.png"])
        reqs = [ask(eng, image, GuidedSpec.json_schema(LONG_KEYS), f"Q{i}?") for i in range(4)]
        results = eng.generate(reqs)
        for r in results:
            validate(r.text, LONG_KEYS)
            assert r.finish_reason == "stop"
        steps[disabled] = eng.stats.decode_steps
        texts[disabled] = [r.text for r in results]
        assert (eng.guided.stats.jumps > 0) != disabled
    assert steps[False] <= 0.7 * steps[True], steps


def test_jumped_tokens_logprobs_and_retokenized_boundary(engine, images) -> None:
    spec = GuidedSpec.json_schema(LONG_KEYS)
    req = ask(engine, images[1], spec, temperature=0.0, logprobs=3)
    (r,) = engine.generate([req])
    validate(r.text, LONG_KEYS)
    assert len(r.logprobs) == len(r.output_ids)
    forced = [lp for lp in r.logprobs if lp.logprob == 0.0 and lp.top == [(lp.token_id, 0.0)]]
    assert len(forced) > len(r.output_ids) // 2  # the keys are forced text
    for lp, tok in zip(r.logprobs, r.output_ids, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert all(v > float("-inf") for _, v in lp.top)  # after the mask: allowed tokens only


def test_retokenized_boundary_gives_the_tokenizers_own_tokens(engine, images) -> None:
    # A one-element choice: the model samples some prefix of it as the first token, the
    # rest is one jump; re-tokenizing at the boundary must give exactly the tokenizer's
    # tokens of the whole string (the end-of-sequence token it forces after them is not
    # part of the answer).
    tok = engine.model.tokenizer
    texts = ["the photograph shows a cat", "description_of_the_picture", '{"key": "value"}']
    cases = [(t, q, temp) for t in texts for q in ("A", "Answer.") for temp in (0.0, 1.0)]
    reqs = [
        ask(engine, images[1], GuidedSpec.choice([t]), q, temperature=temp, seed=3)
        for t, q, temp in cases
    ]
    before = engine.guided.stats.retokenized
    for (text, _, _), r in zip(cases, engine.generate(reqs), strict=True):
        assert r.text == text and r.finish_reason == "stop"
        assert r.output_ids == tok.encode(text, add_special_tokens=False)
    assert engine.guided.stats.retokenized > before  # some first token was not the tokenizer's


def test_max_tokens_stop_strings_and_ignore_eos_with_jumps(engine, images) -> None:
    spec = GuidedSpec.json_schema(LONG_KEYS)
    short = ask(engine, images[0], spec, max_tokens=5)
    stopped = ask(engine, images[0], spec, stop=["dominant"])
    no_eos = ask(engine, images[0], spec, ignore_eos=True)
    short, stopped, no_eos = engine.generate([short, stopped, no_eos])
    assert short.finish_reason == "length" and len(short.output_ids) == 5
    assert stopped.finish_reason == "stop" and "dominant" not in stopped.text
    assert stopped.text.startswith('{"a_detailed_description_of_the_main_subject": "')
    assert no_eos.finish_reason == "stop"  # the grammar's end ends it
    validate(no_eos.text, LONG_KEYS)


def test_retraction_while_jumping_keeps_outputs(make_engine, photos) -> None:
    def run(**kw):
        eng = make_engine(**kw)
        image = eng.processor.prepare_image(photos["rocket.jpg"])
        reqs = [
            ask(eng, image, GuidedSpec.json_schema(SCHEMAS[si]), f"Question {si}", max_tokens=120)
            for si in (4, 6, 7, 11, 19)
        ]
        out = [r.output_ids for r in eng.generate(reqs)]
        eng.check_accounting()
        return eng, out

    _, roomy = run(max_total_tokens=16384)
    tight, out = run(max_total_tokens=720, decode_reserve_ratio=0.0)
    assert tight.scheduler.retractions > 0
    assert out == roomy


def test_mask_unpacking_matches_xgrammar(engine) -> None:
    spec = GuidedSpec.json_schema(SCHEMAS[4])
    state = engine.processor.grammars.state(spec)
    vocab = engine.model.decoder.shape.vocab_size
    state.matcher.accept_string('{"subject": {"name": "ab')
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    state.matcher.fill_next_token_bitmask(bitmask, 0)
    want = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(want, bitmask)
    got = engine.guided._unpack(bitmask, vocab)
    assert torch.equal(got, torch.isfinite(want))
    assert 0 < int(got.sum()) < vocab


def test_special_and_control_tokens_are_never_allowed(engine) -> None:
    tok = engine.model.tokenizer
    vocab = engine.model.decoder.shape.vocab_size
    specials = set(tok.all_special_ids) - set(engine.model.eos_token_ids)
    control = [i for i in range(vocab) if any(ord(c) < 0x20 for c in tok.decode([i]))]
    for spec, prefix in (
        (GuidedSpec.json_schema({"type": "string"}), '"'),
        (GuidedSpec("regex", "(.|\n)*"), ""),
    ):
        state = engine.processor.grammars.state(spec)
        state.matcher.accept_string(prefix)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        state.matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = set(engine.guided._unpack(bitmask, vocab)[0].nonzero().flatten().tolist())
        assert not allowed & specials
        assert bool(allowed & set(control)) == (spec.kind == "regex")  # JSON: escaped only


def test_no_utf8_surrogates_after_a_lone_lead_byte(engine, images) -> None:
    # xgrammar accepts 0xed 0xa0-0xbf (a UTF-8-encoded surrogate: three U+FFFD once
    # decoded, over maxLength); the engine's second-byte rule forbids it
    vocab = engine.processor.grammars.vocab_bytes()
    ids = {v: i for i, v in enumerate(vocab) if len(v) == 1}
    msg = ask(engine, images[0], GuidedSpec.json_schema({"type": "string", "maxLength": 4}))
    req = engine.request_state(msg)
    for b in (b'"', b"\xed"):
        assert req.grammar.matcher.accept_token(ids[b])
        req.output_ids.append(ids[b])
    rows = torch.zeros(1, engine.model.decoder.shape.vocab_size)
    (row,) = engine.guided.apply_masks([req], rows)
    assert row[ids[b"\x92"]] == 0.0  # U+D492..: a valid Hangul syllable's second byte
    assert row[ids[b"\xae"]] == float("-inf")  # U+DB80..: a surrogate
    bitmask = xgr.allocate_token_bitmask(1, rows.shape[1])
    req.grammar.matcher.fill_next_token_bitmask(bitmask, 0)
    assert engine.guided._unpack(bitmask, rows.shape[1])[0, ids[b"\xae"]]  # xgrammar allows it


def test_grammar_cache_compiles_once_per_spec_and_is_bounded(loaded) -> None:
    cache = GrammarCache(loaded, capacity=3)
    specs = [GuidedSpec.json_schema(s) for s in SCHEMAS[:5]]
    for _ in range(3):
        cache.state(specs[0])
    assert cache.compiles == 1 and cache.hits == 2
    for spec in specs:
        cache.state(spec)
    assert len(cache) == 3 and cache.compiles == 5
    cache.state(specs[0])  # evicted (least recently used): compiled again
    assert cache.compiles == 6


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "integer", "multipleOf": 7}, "multipleOf"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"const": 1}}}}, "not"),
        ({"allOf": [{"type": "integer"}]}, "allOf"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "if"),
        ({"type": "array", "contains": {"const": 1}}, "contains"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "object", "minProperties": 1}, "minProperties"),
        ({"type": "string", "format": "date"}, "date"),
        ({"$defs": {"x": {"type": "string", "uniqueItems": True}}}, "uniqueItems"),
    ],
)
def test_unenforced_keywords_are_refused_by_name(schema: dict, named: str) -> None:
    with pytest.raises(GrammarError, match=named) as e:
        check_spec(GuidedSpec.json_schema(schema))
    assert e.value.param.startswith("response_format.json_schema.schema")


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (GuidedSpec.json_schema({"type": "strng"}), "type"),
        (GuidedSpec.json_schema({"$ref": "#/$defs/missing"}), "missing"),
        (GuidedSpec.json_schema({"$ref": "#"}), "leads back to itself"),
        (
            GuidedSpec.json_schema(
                {
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            ),
            "leads back to itself",
        ),
        (GuidedSpec.json_schema({"type": "string", "maxLength": -1}), "non-negative"),
        (GuidedSpec.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "greater"),
        (GuidedSpec.json_schema({"type": "integer", "minimum": 9, "maximum": 1}), "lower bound"),
        (GuidedSpec.json_schema({"enum": []}), "non-empty"),
        (GuidedSpec.json_schema(_nested(200)), "nested"),
        (GuidedSpec("regex", "a(b"), "parenthesis"),
        (GuidedSpec("regex", "(?=a)b"), "Lookahead"),
        (GuidedSpec("grammar", 'x ::= "a"'), "root"),
    ],
)
def test_broken_specs_say_what_is_wrong(spec: GuidedSpec, says: str) -> None:
    with pytest.raises(GrammarError, match=says) as e:
        check_spec(spec)
    assert "/project/" not in str(e.value)  # no xgrammar source locations


def test_xgrammar_pins_and_install_lines() -> None:
    assert version("xgrammar") == XGRAMMAR_VERSION
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    test = pyproject.split("test = [", 1)[1].split("]", 1)[0]
    # xgrammar in the dependencies would make pip install triton (its Linux package declares it)
    assert '"xgrammar' not in deps and '"triton' not in deps
    for name in ("apache-tvm-ffi", "typing-extensions", "pydantic"):
        assert re.search(rf'"{name}==[\w.]+"', deps), name
    assert re.search(r'"jsonschema==[\w.]+"', test)
    line = f"pip install --quiet --no-deps xgrammar=={XGRAMMAR_VERSION}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert line in ci and ci.index(line) < ci.index('pip install --quiet -e ".[test')
    readme = (ROOT / "README.md").read_text()
    installs = [ln for ln in readme.splitlines() if "pip install -e" in ln and "&&" in ln]
    assert installs
    for ln in installs:
        assert f"pip install --no-deps xgrammar=={XGRAMMAR_VERSION} && pip install -e" in ln, ln
    assert {"type", "properties", "maxLength", "pattern"} <= ENFORCED_KEYWORDS


@pytest.mark.parametrize("jump", [True, False])
def test_forced_text_that_ends_inside_a_utf8_character(make_engine, photos, jump) -> None:
    # found by the API fuzzer: xgrammar raises UnicodeDecodeError when the forced bytes
    # stop mid-character (after the first byte token of "é"); no jump there, no error
    eng = make_engine(disable_jump_forward=not jump)
    image = eng.processor.prepare_image(photos["cat.png"])
    for spec in (
        GuidedSpec("grammar", 'root ::= "\u00e9\u00e9\u4e2d!"'),
        GuidedSpec.choice(["\u00e9\u4e2d"]),
    ):
        for temperature in (0.0, 1.0):
            (res,) = eng.generate(
                [ask(eng, image, spec, "Say it.", temperature=temperature, seed=3)]
            )
            assert res.finish_reason == "stop", res
            assert res.text in ("\u00e9\u00e9\u4e2d!", "\u00e9\u4e2d"), res.text
    eng.check_accounting()


@pytest.mark.parametrize("jump", [True, False])
def test_forced_end_of_sequence_is_not_an_answer_token(make_engine, photos, jump) -> None:
    # Where the grammar allows nothing but end-of-sequence, that token is the grammar's,
    # not the model's: appended by jump-forward before, sampled under the mask token by
    # token; either way it must not be an output token (nor a logprob, nor counted).
    eng = make_engine(disable_jump_forward=not jump)
    tok = eng.model.tokenizer
    eos = set(eng.model.eos_token_ids)
    image = eng.processor.prepare_image(photos["cat.png"])
    text = "\u5317\u4eac\u5728\u7ebf \U0001f600 ok"
    for temperature in (0.0, 1.0):
        req = ask(
            eng, image, GuidedSpec("regex", text), "Say it.",
            temperature=temperature, seed=5, logprobs=2, return_logits=True,
        )  # fmt: skip
        (res,) = eng.generate([req])
        assert res.text == text and res.finish_reason == "stop"
        assert not eos & set(res.output_ids)
        assert tok.decode(res.output_ids) == text
        assert len(res.logprobs) == len(res.output_ids) == res.completion_tokens
        if not jump:  # one logits row per sampled token (jumped tokens have none)
            assert len(res.logits) == len(res.output_ids)
        assert [lp.token_id for lp in res.logprobs] == res.output_ids
    # an end-of-sequence token the model chose where the grammar also allowed more text
    # is part of the answer: it stays
    biased = {i: 100.0 for i in eos}
    req = ask(eng, image, GuidedSpec("regex", "(ab)+"), "Say it.", logit_bias=biased, logprobs=0)
    (res,) = eng.generate([req])
    assert re.fullmatch("(ab)+", res.text) and res.finish_reason == "stop"
    assert res.output_ids[-1] in eos and len(res.logprobs) == len(res.output_ids)
    eng.check_accounting()
