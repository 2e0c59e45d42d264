"""Structured output over HTTP: response_format and guided_* on chat completions, /ask and
/qa (n, seed, stop, streaming, logprobs), the 400s for what is not enforced, and 32
concurrent clients mixing constrained and free requests."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
from fastapi.testclient import TestClient

from api.app import ServerSettings, create_app

MODEL = "llava-tiny"
ROOT = Path(__file__).resolve().parents[1]
#: Near-tie bound (nats) between the top two logprobs: a batched run may pick either.
TIE = 1e-3

PHOTO = {
    "type": "object",
    "properties": {
        "what_the_photo_shows": {"type": "string", "maxLength": 16},
        "main_colour": {"enum": ["red", "green", "blue", "other"]},
        "objects": {"type": "integer", "minimum": 0, "maximum": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["what_the_photo_shows", "main_colour", "objects", "tags"],
}
BOX = {
    "type": "object",
    "properties": {
        "box": {
            "type": "array",
            "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 336}] * 4,
            "minItems": 4,
        },
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["box", "confidence"],
}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=32768)


@pytest.fixture(scope="module")
def client(engine):
    settings = ServerSettings(served_model_name=MODEL, max_video_frames=16, max_n=8)
    with TestClient(create_app(engine, settings)) as c:
        yield c


@pytest.fixture(scope="module")
def image_ids(client, photos) -> list[str]:
    ids = []
    for name in ("cat.png", "rocket.jpg", "astronaut.png"):
        r = client.post("/v1/images", files={"file": (name, photos[name])})
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    return ids


def chat(image_id: str | None, question: str, **kw) -> dict:
    content: list[dict] = [{"type": "text", "text": question}]
    if image_id is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_id}})
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 200,
        "temperature": 0,
        **kw,
    }


def post(client: TestClient, body: dict) -> dict:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_healthy(client: TestClient, engine) -> None:
    assert client.get("/health").status_code == 200
    stats = client.get("/v1/cache/stats").json()
    assert stats["running_requests"] == stats["waiting_requests"] == 0
    engine.check_accounting()


def test_json_schema_with_n_seed_logprobs_and_stop(client, image_ids) -> None:
    body = chat(
        image_ids[0],
        "Describe it.",
        response_format=json_schema(PHOTO),
        n=3,
        temperature=1.0,
        seed=11,
        logprobs=True,
        top_logprobs=2,
    )
    out = post(client, body)
    texts = []
    for choice in out["choices"]:
        text = choice["message"]["content"]
        jsonschema.validate(json.loads(text), PHOTO)
        assert choice["finish_reason"] == "stop"
        lps = choice["logprobs"]["content"]
        assert all(lp["logprob"] <= 0 for lp in lps)
        assert any(lp["logprob"] == 0.0 for lp in lps)  # jumped (forced) tokens
        texts.append(text)
    lengths = sum(len(c["logprobs"]["content"]) for c in out["choices"])
    assert out["usage"]["completion_tokens"] == lengths  # one entry per token, jumped ones too
    again = post(client, body)
    assert [c["message"]["content"] for c in again["choices"]] == texts  # seeded
    # a stop string still ends the text (here, in the middle of the JSON)
    cut = post(
        client,
        chat(
            image_ids[0], "Describe it.", response_format=json_schema(PHOTO), stop=["main_colour"]
        ),
    )
    assert cut["choices"][0]["message"]["content"].startswith('{"what_the_photo_shows": "')
    assert "main_colour" not in cut["choices"][0]["message"]["content"]


def test_streamed_constrained_text_equals_the_non_streamed(client, image_ids) -> None:
    body = chat(image_ids[1], "Where is the box?", response_format=json_schema(BOX))
    whole = post(client, body)["choices"][0]["message"]["content"]
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={**body, "stream": True, "logprobs": True, "top_logprobs": 1},
    ) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole
    jsonschema.validate(json.loads(text), BOX)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    streamed_lps = [
        lp
        for c in chunks
        if c["choices"][0]["logprobs"]
        for lp in c["choices"][0]["logprobs"]["content"]
    ]
    # every answer token; the end-of-sequence token the grammar forced is not one
    assert "".join(lp["token"] for lp in streamed_lps) == text
    assert bytes(b for lp in streamed_lps for b in lp["bytes"]) == text.encode()


def test_json_object_regex_choice_and_grammar(client, image_ids) -> None:
    obj = post(
        client,
        chat(image_ids[2], "JSON please.", response_format={"type": "json_object"}, max_tokens=60),
    )
    choice = obj["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    rx = r"[0-9]{1,2} (cats|dogs)"
    for temperature in (0, 1):
        out = post(
            client, chat(image_ids[0], "How many?", guided_regex=rx, temperature=temperature)
        )
        assert re.fullmatch(rx, out["choices"][0]["message"]["content"])
        out = post(
            client,
            chat(image_ids[0], "Which?", guided_choice=["cat", "rocket"], temperature=temperature),
        )
        assert out["choices"][0]["message"]["content"] in ("cat", "rocket")
        grammar = 'root ::= "It is " ("big" | "small") "."'
        out = post(client, chat(None, "Size?", guided_grammar=grammar, temperature=temperature))
        assert out["choices"][0]["message"]["content"] in ("It is big.", "It is small.")
    out = post(client, chat(None, "Free text.", response_format={"type": "text"}, max_tokens=4))
    assert out["choices"][0]["finish_reason"] == "length"  # "text" is no constraint


def test_ask_and_video_qa_with_response_format(client, engine, image_ids) -> None:
    r = client.post(
        f"/v1/images/{image_ids[0]}/ask",
        json={
            "questions": ["What is it?", "What colour?", "How many?"],
            "response_format": json_schema(PHOTO),
            "temperature": 0,
            "max_tokens": 200,
        },
    )
    assert r.status_code == 200, r.text
    for a in r.json()["answers"]:
        jsonschema.validate(json.loads(a["answer"]), PHOTO)
        assert a["finish_reason"] == "stop"
    video = (ROOT / "samples" / "video" / "pans.mp4").read_bytes()
    r = client.post("/v1/videos", files={"file": ("pans.mp4", video, "video/mp4")})
    assert r.status_code == 200, r.text
    r = client.post(
        f"/v1/videos/{r.json()['id']}/qa",
        json={
            "questions": ["Where is the box?", "Anything?"],
            "num_frames": 2,
            "response_format": json_schema(BOX),
            "temperature": 0,
            "max_tokens": 200,
        },
    )
    assert r.status_code == 200, r.text
    answers = [e for e in map(json.loads, r.text.splitlines()) if e["type"] == "answer"]
    assert len(answers) == 4
    for a in answers:
        jsonschema.validate(json.loads(a["text"]), BOX)
        assert a["finish_reason"] == "stop"
    assert_healthy(client, engine)


BAD = [
    ({"response_format": json_schema({"type": "integer", "multipleOf": 3})}, "multipleOf"),
    (
        {
            "response_format": json_schema(
                {"type": "object", "properties": {"t": {"type": "string", "format": "date-time"}}}
            )
        },
        "date-time",
    ),
    ({"response_format": json_schema({"type": "array", "uniqueItems": True})}, "uniqueItems"),
    ({"response_format": json_schema({"type": "text"})}, "type"),
    ({"response_format": json_schema({"$ref": "#/$defs/nope"})}, "nope"),
    ({"response_format": json_schema({"type": "string", "maxLength": "ten"})}, "maxLength"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a(b"}, "parenthesis"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex"),
    ({"guided_grammar": 'start ::= "a"'}, "root"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    # counted repetitions that would take gigabytes to compile: refused before compiling
    ({"guided_regex": "a{100000000}"}, "limit is 100,000"),
    ({"guided_regex": "((ab){1000}){1000}"}, "limit is 100,000"),
    ({"guided_grammar": 'root ::= "a"{100000000}'}, "limit is 100,000"),
]


@pytest.mark.parametrize(("fields", "named"), BAD)
def test_refusals_name_the_problem(client, engine, image_ids, fields: dict, named: str) -> None:
    r = client.post("/v1/chat/completions", json=chat(image_ids[0], "Hi", **fields))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert named in err["message"], err
    assert err["param"] and "/project/" not in err["message"]
    assert_healthy(client, engine)


def test_refusals_on_ask_and_qa(client, engine, image_ids) -> None:
    bad = {"response_format": json_schema({"type": "integer", "not": {"const": 1}})}
    r = client.post(f"/v1/images/{image_ids[0]}/ask", json={"questions": ["a"], **bad})
    assert r.status_code == 400 and "'not'" in r.json()["error"]["message"]
    video = (ROOT / "samples" / "video" / "pans.mp4").read_bytes()
    vid = client.post("/v1/videos", files={"file": ("pans.mp4", video, "video/mp4")}).json()["id"]
    r = client.post(f"/v1/videos/{vid}/qa", json={"questions": ["a"], "guided_regex": "[z-a]"})
    assert r.status_code == 400 and "guided_regex" in r.json()["error"]["message"]
    assert_healthy(client, engine)


def test_32_concurrent_clients_mixing_constrained_and_free(client, engine, image_ids) -> None:
    questions = ["What is it?", "Describe it.", "Where?", "Colours?"]
    jobs = []
    for c in range(32):
        image = image_ids[c % 3]
        q = questions[c % 4]
        if c % 2:
            schema = (PHOTO, BOX)[c // 2 % 2]
            extra = {"temperature": 1.0, "seed": c} if c % 4 == 3 else {}
            jobs.append(
                ("json", schema, chat(image, q, response_format=json_schema(schema), **extra))
            )
        else:
            jobs.append(("free", None, chat(image, q, max_tokens=8, logprobs=True, top_logprobs=2)))
    solo = {i: post(client, body) for i, (kind, _, body) in enumerate(jobs) if kind == "free"}
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda job: post(client, job[2]), jobs))
    for i, ((kind, schema, _), out) in enumerate(zip(jobs, results, strict=True)):
        choice = out["choices"][0]
        if kind == "json":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            assert choice["finish_reason"] == "stop"
            continue
        want = solo[i]["choices"][0]["logprobs"]["content"]
        got = choice["logprobs"]["content"]
        for a, b in zip(want, got, strict=True):
            if a["token"] != b["token"]:  # only a near-tie in the solo run may flip
                top = a["top_logprobs"]
                assert len(top) == 2 and top[0]["logprob"] - top[1]["logprob"] < TIE, (a, b)
                break
    assert_healthy(client, engine)


def test_expansion_estimates_counted_repetitions() -> None:
    from mmserve.structured.spec import MAX_EXPANSION, expansion

    assert expansion("abc") == 3
    assert expansion("a{1000}") == 1000
    assert expansion("(ab){10}{10}") == 200
    assert expansion("\\d{3}-\\d{4}") == 8
    assert expansion("[a-z]{1,64}@x") == 66
    assert expansion('root ::= "ab"{3}') == len("root::=") + 6
    assert expansion("((a{100}){100}){100}") == 10**6 > MAX_EXPANSION
