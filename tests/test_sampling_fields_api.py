"""logit_bias, presence/frequency/repetition penalties and min_tokens over HTTP: applied
on chat completions, ``/v1/images/{id}/ask`` and ``/v1/videos/{id}/qa``; the same
streamed as plain and batched as alone; every bad value a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from tests.helpers import ChatDefaults, assert_error, assert_healthy
from tests.live_server import app_client

KEEP = 1234  # the one id the "all but one" bias leaves


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_total_tokens=8192)


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store"))
    with app_client(engine, default_max_tokens=8, image_store_dir=store) as c:
        yield c


ENDING = ChatDefaults("The end.", max_tokens=10)
body, complete, stream = ENDING.body, ENDING.complete, ENDING.stream


def all_but(engine, keep: int) -> dict[str, float]:
    return {str(i): -100 for i in range(engine.processor.vocab_size) if i != keep}


def forced_text(engine, tok: int, n: int) -> str:
    return engine.model.tokenizer.decode([tok] * n, skip_special_tokens=True)


def test_logit_bias_forces_tokens_on_chat(client, engine) -> None:
    want = forced_text(engine, KEEP, 10)
    plain = complete(client)["choices"][0]["message"]["content"]
    assert plain != want
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        out = complete(client, logit_bias=all_but(engine, KEEP), **kw)
        assert out["choices"][0]["message"]["content"] == want
        assert out["usage"]["completion_tokens"] == 10
    out = complete(client, logit_bias={"77": 100})
    assert out["choices"][0]["message"]["content"] == forced_text(engine, 77, 10)


SETS = {
    "bias": {"logit_bias": {"788": -4.5, "1667": 5}},
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": -1.0},
    "repetition": {"repetition_penalty": 1.7},
    "min_tokens": {"min_tokens": 4, "logit_bias": {"2": 100}},
    # the first token is "dy": a stop string in it counts only without min_tokens
    "min_tokens and stop": {"min_tokens": 2, "stop": ["dy", " ra"]},
    "all, sampled": {
        "temperature": 0.9,
        "seed": 11,
        "logit_bias": {"2": 8},
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
    },
}


@pytest.mark.parametrize("name", sorted(SETS))
def test_streamed_equals_plain(client, name: str) -> None:
    kw = {"logprobs": True, "top_logprobs": 2, "max_tokens": 12, **SETS[name]}
    plain = complete(client, **kw)["choices"][0]
    chunks = stream(client, **kw)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == plain["message"]["content"]
    assert deltas[-1]["finish_reason"] == plain["finish_reason"]
    streamed_lp = [t for d in deltas if d.get("logprobs") for t in d["logprobs"]["content"]]
    assert streamed_lp == plain["logprobs"]["content"]
    if name == "min_tokens and stop":
        assert complete(client, stop=["dy"])["choices"][0]["message"]["content"] == ""
        assert plain["message"]["content"].startswith("dy")
        assert " ra" not in plain["message"]["content"]
    if name == "min_tokens":  # EOS is biased up: it comes right after the 4 tokens
        assert len(plain["logprobs"]["content"]) == 5 and plain["finish_reason"] == "stop"
        assert plain["logprobs"]["content"][-1]["token"] == "</s>"


def test_n_choices_equal_requests_alone(client) -> None:
    kw = {"temperature": 1.0, "seed": 5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
    both = complete(client, n=2, **kw)["choices"]
    for i in range(2):
        alone = complete(client, **{**kw, "seed": 5 + i})["choices"][0]
        assert both[i]["message"]["content"] == alone["message"]["content"]


def test_ask_applies_the_fields_batched_as_alone(client, engine, photos) -> None:
    r = client.post("/v1/images", files={"file": ("c.png", photos["cat.png"])})
    image_id = r.json()["id"]
    questions = ["What is this?", "The end.", "Is it a cat?"]
    kw = {"max_tokens": 6, "temperature": 0, "presence_penalty": 2.0, "repetition_penalty": 1.5}
    r = client.post(f"/v1/images/{image_id}/ask", json={"questions": questions, **kw})
    assert r.status_code == 200, r.text
    answers = [a["answer"] for a in r.json()["answers"]]
    plain = client.post(
        f"/v1/images/{image_id}/ask", json={"questions": questions, "max_tokens": 6}
    ).json()
    assert answers != [a["answer"] for a in plain["answers"]]
    for q, a in zip(questions, answers, strict=True):
        content = [
            {"type": "image_url", "image_url": {"url": image_id}},
            {"type": "text", "text": q},
        ]
        one = complete(client, messages=[{"role": "user", "content": content}], **kw)
        assert one["choices"][0]["message"]["content"] == a
    r = client.post(
        f"/v1/images/{image_id}/ask",
        json={"questions": questions, "max_tokens": 5, "logit_bias": all_but(engine, KEEP)},
    )
    assert [a["answer"] for a in r.json()["answers"]] == [forced_text(engine, KEEP, 5)] * 3


def test_video_qa_applies_the_fields(client, engine) -> None:
    pytest.importorskip("decord")
    from tests.videos import encode_mp4, rgb_frames

    vid = client.post("/v1/videos", files={"file": ("v.mp4", encode_mp4(rgb_frames(6), fps=6))})
    assert vid.status_code == 200, vid.text
    qa = {"questions": ["What is this?"], "num_frames": 2, "max_tokens": 4}
    r = client.post(
        f"/v1/videos/{vid.json()['id']}/qa", json={**qa, "logit_bias": all_but(engine, KEEP)}
    )
    assert r.status_code == 200, r.text
    answers = [e for e in map(json.loads, r.text.splitlines()) if e["type"] == "answer"]
    assert [a["text"] for a in answers] == [forced_text(engine, KEEP, 4)] * 2
    r = client.post(f"/v1/videos/{vid.json()['id']}/qa", json={**qa, "min_tokens": 5})
    assert_error(r, 400, "min_tokens")


def test_min_tokens_raises_the_default_max_tokens(client, engine) -> None:
    eos = str(engine.model.eos_token_ids[0])
    kw = {"max_tokens": None, "logit_bias": {eos: 100}}
    out = complete(client, **kw)
    assert out["usage"]["completion_tokens"] == 1  # EOS at once
    # more than default_max_tokens (8): the default becomes min_tokens
    out = complete(client, min_tokens=12, **kw)
    assert out["usage"]["completion_tokens"] == 12
    assert out["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json=body(max_tokens=None, min_tokens=10**6))
    err = assert_error(r, 400, "min_tokens")
    assert err["param"] == "min_tokens"


BAD = [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"01": 1}}, "logit_bias"),
    ({"logit_bias": {" 5": 1}}, "logit_bias"),
    ({"logit_bias": {"1_0": 1}}, "logit_bias"),
    ({"logit_bias": {"2000": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"-0": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999999999999999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"5": "1.5"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"5": None}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "x"}, "presence_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
    ({"frequency_penalty": "0.5"}, "frequency_penalty"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": "3"}, "min_tokens"),
    ({"min_tokens": False}, "min_tokens"),
    ({"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
]


@pytest.mark.parametrize(("extra", "field"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_values_are_400s_naming_the_field(client, photos, extra: dict, field: str) -> None:
    for stream_ in (False, True):
        r = client.post("/v1/chat/completions", json=body(stream=stream_, **extra))
        err = assert_error(r, 400, field)
        assert err["param"].startswith(field), err
    image_id = client.post("/v1/images", files={"file": ("c.png", photos["cat.png"])}).json()["id"]
    r = client.post(f"/v1/images/{image_id}/ask", json={"questions": ["Hi"], **extra})
    assert assert_error(r, 400, field)["param"].startswith(field)


def test_server_stays_healthy_after_every_bad_value(client) -> None:
    for extra, field in BAD:
        for stream_ in (False, True):
            r = client.post("/v1/chat/completions", json=body(stream=stream_, **extra))
            assert_error(r, 400, field)
    assert_healthy(client)
